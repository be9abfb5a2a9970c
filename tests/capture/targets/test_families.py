"""The family matrix: every supported causal-LM family, a tiny random-init model saved with
``save_pretrained``, checked against the model's own forward.

Per family: the derived head spec says what the family does; stored top-k log-probs equal the live
model's own ``forward`` log-probs (float32, <= 1e-4); the bundle teacher reproduces them from the
stored bf16 final hidden state (<= 1e-3); intermediate taps equal HF ``hidden_states[i + 1]``; the
bundle stores the lm_head once when tied, in the checkpoint's dtype, and no model weights file. The
slow part runs each family end to end: capture -> verify -> train 5 steps -> eval.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.inputs import Conversation
from tapdraft.capture.targets.load import TESTED_LM_FAMILIES, load_target
from tapdraft.cli import app
from tapdraft.shards.bundle import TOKENIZER_DIR, WEIGHTS_FILE, load_bundle, write_bundle
from tapdraft.shards.head import HeadSpec, teacher_logits
from tests.capture.lm_families import EXPECTED_HEAD, FAMILIES, WORDS, save_family


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return request.param, save_family(request.param, tmp_path_factory.mktemp(request.param))


def _conv(i: int, n_prompt: int, n_reply: int) -> Conversation:
    words = lambda n, o: " ".join(WORDS[(o + 7 * j) % len(WORDS)] for j in range(n))  # noqa: E731
    return Conversation(f"c{i}", "mem", [{"role": "user", "content": words(n_prompt, i)},
                                         {"role": "assistant", "content": words(n_reply, 3 * i + 1)}])


def _own(target, ids: torch.Tensor):
    """The model's own forward on one unpadded sequence: logits, HF hidden_states, last layer's output (float32)."""
    from tapdraft.capture.hooks import LayerTaps

    L = target.num_layers
    with torch.no_grad(), LayerTaps(target.layers, [L - 1]) as taps:
        out = target.lm(input_ids=ids[None], output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states, taps.out[L - 1][0]


def test_tested_families_are_the_matrix():
    assert set(TESTED_LM_FAMILIES) == {f.removesuffix("_tied") for f in FAMILIES}


def test_capture_and_bundle_equal_the_models_own_forward(family, tmp_path):
    name, d = family
    target = load_target(d)
    want = HeadSpec(**{"eps": target.head.spec.eps, "tied": target.head.spec.tied, **EXPECTED_HEAD.get(name, {})})
    assert target.head.spec == want
    L, k = target.num_layers, 8
    batch = [target.prepare(_conv(0, 9, 12), 0), target.prepare(_conv(1, 4, 6), 1)]  # padded batch
    res = run_batch(target, batch, SampleSpec(tap_ids=list(range(L)), top_k=k, final_hidden=True))
    write_bundle(tmp_path / "target", **target.bundle_parts())
    bundle = load_bundle(tmp_path / "target", verify=True)
    assert bundle.head == target.head.spec
    for p, r in zip(batch, res):
        logits, hs, last = _own(target, p.token_ids)
        for i in range(L - 1):  # intermediate taps are HF hidden_states[i + 1] (the last one is post-norm there)
            torch.testing.assert_close(r["taps"][:, i].float(), hs[i + 1][0].to(torch.bfloat16).float(),
                                       rtol=1e-2, atol=1e-2)
        rows = r["topk_rows"].long()
        logp = torch.log_softmax(logits, -1)[rows]
        assert (r["topk_logprobs"] - logp.gather(1, r["topk_ids"].long())).abs().max() <= 1e-4
        assert (r["topk_logprobs"] - logp.topk(k, -1).values).abs().max() <= 1e-4
        # the bundle alone (its weights and head) is the model's head: exact on the float32 state ...
        teacher = lambda h: torch.log_softmax(teacher_logits(  # noqa: E731
            h, bundle.norm_weight, bundle.lm_head, bundle.head, norm_bias_H=bundle.norm_bias,
            lm_head_bias_V=bundle.lm_head_bias), -1)
        assert (teacher(last[rows]) - logp).abs().max() <= 1e-4
        # ... and close on the stored bf16 final hidden state
        err = (teacher(r["final_hidden"][rows]).gather(1, r["topk_ids"].long()) - r["topk_logprobs"]).abs().max()
        assert err <= 1e-3, f"{name}: bundle teacher differs by {float(err):.2e}"


def test_bundle_stores_what_training_needs_once(family, tmp_path):
    """No weights file of the model, a tied lm_head stored once, the checkpoint's dtype, size = its parts."""
    name, d = family
    target = load_target(d)
    write_bundle(tmp_path / "target", **target.bundle_parts())
    root = tmp_path / "target"
    assert sorted(p.name for p in (root / TOKENIZER_DIR).iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                                       "tokenizer_config.json"]
    b = load_bundle(root)
    spec = target.head.spec
    assert (b.lm_head is b.embed_tokens) == spec.tied
    with open(root / WEIGHTS_FILE, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    stored = sorted(n for n in header if n != "__metadata__")
    assert ("lm_head" in stored) != spec.tied and ("lm_head_bias" in stored) == spec.lm_head_bias
    parts = sum(t.numel() * t.element_size() for t in (b.embed_tokens, b.norm_weight, b.norm_bias, b.lm_head_bias)
                if t is not None) + (0 if spec.tied else b.lm_head.numel() * b.lm_head.element_size())
    parts += sum(p.stat().st_size for p in (root / TOKENIZER_DIR).iterdir())
    files = [p for p in root.rglob("*") if p.is_file()]
    assert [p.name for p in files if p.suffix in (".safetensors", ".bin", ".pt")] == [WEIGHTS_FILE]
    # bundle.json (a few kB of metadata) is left out: at these sizes it would be most of the 1%
    total = sum(p.stat().st_size for p in files if p.name != "bundle.json")
    assert parts <= total <= 1.01 * parts


def test_bundle_keeps_the_checkpoint_dtype(tmp_path):
    d = save_family("qwen3", tmp_path / "m", dtype=torch.bfloat16)
    target = load_target(d)  # computes in float32
    assert target.lm.dtype == torch.float32 and target.checkpoint_dtype == torch.bfloat16
    write_bundle(tmp_path / "target", **target.bundle_parts())
    b = load_bundle(tmp_path / "target")
    assert b.embed_tokens.dtype == b.lm_head.dtype == torch.bfloat16
    assert torch.equal(b.lm_head.float(), target.lm.get_output_embeddings().weight)  # exact: bf16 -> fp32 -> bf16


def _ok(*args):
    res = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.slow
def test_capture_verify_train_eval(family, tmp_path):
    name, d = family
    man = tmp_path / "train.jsonl"
    recs = [{"id": f"c{i}", "conversations": [{"from": "User", "type": "text", "value": c.messages[0]["content"]},
                                              {"from": "Assistant", "type": "text", "value": c.messages[1]["content"]}]}
            for i, c in enumerate(_conv(i, 3 + i % 5, 4 + i % 7) for i in range(8))]
    man.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ds, run = str(tmp_path / "ds"), str(tmp_path / "run")
    _ok("capture", "--target", str(d), "--data", str(man), "--out", ds, "--top-k", "4", "--draft-layers", "2")
    assert "0 problem(s), OK" in _ok("verify", ds)
    norm = EXPECTED_HEAD.get(name, {}).get("norm", "rms")
    assert f"head: {norm} eps=" in _ok("inspect", ds)
    _ok("train", "--data", ds, "--recipe", "dflash_demo", "--set", "max_steps=5", "--set", "log_every=5",
        "--set", "ckpt_every=5", "--set", "drafter.kd=exact", "--out", run)
    assert "tau =" in _ok("eval", "--draft", run, "--data", ds)


def test_the_head_proof_holds_when_the_target_runs_in_bf16(family):
    """Capture on a GPU loads the target in bf16: the derived head must still pass its proof there."""
    name, d = family
    target = load_target(d, dtype=torch.bfloat16)
    assert target.lm.dtype == torch.bfloat16
    assert target.head.spec == load_target(d).head.spec
