"""The live target's head, derived from the model and checked against the model's own forward.

The bundle declares how hidden rows become logits and ids become input embeddings
(``shards.head.HeadSpec``). Capture does not look that up in a table of family names: it reads it
from what the model itself uses, then proves it on a probe input.

- final norm: the decoder's one child module, other than its layers and embeddings, whose only
  parameters are a [H] weight (and a [H] bias); its kind is found by behaviour: the module is run on
  a probe and compared with each kind ``shards.head`` can apply (RMSNorm, RMSNorm with unit offset,
  LayerNorm with its bias). Its epsilon is the module's (``variance_epsilon``/``eps``).
- lm_head: the model's output embeddings; a bias when the module has one; tied when it is the very
  tensor of the input embeddings.
- embedding scale: the input-embedding module's ``scalar_embed_scale`` (Gemma's scaled embedding,
  ``models/gemma/modeling_gemma.py``) times the config's ``embedding_multiplier`` (Granite multiplies
  the input embeddings inside its decoder, ``models/granite/modeling_granite.py``).
- logits: the config's ``logits_scaling`` (Granite divides its logits, same file) and
  ``final_logit_softcapping`` (``models/gemma2/modeling_gemma2.py``, Gemma3 alike): fields the
  family's forward reads.

The proof (:func:`check_head`): one short forward of the whole model; the input of decoder layer 0
must equal ``shards.head.embed`` of the ids, and the model's own logits must equal
``shards.head.teacher_logits`` of its last decoder layer's output. A model whose head does anything
else is refused in one line naming what differs, never captured approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tapdraft.capture.hooks import LayerTaps
from tapdraft.shards.head import NORM_KINDS, HeadSpec, embed, final_norm, teacher_logits


class UnsupportedHead(ValueError):
    """The target's head cannot be described by a ``HeadSpec``; capturing it would be approximate."""


@dataclass
class LiveHead:
    """A live target's head: its spec and the tensors the bundle stores (the model's own, not copies)."""

    spec: HeadSpec
    embed_tokens: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    norm_bias: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None

    def logits(self, last_RH: torch.Tensor) -> torch.Tensor:
        """The target's logits [R, V] (at least float32) of pre-norm last-layer rows."""
        return teacher_logits(last_RH, self.norm_weight, self.lm_head, self.spec,
                              norm_bias_H=self.norm_bias, lm_head_bias_V=self.lm_head_bias)

    def bundle_parts(self) -> dict[str, Any]:
        """``shards.bundle.write_bundle``'s weight and head arguments."""
        return {"head": self.spec, "embed_tokens": self.embed_tokens, "norm_weight": self.norm_weight,
                "lm_head": self.lm_head, "norm_bias": self.norm_bias, "lm_head_bias": self.lm_head_bias}


def final_norm_module(decoder: nn.Module, hidden: int) -> nn.Module:
    """The decoder's final norm: its one direct child (not the layers, not an embedding) holding only a
    [hidden] weight and optionally a [hidden] bias."""
    found = []
    for name, m in decoder.named_children():
        if isinstance(m, (nn.ModuleList, nn.Embedding)):
            continue
        params = dict(m.named_parameters())
        vectors = all(tuple(p.shape) == (hidden,) for p in params.values())
        if set(params) in ({"weight"}, {"weight", "bias"}) and vectors:
            found.append((name, m))
    if len(found) != 1:
        raise UnsupportedHead(
            f"cannot tell the final norm of {type(decoder).__name__}: candidates {[n for n, _ in found]}; "
            "tapdraft needs exactly one [hidden] norm module beside the decoder layers"
        )
    return found[0][1]


def _norm_eps(m: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    raise UnsupportedHead(f"the final norm {type(m).__name__} has no epsilon attribute (variance_epsilon or eps)")


@torch.no_grad()
def describe_norm(m: nn.Module) -> tuple[str, float]:
    """(kind, eps) of a norm module: the kind of NORM_KINDS whose formula reproduces the module on a probe."""
    eps = _norm_eps(m)
    w = m.weight
    bias = getattr(m, "bias", None)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, w.shape[0], generator=g) * 3).to(w.device, torch.float32)
    want = m(x.to(w.dtype)).float()
    tol = 1e-4 if w.dtype == torch.float32 else 3e-2
    for kind in NORM_KINDS:
        if (kind == "layer") != (bias is not None):
            continue
        got = final_norm(x.to(w.dtype), w, HeadSpec(norm=kind, eps=eps), bias).float()
        if (got - want).abs().max() <= tol * (1 + want.abs().max()):
            return kind, eps
    raise UnsupportedHead(
        f"the final norm {type(m).__name__} is none of the kinds tapdraft can apply ({', '.join(NORM_KINDS)}); "
        "describe it in shards.head (a new norm kind) to capture this model"
    )


def derive_head(lm: nn.Module) -> LiveHead:
    """The head of an HF causal LM (or a composite speech LLM: its text decoder), from the model itself."""
    config = lm.config.get_text_config()
    decoder = lm.get_decoder()
    hidden = int(config.hidden_size)
    norm = final_norm_module(decoder, hidden)
    kind, eps = describe_norm(norm)
    emb_mod, out = lm.get_input_embeddings(), lm.get_output_embeddings()
    if not isinstance(out, nn.Linear):
        raise UnsupportedHead(f"the output head {type(out).__name__} is not a linear layer; "
                              "tapdraft applies x @ W^T + b")
    scale = (float(getattr(emb_mod, "scalar_embed_scale", 1.0))
             * float(getattr(config, "embedding_multiplier", None) or 1.0))
    cap = getattr(config, "final_logit_softcapping", None)
    tied = out.weight is emb_mod.weight or out.weight.data_ptr() == emb_mod.weight.data_ptr()
    spec = HeadSpec(
        norm=kind, eps=eps, logits_scaling=float(getattr(config, "logits_scaling", None) or 1.0), embed_scale=scale,
        lm_head_bias=out.bias is not None, final_logit_softcap=None if cap is None else float(cap), tied=tied,
    )
    return LiveHead(spec, emb_mod.weight, norm.weight, out.weight, getattr(norm, "bias", None), out.bias)


@torch.no_grad()
def check_head(lm: nn.Module, head: LiveHead, *, forward_scales_logits: bool = True, tokens: int = 6) -> None:
    """Prove ``head`` on the model's own forward over a few token ids, or raise :class:`UnsupportedHead`.

    ``forward_scales_logits`` False: the model's forward leaves out the LM's ``logits_scaling`` (transformers'
    composite Granite Speech), so its logits are divided by it before the comparison.
    """
    layers = lm.get_decoder().layers
    dev = head.lm_head.device
    V = int(head.embed_tokens.shape[0])
    ids = (torch.arange(tokens, device=dev) * 7919 % V)[None]  # spread over the vocabulary, deterministic
    seen: dict[str, torch.Tensor] = {}

    def pre(_m, args, kwargs):
        seen["x0"] = args[0] if args else kwargs["hidden_states"]

    handle = layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with LayerTaps(layers, [len(layers) - 1]) as taps:
            logits = lm(input_ids=ids, use_cache=False).logits[0].float()
        if not forward_scales_logits:
            logits = logits / head.spec.logits_scaling
    finally:
        handle.remove()
    low = head.lm_head.dtype != torch.float32
    tol = 3e-2 if low else 1e-4
    want_x0 = embed(ids, head.embed_tokens, head.spec)[0].float()
    err = (seen["x0"][0].float() - want_x0).abs().max()
    if err > tol * (1 + want_x0.abs().max()):
        raise UnsupportedHead(
            f"{type(lm).__name__}'s first decoder layer does not see embed_scale ({head.spec.embed_scale:g}) x its "
            f"embedding rows (max |diff| {float(err):.3g}); tapdraft cannot describe its input embedding"
        )
    got = head.logits(taps.out[len(layers) - 1][0])
    err = (got - logits).abs().max()
    if err > tol * (1 + logits.abs().max()):
        raise UnsupportedHead(
            f"{type(lm).__name__}'s logits differ from the head tapdraft derived ({head.spec}) by up to "
            f"{float(err):.3g}: its output head does something tapdraft cannot describe yet"
        )
