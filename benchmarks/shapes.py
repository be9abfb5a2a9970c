"""Random-initialised targets at real model shapes, for benchmarks that the demo's 0.8M parameters hide.

A shape names the decoder's widths and vocabulary, not its knowledge: activations of a random model
have no outlier channels, so compression figures also need a trained model (the demo target); time
and memory figures need the real widths, which is what this module builds.

    qwen3-1024x8   Qwen3ForCausalLM, hidden 1024, 8 layers, 16 heads (8 KV, head_dim 128), MLP 3072,
                   vocab 151,936, untied lm_head: 437M parameters (Qwen3-0.6B's widths, fewer layers)
    qwen3-256x4    hidden 256, 4 layers, vocab 8,192; qwen3-64x2: hidden 64, 2 layers, vocab 4,096 (checks)
    llama-576x8    SmolLM2-135M's widths (hidden 576, 9 heads, 3 KV, MLP 1536, vocab 49,152), 8 of its 30 layers:
                   the peer trainers' comparison (benchmarks/peers.py builds a bundle at these widths, no model)

The directory is an ordinary HF causal-LM directory (``save_pretrained`` of the model and a
tokenizer with a ChatML template), so ``capture`` loads it through its real path. Conversations are
user -> assistant turns of random words, 512-2048 tokens each, deterministic in the seed.

    python -m benchmarks.shapes qwen3-1024x8 DIR    # build once; later runs reuse DIR
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SHAPES = {
    "qwen3-1024x8": Shape(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=3072, vocab=151_936),
    # small shapes for checks that need a real model but not real costs (benchmarks/gpu.py's CPU/GPU parity)
    "qwen3-256x4": Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=8192),
    "qwen3-64x2": Shape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=4096),
    "llama-576x8": Shape(hidden=576, layers=8, heads=9, kv_heads=3, intermediate=1536, vocab=49_152),
}
WORDS = 4000
"""Tokenizer words (the model's vocabulary stays the shape's: ids above the tokenizer are never fed)."""


def shape_facts(name: str) -> dict[str, int]:
    """hidden_size, num_layers, vocab_size of a named shape (written beside every figure)."""
    s = SHAPES[name]
    return {"hidden_size": s.hidden, "num_layers": s.layers, "vocab_size": s.vocab}


def _words() -> list[str]:
    return [f"w{i}" for i in range(WORDS)]


def synthetic_target(name: str, out: str | Path, *, seed: int = 0) -> Path:
    """Build (or reuse) the random-init target ``name`` in ``out``; returns the directory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tapdraft.demo.target import build_word_tokenizer

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    out = Path(out)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    s = SHAPES[name]
    tok = build_word_tokenizer(_words())
    cfg = Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.hidden // s.heads, max_position_embeddings=4096, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)  # checkpoints ship bf16; capture computes in fp32 on CPU
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def conversations(path: str | Path, n: int, *, seed: int = 0, min_tokens: int = 512, max_tokens: int = 2048) -> Path:
    """``n`` user -> assistant conversations of about min..max tokens, as capture's JSONL."""
    rng = random.Random(seed)
    words = _words()
    path = Path(path)
    with path.open("w") as f:
        for i in range(n):
            total = rng.randint(min_tokens, max_tokens) - 12  # ChatML framing adds about a dozen tokens
            user = rng.randint(total // 4, total // 2)
            turns = [{"role": "user", "content": " ".join(rng.choices(words, k=user))},
                     {"role": "assistant", "content": " ".join(rng.choices(words, k=total - user))}]
            f.write(json.dumps({"id": f"conv-{i}", "conversations": turns}) + "\n")
    return path


if __name__ == "__main__":
    print(synthetic_target(sys.argv[1], sys.argv[2]))


FAMILY_CONFIG = {
    "qwen3": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 1},
    "llama": {"rope_theta": 100_000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
}
"""The bundle config's family fields of a shape (its name's prefix: ``qwen3-1024x8`` is a Qwen3)."""


def synthetic_dataset(root: Path, name: str, *, samples: int, tokens: tuple[int, int], tag: str, seed: int = 0,
                      draft_layers: int = 1, tap_ids: tuple[int, ...] | None = None,
                      self_predicting: bool = False) -> Path:
    """A tapdraft dataset at shape ``name`` with no model behind it (built once; later runs reuse ``root``): a
    bundle of random bf16 embedding and head, and ``samples`` sequences of random ids and taps (``tap_ids``, default
    the ones a ``draft_layers`` DFlash drafter reads; plus the last layer always), ``tokens`` = (shortest, longest)
    each, the second half supervised. For the benchmarks that time training steps at real widths.

    ``self_predicting``: the target predicts its own text, as on data it generated: every token after the first is
    the head's argmax on the previous position's last layer (final norm -> lm_head), that row nudged toward the
    token's lm_head row (0.6 sqrt(H) along it: its logit about 6 against a field whose maximum is about 2, a margin
    no bf16 rounding flips), so a CE on the dataset token and one on the teacher's argmax train the same labels."""
    import torch

    from tapdraft.shards.bundle import write_bundle
    from tapdraft.shards.finalize import finalize_dataset
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.shard_file import ShardConfig
    from tapdraft.shards.taps import default_tap_ids
    from tapdraft.shards.writer import DatasetWriter

    if (root / "manifest.json").is_file():
        return root
    s = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    reads = default_tap_ids(s.layers, draft_layers) if tap_ids is None else tap_ids
    taps = tuple(sorted(set(reads) | {s.layers - 1}))
    layout = Layout(hidden_size=s.hidden, num_layers=s.layers, tap_ids=taps, top_k=0, audio_token_id=0)
    family = name.split("-")[0]
    config = {"model_type": family, "hidden_size": s.hidden, "num_hidden_layers": s.layers, "vocab_size": s.vocab,
              "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.hidden // s.heads,
              "intermediate_size": s.intermediate, "logits_scaling": 1.0, **FAMILY_CONFIG[family]}
    audio = {"sample_rate": 16000, "frame_seconds": 0.08, "placeholder": "<audio>", "placeholder_token_id": 3,
             "audio_token_id": 0}
    embed = (torch.randn(s.vocab, s.hidden, generator=g) * 0.02).to(torch.bfloat16)
    lm_head = (torch.randn(s.vocab, s.hidden, generator=g) * 0.02).to(torch.bfloat16)
    fp = write_bundle(root / "target", config=config, audio=audio, chat_template=None, embed_tokens=embed,
                      norm_weight=torch.ones(s.hidden, dtype=torch.bfloat16), lm_head=lm_head, tokenizer_dir=None)
    lo, hi = tokens
    last = taps.index(s.layers - 1)
    with DatasetWriter(str(root), ShardConfig(), layout, fingerprint=fp) as w:
        for i in range(samples):
            T = lo if lo == hi else int(torch.randint(lo, hi + 1, (1,), generator=g))
            loss = torch.zeros(T, dtype=torch.bool)
            loss[T // 2:] = True
            ids = torch.randint(4, s.vocab - int(self_predicting), (T,), generator=g, dtype=torch.int32)
            x = torch.randn(T, len(taps), s.hidden, generator=g)
            if self_predicting:
                u = lm_head[ids[1:].long()].float()
                x[:-1, last] += 0.6 * s.hidden**0.5 * u / u.norm(dim=-1, keepdim=True)
            w.write({"sample_id": f"s{i}", "source": "bench", "audio_seconds": 0.0,
                     "input_ids": ids, "is_audio": torch.zeros(T, dtype=torch.bool), "loss_mask": loss,
                     "taps": x.to(torch.bfloat16)}, i)
    finalize_dataset(str(root), layout=layout, fingerprint=fp, capture_config={"benchmark": tag})
    return root
