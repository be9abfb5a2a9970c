"""Taps by hooks, pre-norm last layer, exact teacher top-k."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import tapdraft.capture.targets as targets_pkg

from tapdraft.capture.forward import SampleSpec, run_batch, topk_teacher
from tapdraft.capture.inputs import Conversation
from tapdraft.capture.targets.base import NOT_PROVEN_ON_VLLM, Target
from tapdraft.capture.targets.causal_lm import CausalLMTarget
from tapdraft.capture.targets.load import LEGACY_TARGET_KINDS, manifest_target_kind
from tapdraft.capture.targets.salm.target import SALMTarget
from tapdraft.shards.schema import teacher_rows
from tests.capture.speech_models import audio_conv


def _conv(sid, n_samples, seed, reply="you said one two ."):
    return audio_conv("<|audioplaceholder|>", sid, n_samples, seed, reply)


@pytest.fixture()
def target(salm):
    return SALMTarget(salm)


def test_taps_equal_direct_forward_on_merged_embeddings(target):
    L = target.num_layers
    taps = list(range(L))
    batch = [target.prepare(_conv("a", 20000, 0), 0), target.prepare(_conv("b", 7000, 1, "you said one ."), 1)]
    assert batch[0].length != batch[1].length  # the batch is padded
    with torch.no_grad():
        res = run_batch(target, batch, SampleSpec(tap_ids=taps, top_k=0))
        for p, r in zip(batch, res):
            ex = target.salm.expand(p.token_ids, p.assistant_mask, target.salm.encode_audio(p.waveforms))
            assert r["input_ids"].tolist() == ex.input_ids.tolist() and r["taps"].shape[0] == p.length
            hs = target.lm(inputs_embeds=ex.inputs_embeds[None], output_hidden_states=True).hidden_states
            for j, i in enumerate(taps[:-1]):  # hidden_states[i + 1] = output of layer i, for every non-last layer
                torch.testing.assert_close(r["taps"][:, j].float(), hs[i + 1][0].to(torch.bfloat16).float(),
                                           rtol=0.02, atol=0.02)


def test_last_tap_is_prenorm_and_bundle_reproduces_logits(target):
    L = target.num_layers
    p = target.prepare(_conv("a", 16000, 0), 0)
    with torch.no_grad():
        r = run_batch(target, [p], SampleSpec(tap_ids=[L - 1], top_k=0, final_hidden=True))[0]
        ex = target.salm.expand(p.token_ids, p.assistant_mask, target.salm.encode_audio(p.waveforms))
        out = target.lm(inputs_embeds=ex.inputs_embeds[None], output_hidden_states=True)
    post_norm = out.hidden_states[-1][0]
    last = r["final_hidden"].double()
    torch.testing.assert_close(r["taps"][:, 0], r["final_hidden"])
    assert (last - post_norm.double()).abs().max() > 0.1  # hidden_states[-1] is post-norm: not the tap
    parts = target.bundle_parts()
    eps, w, head = parts["config"]["rms_norm_eps"], parts["norm_weight"].double(), parts["lm_head"].double()
    # exact pre-norm state from a float32 hook (the stored bf16 one is rounded)
    with torch.no_grad():
        r32 = {}
        h = target.layers[L - 1].register_forward_hook(
            lambda m, i, o: r32.setdefault("h", o[0] if isinstance(o, tuple) else o))
        target.lm(inputs_embeds=ex.inputs_embeds[None])
        h.remove()
    x = r32["h"][0].double()
    logits = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w) @ head.T
    torch.testing.assert_close(logits, out.logits[0].double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, x, rtol=0.01, atol=0.01)  # the stored one is that state in bf16


def test_topk_logprobs_are_full_softmax_at_teacher_rows_only(target):
    L, k = target.num_layers, 5
    p = target.prepare(_conv("a", 16000, 0), 0)
    with torch.no_grad():
        r = run_batch(target, [p], SampleSpec(tap_ids=[L - 1], top_k=k, final_hidden=True))[0]
        ex = target.salm.expand(p.token_ids, p.assistant_mask, target.salm.encode_audio(p.waveforms))
        logits = target.lm(inputs_embeds=ex.inputs_embeds[None]).logits[0].double()
    rows = teacher_rows(r["loss_mask"])
    assert torch.equal(r["topk_rows"], rows)
    assert rows.numel() == int(r["loss_mask"][1:].sum()) and rows.numel() < r["loss_mask"].numel() - 1
    ref = torch.log_softmax(logits, dim=-1)[rows.long()]  # float64 reference over the FULL vocabulary
    got = torch.gather(ref, 1, r["topk_ids"].long())
    torch.testing.assert_close(r["topk_logprobs"].double(), got, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["topk_logprobs"].double(), ref.topk(k, dim=-1).values, rtol=1e-4, atol=1e-4)
    assert (r["topk_logprobs"].exp().sum(-1) < 1 + 1e-5).all()


def test_topk_chunking_is_invisible(target):
    torch.manual_seed(0)
    h = torch.randn(37, target.hidden_size)
    a = topk_teacher(h, target.head, 4, row_chunk=5)
    b = topk_teacher(h, target.head, 4, row_chunk=1024)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_a_head_config_the_forward_ignores_is_refused(target):
    from tapdraft.capture.head import UnsupportedHead

    target.lm.config.logits_scaling = 2.5  # Qwen3's forward never reads it: the derived head would be wrong
    try:
        with pytest.raises(UnsupportedHead, match="logits differ") as e:
            target.head
        assert "\n" not in str(e.value)
    finally:
        target.lm.config.logits_scaling = None


def test_causal_lm_target_text_only(salm):
    t = CausalLMTarget(salm.lm, salm.tokenizer)
    conv = Conversation("t", "mem", [{"role": "user", "content": "what did i say ?"},
                                     {"role": "assistant", "content": "you said one ."}])
    p = t.prepare(conv, 0)
    r = run_batch(t, [p], SampleSpec(tap_ids=[0, t.num_layers - 1], top_k=3))[0]
    assert r["taps"].shape == (p.length, 2, t.hidden_size) and not r["is_audio"].any()
    with pytest.raises(ValueError, match="text-only"):
        t.prepare(_conv("a", 16000, 0), 0)


def test_nonfinite_outputs_are_refused_by_the_writer_check(target):
    from tapdraft.shards.schema import all_finite

    p = target.prepare(_conv("a", 16000, 0), 0)
    w = target.lm.get_input_embeddings().weight
    with torch.no_grad():
        saved = w.clone()
        w.fill_(float("nan"))
        try:
            r = run_batch(target, [p], SampleSpec(tap_ids=[0], top_k=2))
        finally:
            w.copy_(saved)
    assert not all_finite(r[0]["taps"])


def test_features_from_prepare_equal_batched_featurization(target):
    batch = [target.prepare(_conv("a", 20000, 0), 0), target.prepare(_conv("b", 7000, 1), 1)]
    with torch.no_grad():
        pre = target.embed(batch)
        for p in batch:
            p.features = []
        direct = target.embed(batch)
    for a, b in zip(pre, direct):
        torch.testing.assert_close(a.inputs_embeds, b.inputs_embeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["wav2vec2", "qwen2_5_omni", "voxtral_realtime"])
def test_unsupported_model_type_is_one_line_naming_what_is_supported(tmp_path, model_type):
    import json

    from tapdraft.capture.targets.load import load_target

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ValueError) as e:
        load_target(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"{model_type!r} is not supported" in msg
    assert "qwen2_audio, qwen3_asr, voxtral, granite_speech" in msg and "SALM" in msg and "causal LM" in msg
    assert "tested: qwen3, qwen2, llama" in msg and "To add a speech LLM, register its loader" in msg


def test_a_final_norm_of_no_known_kind_is_refused_in_one_line():
    from tapdraft.capture.head import UnsupportedHead, describe_norm

    class ScaleNorm(torch.nn.Module):  # normalises by the L2 norm, not the RMS: no HeadSpec kind
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return self.weight * x / (x.norm(dim=-1, keepdim=True) + self.eps)

    with pytest.raises(UnsupportedHead, match="ScaleNorm is none of the kinds") as e:
        describe_norm(ScaleNorm())
    assert "\n" not in str(e.value)


def _adapters() -> list[type[Target]]:
    """Every concrete target adapter under capture/targets/ (each module imported, then Target's subclasses)."""
    for m in pkgutil.walk_packages(targets_pkg.__path__, "tapdraft.capture.targets."):
        importlib.import_module(m.name)
    out, todo = [], [Target]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("tapdraft.capture.targets.") and not getattr(cls, "__abstractmethods__", None):
            out.append(cls)
    return out


def test_every_adapter_declares_its_own_kind_and_vllm_support():
    kinds = {cls: cls.kind for cls in _adapters()}
    assert len(kinds) >= 7 and all(kinds.values()) and len(set(kinds.values())) == len(kinds), kinds
    assert set(kinds.values()) >= set(LEGACY_TARGET_KINDS.values())
    runs = {cls.kind for cls in kinds if cls.vllm_refused is None}
    assert runs == {"causal_lm", "qwen2_audio"}  # proven equal in tests/engines; the rest say why not
    refused = [cls.vllm_refused for cls in kinds if cls.kind not in runs]
    assert all(isinstance(why, str) and len(why) > 40 for why in refused)


def test_a_subclass_inherits_neither_the_kind_nor_the_vllm_support():
    class Renamed(CausalLMTarget):
        pass

    assert CausalLMTarget.vllm_refused is None
    assert Renamed.kind == "" and Renamed.vllm_refused == NOT_PROVEN_ON_VLLM


def test_vllm_refuses_by_the_adapters_declaration():
    from tapdraft.capture.targets.hf_speech import Qwen2AudioTarget, Qwen3ASRTarget
    from tapdraft.capture.vllm.engine import check_target
    from tapdraft.common.errors import CaptureError

    check_target(object.__new__(CausalLMTarget))
    check_target(object.__new__(Qwen2AudioTarget))
    with pytest.raises(CaptureError, match="does not capture qwen3_asr targets: vLLM's qwen3_asr module imports"):
        check_target(object.__new__(Qwen3ASRTarget))  # a subclass of Qwen2AudioTarget, refused all the same


def test_old_manifests_name_the_target_kind_by_class():
    assert manifest_target_kind({"target_kind": "Qwen2AudioTarget"}) == "qwen2_audio"
    assert manifest_target_kind({"target_kind": "NeMoSALMTarget"}) == "nemo_salm"
    assert manifest_target_kind({"target_kind": "SALMTarget"}) == "salm"
    assert manifest_target_kind({"target_kind": "salm"}) == "salm"
    assert manifest_target_kind({"placeholder": None}) is None
    assert len(LEGACY_TARGET_KINDS) == 7 and all(k.endswith("Target") for k in LEGACY_TARGET_KINDS)


def test_a_capture_refuses_a_target_without_a_kind_before_writing(salm, tmp_path):
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tests.capture.util import conv_record, write_manifest

    class Unnamed(SALMTarget):
        pass

    man = write_manifest(tmp_path / "in.jsonl", [conv_record("u0", "missing.wav")])
    cfg = CaptureConfig(target=str(tmp_path), out=str(tmp_path / "ds"), data=(("train", str(man)),), progress=False)
    with pytest.raises(ValueError, match="Unnamed declares no kind"):
        capture(cfg, target=Unnamed(salm))
    assert not (tmp_path / "ds").exists()  # nothing written, the --out this run made removed
