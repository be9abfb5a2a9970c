"""Tiny random-init causal LMs of every supported family, saved with ``save_pretrained`` (the real
on-disk layout: config.json, model.safetensors, tokenizer files), plus a word-level tokenizer with a
simple chat template of our own that marks assistant turns with ``{% generation %}``.

Each family sets the fields its head reads to values that matter at these sizes (a soft cap near the
logits' range, a logits divisor and an embedding multiplier away from 1, norm weights and biases moved
off their 0/1 init), so a head applied wrongly fails the tests. Weights keep HF's default init (0.02):
the error bf16 storage of the final hidden state adds to log-probs grows with the logits' spread (at
init 0.2, logit std ~1.3, it reaches 5e-3; at 0.02 it stays under the matrix's 1e-3 bound).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

WORDS = [f"w{i}" for i in range(60)]
VOCAB = 192
H, LAYERS, HEADS, KV, HEAD_DIM, FFN = 32, 3, 2, 1, 16, 64

TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }} <|im_end|>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tokenizer():
    from tapdraft.demo.target import build_word_tokenizer

    tok = build_word_tokenizer(WORDS)
    tok.chat_template = TEMPLATE
    assert len(tok) <= VOCAB
    return tok


def _common(**over: Any) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256,
                pad_token_id=0, bos_token_id=None, eos_token_id=3)
    base.update(over)
    return base


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        "qwen3": lambda: tf.Qwen3Config(**_common(tie_word_embeddings=False)),
        "qwen3_tied": lambda: tf.Qwen3Config(**_common(tie_word_embeddings=True)),
        "qwen2": lambda: tf.Qwen2Config(**_common(tie_word_embeddings=True)),
        "llama": lambda: tf.LlamaConfig(**_common()),
        "mistral": lambda: tf.MistralConfig(**_common()),
        "gemma": lambda: tf.GemmaConfig(**_common()),
        "gemma2": lambda: tf.Gemma2Config(**_common(final_logit_softcapping=0.5, query_pre_attn_scalar=HEAD_DIM)),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**_common(final_logit_softcapping=0.5,
                                                             query_pre_attn_scalar=HEAD_DIM, sliding_window=8)),
        "phi3": lambda: tf.Phi3Config(**{k: v for k, v in _common().items() if k != "head_dim"}),
        "phi": lambda: tf.PhiConfig(**{k: v for k, v in _common(num_key_value_heads=HEADS).items() if k != "head_dim"}),
        "granite": lambda: tf.GraniteConfig(**_common(logits_scaling=4.0, embedding_multiplier=3.0,
                                                      residual_multiplier=0.5, attention_multiplier=1 / HEAD_DIM)),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                          decoder_sparse_step=1)),
        "olmoe": lambda: tf.OlmoeConfig(**{k: v for k, v in _common(num_experts=4, num_experts_per_tok=2).items()
                                           if k != "head_dim"}),
    }


FAMILIES = tuple(_configs())

EXPECTED_HEAD = {
    "qwen3": {"norm": "rms", "tied": False},
    "qwen3_tied": {"norm": "rms", "tied": True},
    "qwen2": {"norm": "rms", "tied": True},
    "gemma": {"norm": "rms_offset", "embed_scale": math.sqrt(H), "tied": True},
    "gemma2": {"norm": "rms_offset", "embed_scale": math.sqrt(H), "final_logit_softcap": 0.5},
    "gemma3_text": {"norm": "rms_offset", "embed_scale": math.sqrt(H), "final_logit_softcap": 0.5},
    "phi": {"norm": "layer", "lm_head_bias": True},
    "granite": {"logits_scaling": 4.0, "embed_scale": 3.0},
}
"""What the derived head must say per family (fields not named: the HeadSpec default)."""


def save_family(name: str, d: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A tiny random-init ``name`` model and the tokenizer, saved to ``d`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(_configs()[name]()).eval()
    with torch.no_grad():  # biases and norm weights start at 0 / 1: move them so that applying them matters
        for n, p in lm.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    lm.to(dtype).save_pretrained(d)
    tokenizer().save_pretrained(d)
    return d
