"""The peer baseline: one uncompressed ``torch.save`` dict per conversation (benchmarks only).

What widely used pipelines write today (Model-Optimizer's hidden-state dump, SpecForge offline,
EAGLE's ge_data): ``{input_ids, loss_mask, hidden_states [T, H], aux_hidden_states [T, n*H]}``
in bf16, no compression, no manifest; read back with ``torch.load(weights_only=True)`` per item
in a DataLoader. Never used by the product.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


TEACHER_FIELDS = ("topk_rows", "topk_ids", "topk_logprobs")


def to_peer_dict(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same content, peer-style: the last tap is the final hidden state, the others are aux; teacher
    rows (when present) as stored."""
    T = sample["input_ids"].shape[0]
    taps = sample["taps"]
    d = {
        "input_ids": sample["input_ids"].to(torch.long),
        "loss_mask": sample["loss_mask"].to(torch.long),
        "hidden_states": taps[:, -1].clone(),
        "aux_hidden_states": taps[:, :-1].reshape(T, -1).clone(),
    }
    for k in TEACHER_FIELDS:  # teacher rows, when the content has them, saved as they are
        if k in sample:
            d[k] = sample[k].clone()
    return d


def write_pt_dataset(out_dir: str | os.PathLike, samples: list[dict[str, Any]]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, s in enumerate(samples):
        p = out / f"data_{i:06d}.ckpt"
        torch.save(to_peer_dict(s), p)
        paths.append(p)
    return paths


class PtDataset(Dataset):
    """Map-style dataset over the per-sample files, as the peers read them."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return torch.load(self.paths[i], weights_only=True)
