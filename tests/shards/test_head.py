"""The bundle's head: hidden rows -> logits, against float64 definitions and a real model's forward."""

import pytest
import torch

from tapdraft.shards.head import HeadSpec, final_norm, project, teacher_logits


def test_teacher_logits_match_float64_definition():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 16, generator=g, dtype=torch.float64) * 3
    w = 1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64)
    W = torch.randn(40, 16, generator=g, dtype=torch.float64)
    for scaling in (1.0, 4.0):
        spec = HeadSpec(eps=1e-5, logits_scaling=scaling)
        ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w) @ W.T / scaling
        torch.testing.assert_close(teacher_logits(h, w, W, spec), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(project(final_norm(h, w, spec), W, spec), ref, rtol=1e-12, atol=1e-12)


def test_teacher_logits_equal_the_models_own_head():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5))
    lm.eval()
    ids = torch.randint(0, 50, (1, 7))
    pre = {}
    hook = lm.model.layers[-1].register_forward_hook(lambda m, i, o: pre.update(h=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        logits = lm(ids).logits[0]
    hook.remove()
    spec = HeadSpec.from_config(lm.config.to_dict())
    assert spec.eps == 1e-5 and spec.logits_scaling == 1.0
    got = teacher_logits(pre["h"][0], lm.model.norm.weight, lm.lm_head.weight, spec)
    assert torch.equal(got, logits.float())


def test_head_spec_from_legacy_config_round_trip_and_refusals():
    legacy = HeadSpec.from_config({"rms_norm_eps": 1e-6, "logits_scaling": None})
    assert legacy == HeadSpec(eps=1e-6, logits_scaling=1.0)
    spec = HeadSpec(norm="layer", eps=1e-5, embed_scale=8.0, lm_head_bias=True, final_logit_softcap=30.0, tied=True)
    assert HeadSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="does not know"):
        HeadSpec.from_dict({**spec.to_dict(), "rope_in_head": True})
    with pytest.raises(ValueError, match="norm kind"):
        HeadSpec(norm="layernorm")
    with pytest.raises(ValueError, match="softcap"):
        HeadSpec(final_logit_softcap=0.0)
    with pytest.raises(ValueError, match="logits_scaling"):
        HeadSpec(logits_scaling=0.0)
    with pytest.raises(ValueError, match="eps"):
        HeadSpec(eps=-1.0)


def test_every_head_kind_matches_its_float64_definition():
    from tapdraft.shards.head import embed

    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 16, generator=g, dtype=torch.float64) * 3
    w = 0.2 * torch.randn(16, generator=g, dtype=torch.float64)
    nb = torch.randn(16, generator=g, dtype=torch.float64)
    W = torch.randn(40, 16, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    rms = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    layer = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5) * w + nb
    cases = [  # (spec, normalised rows, lm_head bias, logits from raw z)
        (HeadSpec(norm="rms_offset", eps=1e-5, final_logit_softcap=3.0), rms * (1 + w), None,
         lambda z: 3.0 * torch.tanh(z / 3.0)),
        (HeadSpec(norm="layer", eps=1e-5, lm_head_bias=True), layer, b, lambda z: z),
        (HeadSpec(norm="rms", eps=1e-5, logits_scaling=4.0), rms * w, None, lambda z: z / 4.0),
    ]
    for spec, x, bias, post in cases:
        ref = post(x @ W.T + (0 if bias is None else bias))
        got = teacher_logits(h, w, W, spec, norm_bias_H=nb if spec.norm == "layer" else None, lm_head_bias_V=bias)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="bias"):
        teacher_logits(h, w, W, HeadSpec(lm_head_bias=True))  # a declared bias must be given
    ids = torch.tensor([[3, 0, 39]])
    torch.testing.assert_close(embed(ids, W, HeadSpec(embed_scale=4.0)), W[ids] * 4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", [HeadSpec(), HeadSpec(logits_scaling=2.0), HeadSpec(final_logit_softcap=5.0)],
                         ids=["plain", "scaled", "capped"])
def test_adding_a_projection_in_place_is_bitwise_z_plus_project(dtype, spec):
    from tapdraft.shards.head import add_projection_

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 16, generator=g), torch.randn(40, 16, generator=g).to(dtype)
    z = torch.randn(6, 40, generator=g)
    want = z + project(x, w, spec)
    got = add_projection_(z.clone(), x, w, spec)
    assert got.dtype == torch.float32 and torch.equal(got, want)
