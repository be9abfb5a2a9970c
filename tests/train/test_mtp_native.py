"""The target's own MTP module (``train.drafters.mtp_native``): Qwen3.5's block against a float64 re-implementation of
vLLM's module, initialised from the checkpoint's ``mtp.*``, what it refuses, and the export's copy of the target."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engines import vllm_qwen3_5_mtp as ref
from tests.engines.qwen3_5_target import save_qwen3_5
from tapdraft.train.drafters.mtp_native.config import MTPNativeConfig
from tapdraft.train.drafters.mtp_native.model import Qwen3_5MTP, read_checkpoint, text_config


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_qwen3_5(tmp_path_factory.mktemp("q35") / "target")


def test_module_is_vllms_qwen3_5_mtp_in_float64(target):
    cfg, mtp = read_checkpoint(target)
    m = Qwen3_5MTP(text_config(cfg)).double()
    m.load_state_dict({k[len("mtp."):]: v.double() for k, v in mtp.items()})
    vcfg, P = ref.load(target)  # the checkpoint loads into vLLM's parameter set, every one of them
    g = torch.Generator().manual_seed(0)
    T, H = 11, cfg["hidden_size"]
    ids = torch.randint(0, cfg["vocab_size"], (T,), generator=g)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    pos = torch.arange(T) + 3  # not starting at 0: RoPE offsets matter
    want = ref.forward(vcfg, P, ids, hidden, pos)
    emb = P["model.embed_tokens.weight"][ids]
    with torch.no_grad():
        got = m.norm(m.step(0, emb[None], hidden[None], pos[None]))[0]
    assert (got - want).abs().max() < 1e-5  # transformers' rotary builds cos / sin in float32 (measured 4.7e-7)
    # the gate, (1 + w) norms and partial RoPE all matter here: a plain-norm reference differs
    plain = dict(P, **{k: v - 1.0 for k, v in P.items() if k.endswith("norm.weight")})
    assert (ref.forward(vcfg, plain, ids, hidden, pos) - want).abs().max() > 1e-3


def test_checkpoint_names_and_shapes(target):
    cfg, mtp = read_checkpoint(target)
    hd, nh = cfg["head_dim"], cfg["num_attention_heads"]
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * nh * hd, cfg["hidden_size"])  # query + gate
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight"} <= set(mtp)


def test_refusals(target, tmp_path):
    with pytest.raises(ValueError, match="drafter.checkpoint"):
        MTPNativeConfig()
    with pytest.raises(ValueError, match="post_norm"):
        MTPNativeConfig(checkpoint=str(target), recursion="pre_norm")
    with pytest.raises(ValueError, match="num_speculative_tokens: 1"):
        MTPNativeConfig(checkpoint=str(target), num_depths=2)
    with pytest.raises(ValueError, match="leave it null"):
        MTPNativeConfig(checkpoint=str(target), head_dim=16)
    cfg, _ = read_checkpoint(target)
    with pytest.raises(ValueError, match="ships no MTP module"):
        text_config({k: v for k, v in cfg.items() if k != "mtp_num_hidden_layers"})
    with pytest.raises(ValueError, match="family: mtp"):
        text_config({**cfg, "model_type": "qwen3"})
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_checkpoint(tmp_path)


def test_export_is_the_target_with_its_mtp_replaced(target, tmp_path):
    from safetensors.torch import load_file

    from tapdraft.train.drafters.mtp_native.export import export_native

    _, mtp = read_checkpoint(target)
    new = {k: v + 1.0 for k, v in mtp.items()}
    cfg = {"tapdraft": {"family": "mtp_native", "mtp_config": {"checkpoint": str(target), "num_depths": 1}}}
    out = export_native(new, cfg, tmp_path / "export", {"source_checkpoint": "/somewhere", "step": 7})
    a, b = load_file(str(target / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(b[k], new[k] if k.startswith("mtp.") else a[k]), k
    doc = json.loads((out / "config.json").read_text())
    assert doc["architectures"] == ["Qwen3_5ForCausalLM"] and doc["mtp_num_hidden_layers"] == 1
    assert str(target) not in json.dumps(doc) and "/somewhere" not in json.dumps(doc)  # no local paths
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
