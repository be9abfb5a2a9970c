"""Tiny random target bundles and synthetic captured-like samples for the trainer's tests.

The samples have structure a drafter can learn: a token sequence follows a fixed random
successor map (next = succ[prev], with occasional noise), the taps carry the current token's
embedding plus noise, and the top-k teacher rows put most mass on the true successor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tapdraft.shards.bundle import load_bundle, write_bundle
from tapdraft.shards.head import HeadSpec
from tapdraft.shards.schema import Layout, teacher_rows, validate_sample


def tiny_bundle(root: Path, *, hidden: int = 32, vocab: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                seed: int = 0, scaling: float = 1.0, config: dict | None = None):
    """``config``: keys replacing (or adding to) the tiny target's config."""
    g = torch.Generator().manual_seed(seed)
    config = {
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "intermediate_size": 2 * hidden, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "logits_scaling": scaling,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **(config or {}),
    }
    write_bundle(
        root / "target", config=config,
        audio={"sample_rate": 16000, "frame_seconds": 0.08, "placeholder": "<|audio|>", "placeholder_token_id": 3,
               "audio_token_id": 3},
        chat_template=None,
        embed_tokens=torch.randn(vocab, hidden, generator=g),
        norm_weight=1.0 + 0.1 * torch.randn(hidden, generator=g),
        lm_head=torch.randn(vocab, hidden, generator=g) / hidden**0.5,
        tokenizer_dir=None,
        # the head spec is what the drafters read the logits scaling from (the config key alone is not)
        **({"head": HeadSpec(logits_scaling=scaling)} if scaling != 1.0 else {}),
    )
    return load_bundle(root / "target")


def tiny_layout(bundle, *, tap_ids=(1, 3), top_k: int = 8, final_hidden: bool = False) -> Layout:
    return Layout(hidden_size=bundle.hidden_size, num_layers=int(bundle.config["num_hidden_layers"]),
                  tap_ids=tuple(tap_ids), top_k=top_k, audio_token_id=3, has_final_hidden=final_hidden)


def supervised_slots(batch: dict, anchors: torch.Tensor, valid: torch.Tensor, block_size: int):
    """(b, j, k, p) for every block slot k >= 1 whose position p = anchor + k is a supervised token: the rows a
    float64 reference of the DFlash loss walks, one by one."""
    for b in range(anchors.shape[0]):
        L = int(batch["lengths"][b])
        for j in range(anchors.shape[1]):
            if not valid[b, j]:
                continue
            for k in range(1, block_size):
                p = int(anchors[b, j]) + k
                if p < L and batch["loss_mask"][b, p]:
                    yield b, j, k, p


def away_from_init(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """``model`` moved like a trained drafter (every parameter + scale * seeded N(0, 1), so convolutions and
    selectors are no longer their identity start), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def synthetic_samples(bundle, layout: Layout, n: int, *, min_len: int = 24, max_len: int = 48, seed: int = 0,
                      noise: float = 0.05) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    V, H = bundle.vocab_size, bundle.hidden_size
    succ = torch.randperm(V - 8, generator=torch.Generator().manual_seed(1234)) + 8  # tokens 8..V-1
    out = []
    for i in range(n):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        n_audio = int(torch.randint(2, 6, (1,), generator=g))
        ids = torch.empty(T, dtype=torch.int32)
        ids[:n_audio] = layout.audio_token_id
        tok = int(torch.randint(8, V, (1,), generator=g))
        for t in range(n_audio, T):
            if torch.rand(1, generator=g) < noise:
                tok = int(torch.randint(8, V, (1,), generator=g))
            else:
                tok = int(succ[tok - 8])
            ids[t] = tok
        is_audio = torch.zeros(T, dtype=torch.bool)
        is_audio[:n_audio] = True
        start = n_audio + int(torch.randint(1, 4, (1,), generator=g))
        loss_mask = torch.zeros(T, dtype=torch.bool)
        loss_mask[start:] = True
        emb = bundle.embed_tokens[ids.long()].float()
        taps = torch.stack([emb * (j + 1) + 0.1 * torch.randn(T, H, generator=g) for j in range(layout.n_taps)], 1)
        s = {"sample_id": f"s{i:04d}", "source": "synthetic", "audio_seconds": n_audio * 0.08,
             "input_ids": ids, "is_audio": is_audio, "loss_mask": loss_mask, "taps": taps.to(torch.bfloat16)}
        if layout.has_final_hidden:
            s["final_hidden"] = (emb + 0.1 * torch.randn(T, H, generator=g)).to(torch.bfloat16)
        if layout.top_k:
            rows = teacher_rows(loss_mask)
            R, k = rows.shape[0], layout.top_k
            logits = torch.randn(R, V, generator=g)
            logits[torch.arange(R), ids[rows.long() + 1].long()] += 6.0
            lp = torch.log_softmax(logits, -1)
            top = lp.topk(k, -1)
            s.update(topk_rows=rows, topk_ids=top.indices.to(torch.int32), topk_logprobs=top.values.float())
        validate_sample(s, layout)
        out.append(s)
    return out


def write_synthetic_dataset(root: Path, bundle, layout: Layout, splits: dict[str, list[dict]], *,
                            fmt: str = "arrow", regenerated: bool | None = None) -> str:
    """A finished dataset at ``root`` (whose ``target/`` already holds ``bundle``) from samples per split."""
    from tapdraft.shards.finalize import finalize_dataset
    from tapdraft.shards.shard_file import ShardConfig
    from tapdraft.shards.writer import DatasetWriter

    cfg = ShardConfig(format=fmt, shard_bytes=64 << 10, batch_bytes=16 << 10)
    for split, samples in splits.items():
        w = DatasetWriter(str(root), cfg, layout, split=split, rank=0)
        for i, s in enumerate(samples):
            w.write(s, i)
        w.close()
    cap = {"synthetic": True}
    if regenerated is not None:
        cap["regenerate"] = regenerated
    finalize_dataset(str(root), layout=layout, fingerprint=bundle.fingerprint, capture_config=cap)
    return str(root)


@dataclass
class InMemoryData:
    """Samples with their bundle and layout, and the tiny dataset written from them (the loop reads ``path``)."""

    samples: list[dict]
    bundle: object
    layout: Layout
    path: str


def tiny_dataset(root: Path, samples: list[dict] | None = None, *, layout: Layout | None = None, n: int = 16,
                 seed: int = 0, min_len: int = 16, max_len: int = 32, bundle_config: dict | None = None,
                 **layout_kw) -> InMemoryData:
    """A finished one-split ("train") dataset at ``root`` read through the real reader (``bundle_config``: keys of
    the target's config to replace)."""
    bundle = tiny_bundle(root, config=bundle_config)
    layout = layout or tiny_layout(bundle, **layout_kw)
    if samples is None:
        samples = synthetic_samples(bundle, layout, n, min_len=min_len, max_len=max_len, seed=seed)
    return InMemoryData(samples, bundle, layout, write_synthetic_dataset(root, bundle, layout, {"train": samples}))
