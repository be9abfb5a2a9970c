"""The target's own MTP module as the drafter: Qwen3.5's ``mtp.*``, fine-tuned head-only, served as the target's MTP.

A target that ships an MTP module is served with it by engines (vLLM ``speculative_config={"method": "mtp",
"num_speculative_tokens": K}``), which build that module from the TARGET's config and load the checkpoint's
own ``mtp.*`` tensors. So the drafter here is that module exactly, initialised from the checkpoint's
``mtp.*`` weights (``drafter.checkpoint``: the target's directory; transformers drops ``mtp.*`` on load,
so they are read from its safetensors), trained with the MTP losses (``ce`` or ``lk``, ``train.drafters.mtp.loss``)
and exported as a copy of the target checkpoint with the fine-tuned ``mtp.*`` swapped in
(``mtp_native.export``), which vLLM serves as ``speculative_config={"method": "mtp", "model": EXPORT}``
beside the target (or alone: the copy is the whole target).

Qwen3.5 (``model_type`` ``qwen3_5_text``; vLLM ``qwen3_5_mtp.py``, ``Qwen3_5MultiTokenPredictor``):

    e = pre_fc_norm_embedding(Emb(x_{t+1}));  h = pre_fc_norm_hidden(h^0_t)     (h^0: target output, final-normed)
    h^1 = norm(layers[0](fc([e ; h])))                                           (embedding FIRST)
    logits = lm_head(h^1)

with ``layers[0]`` a full-attention ``Qwen3_5DecoderLayer`` (gated attention: q_proj is [2 * heads * hd, H],
query and a sigmoid output gate per head; QK-norm; partial RoPE, ``partial_rotary_factor`` of the head
dim; SwiGLU) and every norm ``Qwen3_5RMSNorm`` / vLLM's ``GemmaRMSNorm``, which scales by (1 + w). The
modules are transformers' own (``modeling_qwen3_5``), so the block is the checkpoint family's by
construction; ``tests/train/test_mtp_native.py`` checks them against a float64 re-implementation of
vLLM's module. One depth (``num_speculative_tokens: 1``): vLLM drafts a second token by running ``layers[0]``
again at the NEXT position over its own cache, with ``norm``'s output as the hidden state, which
``mtp.model``'s depth chain (depth k at row t, shifted inputs) does not reproduce, so ``num_depths`` is 1.

Targets WITHOUT an MTP module: no engine serves a bolt-on head today (vLLM's MTP loaders build the module
from the target's own config, so a tapdraft head over a Qwen3 target loads nowhere); ``train.drafters.mtp.model`` trains
such heads for offline study and ``tapdraft speculate`` only.

Shapes: Bs batch, T positions, H hidden.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tapdraft.train.drafters.base import Drafter
from tapdraft.train.drafters.common.export_files import weight_files
from tapdraft.train.drafters.mtp.model import MTPDrafter
from tapdraft.train.drafters.mtp_native.export import export_native
from tapdraft.train.drafters.mtp_native.config import MTPNativeConfig

MODEL_TYPES = ("qwen3_5_text",)
"""Target ``model_type`` values whose own MTP module this family builds."""
PREFIX = "mtp."


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, the ``mtp.*`` tensors) of a target checkpoint directory (one safetensors file or an index)."""
    from safetensors import safe_open

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a model checkpoint (no config.json); drafter.checkpoint must name "
                                "the target's directory")
    cfg = json.loads((root / "config.json").read_text())
    mtp: dict[str, torch.Tensor] = {}
    for f in weight_files(root):
        with safe_open(str(root / f), "pt") as st:
            for k in st.keys():
                if k.startswith(PREFIX):
                    mtp[k] = st.get_tensor(k)
    return cfg, mtp


def text_config(cfg: dict[str, Any]) -> Any:
    """The checkpoint's text config as transformers' class (a multimodal config's ``text_config``)."""
    from transformers import Qwen3_5TextConfig

    text = cfg.get("text_config", cfg)
    if text.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {text.get('model_type')!r} has no MTP module tapdraft builds (known: "
                         f"{list(MODEL_TYPES)}); for other targets use family: mtp (a bolt-on head no engine serves)")
    n = int(text.get("mtp_num_hidden_layers") or 0)
    if n < 1:
        raise ValueError("the checkpoint's config has no mtp_num_hidden_layers: this target ships no MTP module")
    keep = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "model_type",
                                                       "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")}
    keep["layer_types"] = ["full_attention"] * n  # the MTP layers, as vLLM builds them
    keep["num_hidden_layers"] = n
    c = Qwen3_5TextConfig(**keep)
    c._attn_implementation = "sdpa"
    return c


class Qwen3_5MTP(nn.Module):
    """Qwen3.5's MTP module under the checkpoint's names (``fc``, ``pre_fc_norm_*``, ``layers.{i}``, ``norm``)."""

    def __init__(self, config: Any) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding)

        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3_5RMSNorm(H, eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)
        for p in self.rotary.parameters():
            p.requires_grad_(False)

    def step(self, layer: int, emb: torch.Tensor, h_prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """emb, h_prev [Bs, T, H], positions [Bs, T] -> the layer's output [Bs, T, H] (before ``norm``), causal."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h_prev)], dim=-1))
        return self.layers[layer](x, position_embeddings=self.rotary(x, pos), attention_mask=None, position_ids=pos)


class MTPNativeDrafter(MTPDrafter):
    family = "mtp_native"
    default_layout = None

    @classmethod
    def export_layout(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], layout: str | None, *,
                      verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One layout: the target's own (MTP's loader layouts are for bolt-on heads)."""
        if layout is None:
            return weights, config
        raise ValueError(f"a {cls.family!r} draft has one export layout: drop --layout")

    @classmethod
    def write_export(cls, out_dir: str | os.PathLike, weights: dict[str, torch.Tensor], config: dict[str, Any],
                     meta: dict[str, Any]) -> Path:
        """A copy of the target checkpoint with its ``mtp.*`` replaced (``mtp_native.export``)."""
        return export_native(weights, config, out_dir, meta)

    def __init__(self, config: MTPNativeConfig, bundle: TargetBundle, layout: Layout) -> None:
        Drafter.__init__(self, config, bundle, layout)
        self.target_config, weights = read_checkpoint(config.checkpoint)
        tc = text_config(self.target_config)
        if (tc.hidden_size, tc.vocab_size) != (int(bundle.config["hidden_size"]), int(bundle.embed_tokens.shape[0])):
            raise ValueError(f"{config.checkpoint} (hidden {tc.hidden_size}, vocab {tc.vocab_size}) is not the target "
                             "this dataset was captured from")
        self.mtp = Qwen3_5MTP(tc)
        own = {PREFIX + k: v for k, v in self.mtp.state_dict().items()}
        missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        if missing or extra:
            raise ValueError(f"{config.checkpoint}'s mtp.* tensors are not its config's MTP module: missing "
                             f"{missing[:4]}, unexpected {extra[:4]}" if weights else
                             f"{config.checkpoint} holds no mtp.* tensors: this checkpoint ships no MTP weights")
        self.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        self.arch = {"hidden_size": tc.hidden_size}
        self.first_layer = 0
        self._frozen_target(config, bundle, layout)
        plain = self.logits_scaling in (None, 1.0) and self.target.lm_head_bias is None
        if self.head_spec.norm != "rms_offset" or not plain:
            raise ValueError(f"the dataset's head ({self.head_spec.norm}) is not Qwen3.5's (1 + w) norm and plain "
                             "lm_head: it was not captured from this target")

    def state_dict(self, *args, **kwargs):  # the rotary table is derived, not a checkpoint tensor
        sd = super().state_dict(*args, **kwargs)
        return type(sd)((k, v) for k, v in sd.items() if ".rotary." not in k)

    def load_state_dict(self, state, strict: bool = True, **kwargs):
        res = super().load_state_dict(state, strict=False, **kwargs)
        bad = [k for k in res.missing_keys if ".rotary." not in k] + list(res.unexpected_keys)
        if strict and bad:
            raise RuntimeError(f"state dict does not match the MTP module: {bad[:6]}")
        return res

    def out_norm(self, k: int, h: torch.Tensor) -> torch.Tensor:
        return self.mtp.norm(h)

    def step(self, k: int, emb: torch.Tensor, h_prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.mtp.step(0, emb, h_prev, pos)

    def export_config(self) -> dict[str, Any]:
        """The target's own config.json (vLLM builds the MTP module from it), plus what tapdraft trained."""
        return {**self.target_config, "tapdraft": {"family": self.family, "target_fingerprint": self.fingerprint,
                                                   "mtp_config": asdict(self.config),
                                                   "num_speculative_tokens": self.config.num_depths,
                                                   "serve_with": {"vllm": {"method": "mtp", "num_speculative_tokens":
                                                                           self.config.num_depths}},
                                                   "block_size": {"vllm": self.config.num_depths + 1}}}


CONFIG = MTPNativeConfig
DRAFTER = MTPNativeDrafter
