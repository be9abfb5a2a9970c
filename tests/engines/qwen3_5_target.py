"""A tiny Qwen3.5 text target in its real on-disk layout, its own MTP module included.

``Qwen3_5ForCausalLM.save_pretrained`` writes config.json + model.safetensors without ``mtp.*``
(transformers has no MTP module and drops ``mtp.*`` on load: ``_keys_to_ignore_on_load_unexpected``),
so the MTP tensors are added to the safetensors afterwards under the names the released checkpoints
use, as vLLM's ``qwen3_5_mtp.py`` loads them (``Qwen3_5MultiTokenPredictor``: ``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``, ``mtp.layers.0.*`` a full-attention
``Qwen3_5DecoderLayer``; its ``load_weights`` renames ``mtp.`` to ``model.``) and as NeMo Automodel's Qwen3.5
state-dict adapter maps them (``mtp.fc.weight`` <-> ``eh_proj``, ``mtp.pre_fc_norm_embedding`` <-> ``enorm``, ...).
``mtp_num_hidden_layers: 1`` is the config field both read. Every layer is full attention (vLLM's CPU
path has no gated-delta-net kernels) and the head dim is 32 (vLLM's CPU attention refuses 16 and 24).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, pad_token_id=0, eos_token_id=3,
             bos_token_id=None, tie_word_embeddings=False)


def save_qwen3_5(d: Path, seed: int = 0, init_std: float = 0.2) -> Path:
    """Save the target to ``d``: vocabulary = the word tokenizer's (every reply decodes and re-encodes to
    itself); random init with std ``init_std`` (greedy replies are then not one repeated token)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from tests.capture.lm_families import tokenizer

    tok = tokenizer()
    torch.manual_seed(seed)
    layers = ["full_attention"] * SIZES["num_hidden_layers"]
    cfg = tf.Qwen3_5TextConfig(**SIZES, vocab_size=len(tok), layer_types=layers,
                               initializer_range=init_std)
    model = tf.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # (1 + w) norms start at w = 0: move them off it so a wrong norm shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    H = cfg.hidden_size
    layer = Qwen3_5DecoderLayer(cfg, 0)  # layer 0 is full attention, as the MTP layer is
    g = torch.Generator().manual_seed(seed + 1)
    mtp = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    for k, v in mtp.items():  # the layer's own init leaves linears at transformers' post-init default
        mtp[k] = torch.randn(v.shape, generator=g) * (0.1 if "norm" in k else init_std)
    mtp["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * init_std
    for k in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        mtp[k] = torch.randn(H, generator=g) * 0.1
    weights = load_file(str(d / "model.safetensors"))
    assert not any(k.startswith("mtp.") for k in weights)
    save_file({**weights, **{k: v.contiguous() for k, v in mtp.items()}}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    return d
