"""A reply keeps the ids the target generated: regenerate writes them (``token_ids``), capture stores them.

With a byte-level BPE tokenizer, decoding a reply and encoding the text again can give other ids (the
tokenizer merges what was sampled piece by piece); such replies used to be dropped as ``retokenized``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tapdraft.capture.config import CaptureConfig
from tapdraft.capture.inputs import read_jsonl
from tapdraft.capture.pipeline import capture
from tapdraft.capture.replies.generate import GenerationConfig
from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
from tapdraft.capture.replies.windows import ReplyConfig
from tapdraft.capture.targets.load import load_target
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig
from tests.capture.util import write_manifest

PROMPTS = ["Continue this passage about the function", "Say something about the class", "What does the module do"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A random Qwen3 LM over a 1,024-token byte-level BPE vocabulary with a ChatML template."""
    from tapdraft.demo.bpe import QUICK, build_bpe_lm, build_bpe_tokenizer, corpus_text

    d = tmp_path_factory.mktemp("bpe")
    tok = build_bpe_tokenizer(corpus_text()[:400], QUICK.vocab_size)
    build_bpe_lm(tok, QUICK, seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _split_word(tok, word: str) -> list[int]:
    """Ids that decode to ``word`` one byte-level symbol each (BPE encodes it as fewer, merged ids)."""
    (symbols, _), = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(word)  # byte-level: " " is "Ġ"
    ids = tok.convert_tokens_to_ids(list(symbols))
    assert tok.decode(ids) == word and tok.encode(word, add_special_tokens=False) != ids
    return ids


def _forward_check(bpe_dir: Path, ds_dir: Path) -> list[dict]:
    """Every sample's taps and teacher rows equal the model's own forward on the stored ids."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(bpe_dir).eval()
    ds = open_dataset(str(ds_dir))
    taps = ds.manifest["layout"]["tap_ids"]
    out = []
    for i in range(ds.num_samples("train")):
        s = ds.sample("train", i)
        with torch.no_grad():
            o = lm(input_ids=s["input_ids"][None], output_hidden_states=True)
        for j, t in enumerate(taps):
            if t < lm.config.num_hidden_layers - 1:  # HF's last hidden state is after the final norm
                torch.testing.assert_close(s["taps"][:, j].float(), o.hidden_states[t + 1][0], rtol=0.02, atol=0.02)
        rows = s["topk_rows"].long()
        ref = torch.log_softmax(o.logits[0, rows].double(), -1).topk(s["topk_ids"].shape[1], -1)
        assert torch.equal(s["topk_ids"][:, 0], ref.indices[:, 0])
        torch.testing.assert_close(s["topk_logprobs"].double(), ref.values, rtol=1e-3, atol=1e-3)
        out.append(s)
    return out


def _capture(bpe_dir: Path, data: Path, out: Path) -> dict:
    return capture(CaptureConfig(target=str(bpe_dir), out=str(out), data=(("train", str(data)),), top_k=4,
                                 draft_layers=1, batch_tokens=4096, progress=False, dtype="float32",
                                 shard=ShardConfig(shard_bytes=1 << 20)))


def test_a_reply_whose_text_retokenizes_differently_is_captured_as_its_ids(bpe_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_dir)
    word = next(w for w in (" the", " function", " class", " module") if len(tok.encode(w)) < len(w))
    ids = _split_word(tok, word)
    turns = [{"from": "User", "value": PROMPTS[0]}, {"from": "Assistant", "value": word, "token_ids": ids}]
    data = write_manifest(tmp_path / "in.jsonl", [{"id": "a", "conversations": turns},
                                                  {"id": "b", "conversations": [dict(t) for t in turns[:1]] +
                                                   [{"from": "Assistant", "value": word}]}])
    target = load_target(str(bpe_dir))
    carried, plain = [target.prepare(c, 0) for c in read_jsonl(data, placeholder=target.input_placeholder)]
    prompt = target.template.encode(target.template.render([{"role": "user", "content": PROMPTS[0]}],
                                                           add_generation_prompt=True))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # the prompt as the target saw it, then the carried ids, then the end of turn: those ids and the end supervised
    assert carried.token_ids.tolist()[: len(prompt) + len(ids) + 1] == prompt + ids + [end]
    assert carried.token_ids[carried.assistant_mask].tolist() == ids + [end]
    # without token_ids the same text is tokenized as before (other, merged ids)
    assert plain.token_ids.tolist() == target.template.tokenize(
        [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": word}]).ids.tolist()
    assert plain.token_ids[plain.assistant_mask].tolist() != ids + [end]
    # the dataset stores the carried ids, and its rows are the model's own forward on them
    _capture(bpe_dir, data, tmp_path / "ds")
    got = {s["sample_id"]: s for s in _forward_check(bpe_dir, tmp_path / "ds")}
    assert got["a"]["input_ids"][got["a"]["loss_mask"]].tolist() == ids + [end]


def test_truncated_carried_reply_supervises_no_end_of_turn(bpe_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_dir)
    ids = _split_word(tok, " the")
    target = load_target(str(bpe_dir))
    msgs = [{"role": "user", "content": PROMPTS[1]},
            {"role": "assistant", "content": " the", "token_ids": ids, "truncated": True}]
    t = target.template.tokenize(msgs)
    assert t.ids[t.mask].tolist() == ids  # the template still writes <|im_end|>, which the target never generated
    with pytest.raises(ValueError, match="decode to"):
        target.template.tokenize([msgs[0], {**msgs[1], "token_ids": ids[:-1]}])


def test_regenerate_keeps_the_target_ids_and_capture_stores_them(bpe_dir, tmp_path):
    """A random LM never ends its replies; kept truncated (--on-limit keep), every reply is the generated ids,
    including the replies whose text would re-tokenize differently (the old ``retokenized`` drop)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recs = [{"id": f"r{i}", "conversations": [{"from": "User", "value": p}, {"from": "Assistant", "value": "x"}]}
            for i, p in enumerate(PROMPTS)]
    recs.append({"id": "m", "conversations": [  # multi-turn: the second prompt holds the first reply's ids
        {"from": "User", "value": PROMPTS[0]}, {"from": "Assistant", "value": "x"},
        {"from": "User", "value": PROMPTS[1]}, {"from": "Assistant", "value": "y"}]})
    data = write_manifest(tmp_path / "in.jsonl", recs)
    out = tmp_path / "regen.jsonl"
    doc = regenerate(RegenerateConfig(target=str(bpe_dir), data=str(data), out=str(out), dtype="float32",
                                      replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=12),
                                                          keep_truncated=True), progress=False))
    assert doc["counts"]["written"] == 4 and not doc["counts"]["dropped"]
    tok = AutoTokenizer.from_pretrained(bpe_dir)
    lm = AutoModelForCausalLM.from_pretrained(bpe_dir).eval()
    target = load_target(str(bpe_dir))
    written = [json.loads(x) for x in out.read_text().splitlines()]
    differ = 0
    for rec in written:
        replies = [t for t in rec["conversations"] if t["from"] == "assistant"]
        assert all(t["truncated"] and len(t["token_ids"]) == 12 for t in replies)
        msgs: list[dict] = []
        for t in rec["conversations"]:
            if t["from"] == "user":
                msgs.append({"role": "user", "content": t["value"]})
                continue
            prompt = torch.tensor([target.template.encode_prompt(msgs)])  # earlier replies as their ids
            with torch.no_grad():
                gen = lm.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
            assert t["token_ids"] == gen[0, prompt.shape[1]:].tolist()  # exactly what greedy decoding emits
            assert tok.decode(t["token_ids"]) == t["value"]
            differ += tok.encode(t["value"], add_special_tokens=False) != t["token_ids"]
            msgs.append({"role": "assistant", "content": t["value"], "token_ids": t["token_ids"], "truncated": True})
    assert differ > 0  # some replies re-tokenize to other ids: before, they were dropped
    _capture(bpe_dir, out, tmp_path / "ds")
    got = {s["sample_id"]: s for s in _forward_check(bpe_dir, tmp_path / "ds")}
    for rec in written:
        want = [i for t in rec["conversations"] if t["from"] == "assistant" for i in t["token_ids"]]
        s = got[rec["id"]]
        assert s["input_ids"][s["loss_mask"]].tolist() == want  # truncated: no end of turn supervised


def test_a_template_that_rewrites_the_reply_gives_its_ids_no_place(bpe_dir):
    from transformers import AutoTokenizer

    from tapdraft.capture.template import ChatTemplate

    tok = AutoTokenizer.from_pretrained(bpe_dir)
    ids = _split_word(tok, " the")
    trims = tok.chat_template.replace("{% generation %}{{ m['content']", "{% generation %}{{ (m['content'] | trim)")
    assert trims != tok.chat_template
    msgs = [{"role": "user", "content": PROMPTS[2]}, {"role": "assistant", "content": " the", "token_ids": ids}]
    with pytest.raises(ValueError, match="verbatim"):
        ChatTemplate(tok, trims, end_ids=[tok.eos_token_id]).tokenize(msgs)
    kept = ChatTemplate(tok, end_ids=[tok.eos_token_id]).tokenize(msgs)
    assert kept.ids[kept.mask].tolist() == ids + [tok.eos_token_id]


@pytest.mark.parametrize("turns, match", [
    ([{"from": "User", "value": "hi", "token_ids": [1]}, {"from": "Assistant", "value": "yo"}], "only an assistant"),
    ([{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "yo", "token_ids": "1 2"}], "list of token ids"),
    ([{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "yo", "token_ids": [1, -2]}], "integers >= 0"),
    ([{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "yo", "token_ids": [1], "truncated": "yes"}],
     "true or false"),
    ([{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "yo", "token_ids": [1]},
      {"from": "Assistant", "value": "again"}], "joined"),
])
def test_malformed_carried_ids_are_a_bad_input(turns, match):
    from tapdraft.capture.inputs import parse_record

    with pytest.raises(ValueError, match=match):
        parse_record({"id": "x", "conversations": turns}, base=Path("."), placeholder="<a>", default_id="x")
    clean = [{k: v for k, v in t.items() if k not in ("token_ids", "truncated")} for t in turns]
    ok = parse_record({"id": "x", "conversations": clean}, base=Path("."), placeholder="<a>", default_id="x")
    assert all(set(m) == {"role", "content"} for m in ok[1])  # without ids: the messages as before
