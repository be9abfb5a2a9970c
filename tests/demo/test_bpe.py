"""The BPE quality target: text windows, the cached build, CLI-default capture, the target's own replies."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tapdraft.demo.bpe import FULL, QUICK, BPESize, corpus, prepare_bpe, windows


def test_windows_split_each_text_by_offset():
    size = BPESize(prompt_words=2, reply_words=2)
    texts = [[f"a{i}" for i in range(104)], [f"b{i}" for i in range(54)]]
    g = torch.Generator().manual_seed(0)
    start = lambda p: int(p[0].split()[0][1:])  # noqa: E731
    tr = windows(texts, size, 400, part="train", generator=g)
    va = windows(texts, size, 400, part="validation", generator=g)
    cut = lambda t: int(0.85 * (len(t) - 4))  # noqa: E731
    for pairs, ok in ((tr, lambda t, s: s <= cut(t)), (va, lambda t, s: s > cut(t))):
        for p in pairs:
            t = texts[0] if p[0].startswith("a") else texts[1]
            assert ok(t, start(p)) and len(p[0].split()) == 2 and len(p[1].split()) == 2
            assert p[1].split()[0] == t[start(p) + 2]  # the continuation follows the prompt
    assert {p[0][0] for p in tr} == {"a", "b"}


def test_full_corpus_is_real_text_within_budget():
    texts = corpus(FULL)
    n = sum(len(t) for t in texts)
    assert FULL.corpus_words <= n < FULL.corpus_words + max(len(t) for t in texts)
    assert FULL.vocab_size >= 8192
    with pytest.raises(ValueError, match="vocab_size"):
        BPESize(vocab_size=100)


@pytest.mark.slow
def test_quick_bpe_target_captures_with_cli_defaults_and_decodes_live(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tapdraft import cli
    from tapdraft.capture.inputs import read_jsonl
    from tapdraft.shards.reader import open_dataset
    from tapdraft.speculate.run import SpeculateConfig, run_speculate
    from tapdraft.train.config import load_run_config
    from tapdraft.train.loop import train

    p = prepare_bpe(tmp_path, quick=True, progress=False)
    ds = open_dataset(str(p.dataset))
    assert sorted(ds.splits) == ["train", "validation"] and ds.num_samples("validation") >= 1
    captured = json.loads((p.dataset / "capture_config.json").read_text())
    opts = inspect.signature(cli.capture).parameters
    for name in ("top_k", "draft_layers", "dtype", "codec", "batch_tokens", "format", "final_hidden", "shard_bytes"):
        assert captured[name] == opts[name].default.default, name
    assert captured["responses_from_target"] is True
    # every assistant turn is the target's own greedy reply, token for token (the model's own generate)
    tok = AutoTokenizer.from_pretrained(p.target)
    lm = AutoModelForCausalLM.from_pretrained(p.target).eval()
    conv = next(c for c in read_jsonl(p.val_manifest, placeholder="<|audioplaceholder|>"))
    prompt = tok.apply_chat_template(conv.messages[:1], tokenize=True, return_dict=True, add_generation_prompt=True)
    out = lm.generate(input_ids=torch.tensor([prompt["input_ids"]]), max_new_tokens=QUICK.max_new_tokens,
                      do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ids = out[0, len(prompt["input_ids"]):].tolist()
    ids = ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
    assert tok.decode(ids) == conv.messages[1]["content"]
    # live decoding reads text-only conversations and reproduces the target's greedy output
    run = load_run_config("dflash_demo", overrides=["max_steps=2", "progress=false", "ckpt_every=2"])
    train(run, str(p.dataset), tmp_path / "run")
    r = run_speculate(SpeculateConfig(target=str(p.target), draft=str(tmp_path / "run"), data=str(p.dataset),
                                      conversations=str(p.val_manifest), max_samples=2, max_new_tokens=8),
                      progress=False)
    n = min(2, ds.num_samples("validation"))
    assert r["samples"] == n and r["matches_greedy"] == f"{n}/{n}"
    # a second call reuses everything
    again = prepare_bpe(tmp_path, quick=True, progress=False)
    assert again.info["capture"]["already_complete"] is True
