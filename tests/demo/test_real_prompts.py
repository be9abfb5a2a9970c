"""The real text target's prompts: disjoint splits, held out by module, the same on every run."""

from tapdraft.demo.real.prompts import PENDING, TEMPLATES, prompt_splits


def _module(record):
    return record["id"].split("#")[0].rsplit(".", 1)[0]


def test_splits_are_disjoint_and_held_out_by_module():
    splits = prompt_splits(train=300, validation=20, held_out=20)
    assert {k: len(v) for k, v in splits.items()} == {"train": 300, "validation": 20, "held_out": 20}
    ids = [r["id"] for v in splits.values() for r in v]
    assert len(ids) == len(set(ids))
    seen = {_module(r) for r in splits["train"] + splits["validation"]}
    assert not seen & {_module(r) for r in splits["held_out"]}, "held-out prompts come from unseen modules"
    first = splits["train"][0]["conversations"]
    assert [t["from"] for t in first] == ["User", "Assistant"] and first[1]["value"] == PENDING
    assert prompt_splits(train=300, validation=20, held_out=20) == splits  # deterministic


def test_asking_for_more_than_the_library_documents_is_one_clear_error():
    import pytest

    with pytest.raises(ValueError, match="ask for fewer"):
        prompt_splits(train=10**6, validation=1, held_out=1)
    assert len(TEMPLATES) == 4


def test_requests_of_another_kind_share_nothing_with_the_library_requests():
    from tapdraft.demo.real.prompts import other_prompts

    other = other_prompts(30)
    texts = [r["conversations"][0]["value"] for r in other]
    assert len(set(texts)) == 30 and other_prompts(30) == other  # distinct, deterministic
    assert not [t for t in texts if "python" in t.lower() or "`" in t]
    library = {r["conversations"][0]["value"] for v in prompt_splits(300, 20, 20).values() for r in v}
    assert not library & set(texts)
    import pytest

    with pytest.raises(ValueError, match="ask for fewer"):
        other_prompts(10**4)
