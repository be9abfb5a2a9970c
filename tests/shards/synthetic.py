"""Small valid samples, bundles and datasets from a seed: test scaffolding, never for training.

Random activations have no structure (no outlier channels), so compression figures need real
ones (benchmarks/storage.py); these only exercise shapes, dtypes and control flow.
"""

from __future__ import annotations

from typing import Any

import torch

from tapdraft.shards.bundle import write_bundle
from tapdraft.shards.schema import Layout, teacher_rows

AUDIO_TOKEN_ID = 7


def tiny_layout(**overrides: Any) -> Layout:
    d = dict(hidden_size=16, num_layers=4, tap_ids=(1, 3), top_k=4, audio_token_id=AUDIO_TOKEN_ID)
    d.update(overrides)
    return Layout(**d)


def random_sample(layout: Layout, T: int, seed: int, *, sample_id: str | None = None, vocab: int = 64,
                  audio_frames: int = 0) -> dict[str, Any]:
    """A sample that passes validate_sample: ``audio_frames`` audio positions after a 1-token prefix."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (T,), generator=g, dtype=torch.int64).to(torch.int32)
    is_audio = torch.zeros(T, dtype=torch.bool)
    is_audio[1 : 1 + min(audio_frames, max(T - 1, 0))] = True
    ids[is_audio] = layout.audio_token_id
    loss_mask = torch.zeros(T, dtype=torch.bool)
    loss_mask[T // 2 :] = True
    loss_mask &= ~is_audio
    H, n = layout.hidden_size, layout.n_taps
    s: dict[str, Any] = {
        "sample_id": sample_id or f"s{seed}",
        "source": "synthetic",
        "audio_seconds": 0.08 * int(is_audio.sum()),
        "input_ids": ids,
        "is_audio": is_audio,
        "loss_mask": loss_mask,
        "taps": (torch.randn(T, n, H, generator=g) * 3).to(torch.bfloat16),
    }
    if layout.has_final_hidden:
        s["final_hidden"] = torch.randn(T, H, generator=g).to(torch.bfloat16)
    if layout.has_audio_embeds:
        s["audio_embeds"] = torch.randn(int(is_audio.sum()), H, generator=g).to(torch.bfloat16)
    if layout.top_k > 0:
        rows = teacher_rows(loss_mask)
        R, k = int(rows.shape[0]), layout.top_k
        s["topk_rows"] = rows
        s["topk_ids"] = torch.randint(0, vocab, (R, k), generator=g, dtype=torch.int64).to(torch.int32)
        s["topk_logprobs"] = -torch.rand(R, k, generator=g).sort(dim=-1).values * 5
    return s


def tiny_bundle(out_dir: str, layout: Layout, vocab: int = 64, seed: int = 0, tokenizer_dir: str | None = None) -> str:
    """Write a random target bundle with ``layout``'s width (and the allow-listed files of ``tokenizer_dir``);
    returns its fingerprint."""
    g = torch.Generator().manual_seed(seed)
    H = layout.hidden_size
    config = {
        "model_type": "synthetic", "hidden_size": H, "num_hidden_layers": layout.num_layers, "vocab_size": vocab,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": H // 2, "intermediate_size": 2 * H,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    audio = {"sample_rate": 16000, "frame_seconds": 0.08, "placeholder": "<audio>", "placeholder_token_id": 6,
             "audio_token_id": layout.audio_token_id}
    return write_bundle(out_dir, config=config, audio=audio, chat_template="{{ messages }}",
                        embed_tokens=torch.randn(vocab, H, generator=g).to(torch.bfloat16),
                        norm_weight=torch.ones(H, dtype=torch.bfloat16),
                        lm_head=torch.randn(vocab, H, generator=g).to(torch.bfloat16), tokenizer_dir=tokenizer_dir)


def write_dataset(out_dir: str, layout: Layout, config: Any, lengths: list[int], *, split: str = "train",
                  ranks: int = 1, seed: int = 0, tokenizer_dir: str | None = None) -> dict[str, Any]:
    """A finished dataset of random samples (lengths round-robin over ranks); returns the manifest."""
    from tapdraft.shards.finalize import finalize_dataset
    from tapdraft.shards.writer import DatasetWriter

    import tempfile

    import fsspec

    fs, root = fsspec.core.url_to_fs(str(out_dir))
    with tempfile.TemporaryDirectory() as tmp:  # write_bundle writes locally; upload for other filesystems
        fp = tiny_bundle(tmp + "/target", layout, tokenizer_dir=tokenizer_dir)
        fs.put(tmp + "/target", root.rstrip("/") + "/target", recursive=True)
    for r in range(ranks):
        w = DatasetWriter(out_dir, config, layout, split=split, rank=r, lineage=f"synthetic seed {seed}")
        for i, T in enumerate(lengths[r::ranks]):
            w.write(random_sample(layout, T, seed * 100003 + i * ranks + r, audio_frames=T // 4), i)
        w.close()
    return finalize_dataset(out_dir, layout=layout, fingerprint=fp, capture_config={"synthetic": True})
