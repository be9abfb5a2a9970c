"""Bad datasets: each defect gets an error naming the file and what to do; verify lists them all."""

import hashlib
import json
import shutil

import pytest
from typer.testing import CliRunner

from tapdraft.cli import app
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_index import index_name
from tests.shards.synthetic import random_sample, tiny_layout, write_dataset
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter

CFG = ShardConfig(shard_bytes=2500, batch_bytes=800)
LENGTHS = [5, 8, 3, 9, 6, 4, 7]


@pytest.fixture(params=["arrow", "wds"])
def good(tmp_path, request):
    root = tmp_path / "ds"
    man = write_dataset(str(root), tiny_layout(), ShardConfig(format=request.param, shard_bytes=2500,
                                                              batch_bytes=800), LENGTHS)
    assert len(man["splits"]["train"]["shards"]) >= 3
    return root, man


def _patch_manifest(root, fn):
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    (root / "manifest.json").write_text(json.dumps(m))


def test_good_dataset_verifies_and_inspects(good):
    root, man = good
    rep = verify_dataset(str(root), progress=False)
    assert rep.ok, rep.problems
    assert rep.samples_checked == len(LENGTHS) and rep.shards_checked == len(man["splits"]["train"]["shards"])
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 0 and "OK" in r.output
    r = CliRunner().invoke(app, ["inspect", str(root), "--sample", "2"])
    assert r.exit_code == 0, r.output
    assert "fingerprint" in r.output and "taps" in r.output and "[3, 2, 16]" in r.output
    assert "head: rms eps=1e-06, untied" in r.output


def test_missing_and_incomplete_manifest(good):
    root, _ = good
    _patch_manifest(root, lambda m: m.update(complete=False))
    with pytest.raises(ValueError, match=r"manifest\.json says complete: false.*Resume the capture"):
        open_dataset(str(root))
    assert any("complete is not true" in p for p in verify_dataset(str(root), progress=False).problems)
    (root / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"manifest\.json not found"):
        open_dataset(str(root))
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and "manifest.json: missing" in r.output


def test_an_empty_split_is_a_problem(good):
    root, _ = good

    def add_empty(m):  # as an older tapdraft finalized a split whose every input was skipped
        m["splits"]["validation"] = {"samples": 0, "tokens": 0, "supervised_tokens": 0, "audio_seconds": 0.0,
                                     "bytes": 0, "shards": []}
        m["skipped"]["validation"] = [{"index": 0, "sample_id": "v0", "reason": "no supervised tokens", "rank": 0}]

    _patch_manifest(root, add_empty)
    from tapdraft.shards import manifest as mf
    from tapdraft.shards.integrity import file_record

    m = json.loads((root / "manifest.json").read_text())
    card = mf.render_card(m).encode()  # that finalize wrote its card from this manifest: the split in its data_files
    (root / "README.md").write_bytes(card)
    _patch_manifest(root, lambda m: m.update(card=file_record(card)))
    rep = verify_dataset(str(root), progress=False)
    assert rep.problems == [f"{root}/manifest.json: split validation has no samples (1 skipped); first skip reason: "
                            "'v0': no supervised tokens; re-capture it with inputs the target can use"]


def test_unknown_schema_major(good):
    root, _ = good
    _patch_manifest(root, lambda m: m.update(schema_version="3.0"))
    with pytest.raises(ValueError, match="schema_version '3.0'.*reads majors 1, 2"):
        open_dataset(str(root))
    assert any("unknown major" in p for p in verify_dataset(str(root), progress=False).problems)


def test_truncated_and_corrupted_shards_all_reported(good):
    root, man = good
    shards = man["splits"]["train"]["shards"]
    p0, p1 = root / shards[0]["name"], root / shards[1]["name"]
    p0.write_bytes(p0.read_bytes()[:-40])  # truncated
    data = bytearray(p1.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong sha256
    p1.write_bytes(bytes(data))
    (root / "data" / "train-rank00000-00009.arrow.tmp").write_bytes(b"x")
    rep = verify_dataset(str(root), progress=False)
    text = "\n".join(rep.problems)
    assert f"{shards[0]['name']}: truncated" in text
    assert f"{shards[1]['name']}: sha256" in text
    assert "train-rank00000-00009.arrow.tmp: not listed" in text
    assert not rep.ok
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and r.output.count("PROBLEM") == len(rep.problems) >= 3
    with pytest.raises(ValueError, match=shards[0]["name"] + " has .* bytes, the manifest says"):  # refused when opened
        open_dataset(str(root))


def test_shard_of_another_target_is_caught(good, tmp_path):
    root, man = good
    fmt = man["format"]
    other = tmp_path / "other"
    with DatasetWriter(str(other), ShardConfig(format=fmt, shard_bytes=2500, batch_bytes=800), tiny_layout(),
                       fingerprint="f" * 64) as w:
        for i, T in enumerate(LENGTHS):
            w.write(random_sample(tiny_layout(), T, i, audio_frames=T // 4), i)
    shard0 = man["splits"]["train"]["shards"][0]
    foreign = sorted((other / "data").iterdir())[0]
    shutil.copy(foreign, root / shard0["name"])
    data = foreign.read_bytes()

    def fix(m):  # make size and sha consistent so only the fingerprint is wrong
        sh = m["splits"]["train"]["shards"][0]
        sh["bytes"], sh["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        m["splits"]["train"]["bytes"] = sum(s["bytes"] for s in m["splits"]["train"]["shards"])
        part = json.loads((other / "_parts" / "train-rank00000.json").read_text())
        sh["index"] = part["shards"][0]["index"]  # and the foreign shard's own index file, below
        shutil.copy(other / index_name(part["shards"][0]["name"]), root / index_name(sh["name"]))

    _patch_manifest(root, fix)
    rep = verify_dataset(str(root), progress=False)
    assert any(shard0["name"] in p and "fffffffffff" in p for p in rep.problems), rep.problems
    with pytest.raises(ValueError, match="fingerprint ffffffffffff"):  # the head, checked on the shard's first read
        list(open_dataset(str(root)).stream("train", seed=0, shuffle=False))


def test_counts_that_disagree_with_content_are_reported(tmp_path):
    root = tmp_path / "ds"
    write_dataset(str(root), tiny_layout(), CFG, LENGTHS)
    _patch_manifest(root, lambda m: m["splits"]["train"]["shards"][0].update(tokens=999))
    rep = verify_dataset(str(root), progress=False)
    assert any("holds tokens=" in p and "manifest says 999" in p for p in rep.problems)
    assert any("split train says tokens" in p for p in rep.problems)


def test_wrong_shape_between_manifest_and_shards_is_reported(tmp_path):
    root = tmp_path / "ds"
    write_dataset(str(root), tiny_layout(), CFG, LENGTHS)

    def widen(m):  # the manifest claims H=32 while the shards hold H=16
        m["layout"]["hidden_size"] = 32
        m["field_meta"]["layout"]["hidden_size"] = 32

    _patch_manifest(root, widen)
    rep = verify_dataset(str(root), progress=False)
    text = "\n".join(rep.problems)
    assert "schema dtypes/layout differ" in text
    assert "unreadable" in text and "expected 64" in text  # bf16 field bytes vs the claimed shape
    ds = open_dataset(str(root))
    with pytest.raises(ValueError, match=r"train-00000-of-\d+\.arrow: sample 0 does not match"):
        ds.sample("train", 0)


def test_duplicate_sample_ids_fail_verify(tmp_path):
    from tapdraft.shards.finalize import finalize_dataset
    from tests.shards.synthetic import tiny_bundle

    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    w = DatasetWriter(str(tmp_path), ShardConfig(shard_bytes=1500), layout)
    for i, sid in enumerate(["a", "dup", "b", "dup"]):
        w.write(random_sample(layout, 6, i, sample_id=sid), i)
    w.close()
    finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    problems = verify_dataset(str(tmp_path), progress=False).problems
    assert len(problems) == 1 and "sample_id 'dup' of split train is also in" in problems[0], problems


def test_sample_any_format_and_out_of_range(good):
    from tapdraft.common.errors import SampleIndexError

    root, man = good
    ds = open_dataset(str(root))
    in_order = [s["sample_id"] for s in ds.stream("train", seed=0, shuffle=False)]
    assert [ds.sample("train", i)["sample_id"] for i in range(len(LENGTHS))] == in_order
    with pytest.raises(SampleIndexError, match=r"sample 99999 is out of range: split 'train' .* has 7 samples"):
        ds.sample("train", 99999)
    with pytest.raises(SampleIndexError):
        ds.sample("train", -1)


def test_the_card_is_covered_by_the_manifest_and_older_manifests_still_verify(good, tmp_path):
    """A card edited after finalize passed verify (and pull said "verified"); a manifest written before the card was
    recorded has no record of it and verifies as before."""
    from tapdraft.common.errors import CorruptShardError
    from tapdraft.shards.transfer import pull

    root, man = good
    card = root / "README.md"
    assert man["card"] == {"bytes": card.stat().st_size, "sha256": hashlib.sha256(card.read_bytes()).hexdigest()}
    card.write_text(card.read_text().replace("tapdraft dataset", "tapdraft datasat"))  # same size, other bytes
    rep = verify_dataset(str(root), progress=False)
    assert [p for p in rep.problems if p.startswith(str(card))] and len(rep.problems) == 1, rep.problems
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and "not the card the manifest records" in r.output
    with pytest.raises(CorruptShardError, match="README.md: not the card the manifest records"):
        pull(str(root), str(tmp_path / "copy"), progress=False)
    card.unlink()
    assert any("README.md: missing" in p for p in verify_dataset(str(root), progress=False).problems)
    _patch_manifest(root, lambda m: m.pop("card"))  # as a dataset finalized before the card was recorded
    card.write_text("edited")
    assert verify_dataset(str(root), progress=False).ok


def _edit_bundle(root, **config):
    meta = root / "target" / "bundle.json"
    doc = json.loads(meta.read_text())
    doc["config"].update(config)
    meta.write_text(json.dumps(doc, indent=2, sort_keys=True))


@pytest.mark.parametrize("edit", [{"max_position_embeddings": 7}, {"layer_types": ["full_attention"] * 4},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}},
                                  {"model_type": "other"}])
def test_every_key_of_bundle_json_is_covered_by_the_manifest_and_older_manifests_still_read(good, tmp_path, edit):
    """The serving keys are outside the target fingerprint, so an edit of one passed verify and flowed into exports;
    the manifest records bundle.json's bytes, and verify, readers, derive and pull refuse any other bytes, naming the
    file. A manifest written before the record has none: the fingerprinted keys are checked as before, and a serving
    key within the schema reads as before."""
    from tapdraft.common.errors import CorruptShardError
    from tapdraft.shards.transfer import pull

    root, man = good
    meta = root / "target" / "bundle.json"
    assert man["bundle"] == {"bytes": meta.stat().st_size, "sha256": hashlib.sha256(meta.read_bytes()).hexdigest()}
    _edit_bundle(root, **edit)
    rep = verify_dataset(str(root), progress=False)
    assert len(rep.problems) == 1 and f"{meta} is not the bundle.json the dataset's manifest records" in \
        rep.problems[0], rep.problems
    r = CliRunner().invoke(app, ["verify", str(root)])
    assert r.exit_code == 1 and "is not the bundle.json the dataset's manifest records" in r.output
    with pytest.raises(CorruptShardError, match="re-copy target/ from the original dataset") as e:
        open_dataset(str(root)).bundle()
    assert str(e.value).startswith(str(meta)) and "\n" not in str(e.value)
    with pytest.raises(CorruptShardError, match="bundle.json is not the bundle.json the dataset's manifest records"):
        pull(str(root), str(tmp_path / "copy"), progress=False)
    from tapdraft.shards.derive import DeriveConfig, derive_dataset

    with pytest.raises(CorruptShardError, match="bundle.json is not the bundle.json the dataset's manifest records"):
        derive_dataset(DeriveConfig(src=str(root), out=str(tmp_path / "derived"), progress=False))
    _patch_manifest(root, lambda m: m.pop("bundle"))  # as a dataset finalized before bundle.json was recorded
    key = next(iter(edit))
    fingerprinted = key == "model_type"
    rep = verify_dataset(str(root), progress=False)
    assert rep.ok != fingerprinted, rep.problems
    if fingerprinted:
        assert "corrupted or was edited" in rep.problems[0]
    else:
        assert open_dataset(str(root)).bundle().config[key] == edit[key]


def test_a_bundle_value_outside_the_schema_fails_verify_even_under_an_older_manifest(good):
    """Without the manifest's record (older datasets) a serving key is checked by the schema: `<script>` as layer
    kinds, a zero context length."""
    root, _ = good
    _patch_manifest(root, lambda m: m.pop("bundle"))
    for key, value in (("layer_types", "<script>"), ("max_position_embeddings", 0)):
        _edit_bundle(root, **{key: value})
        rep = verify_dataset(str(root), progress=False)
        assert len(rep.problems) == 1 and f"bundle.json: {key} = {json.dumps(value)} is not " in rep.problems[0], \
            rep.problems
        with pytest.raises(ValueError, match=f"{key} = .* is not "):
            open_dataset(str(root)).bundle()
        _edit_bundle(root, **{key: None})
    assert verify_dataset(str(root), progress=False).ok


@pytest.mark.parametrize("damage", ["arrow_without_topk_ids", "tar_cut_short"])
def test_each_problem_line_says_to_re_copy_once(tmp_path, damage):
    """Issue 57: verify's line for a shard without its topk_ids column ended "re-copy it (or re-capture it)); re-copy
    or re-capture it": the reader's message gave the advice and verify's wrapper added its own. The wrapper now adds
    it only to a reason without it (``verify.unreadable_problem``)."""
    from tests.shards.hostile import good_dataset, rewrite_columns, wds_dataset

    if damage == "arrow_without_topk_ids":
        root = good_dataset(tmp_path / "ds")
        shard = str(root / rewrite_columns(root, drop="topk_ids"))
    else:
        root = wds_dataset(tmp_path / "ds")
        shard = str(root / json.loads((root / "manifest.json").read_text())["splits"]["train"]["shards"][0]["name"])
        with open(shard, "r+b") as f:
            f.truncate(3000)
    problems = verify_dataset(str(root), progress=False).problems
    unreadable = [p for p in problems if p.startswith(f"{shard}: unreadable after")]
    assert len(unreadable) == 1, problems
    for p in problems:
        assert p.count("re-copy") == 1 and p.count("re-capture") == 1, p
    from tapdraft.shards.verify import unreadable_problem

    plain = unreadable_problem(shard, 3, ValueError(f"{shard}: a reason without advice"))
    assert plain == f"{shard}: unreadable after 3 samples (a reason without advice); re-copy or re-capture it"
