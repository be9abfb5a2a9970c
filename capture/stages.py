"""Generic stages shared by capture and regenerate: numbering, rank slices, windows, length buckets,
the torchrun environment and the device/dtype a run resolves to.

Each is a pure function of its inputs (testable on plain lists), so a run's batches never depend on
where it started or on what else runs: capture and regenerate resume by recomputing whole windows.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Iterator

import torch



@dataclass
class Skip:
    """An input the writer records as skipped, with why: a bad input, one too long, or (fused capture) a dropped
    reply, whose drop reason is its kind."""

    index: int
    sample_id: str
    reason: str
    kind: str  # "error" | "too_long" | a reply drop reason
    line: int | None = None
    source: str = ""

def numbered(items: Iterable[Any], max_samples: int | None) -> Iterator[tuple[int, Any]]:
    """(global index, item) for the first ``max_samples`` items."""
    return enumerate(islice(items, max_samples))


def rank_slice(items: Iterable[tuple[int, Any]], rank: int, world_size: int) -> Iterator[tuple[int, Any]]:
    """This rank's items (global index % world_size == rank), renumbered 0, 1, ... (local index)."""
    local = 0
    for gi, item in items:
        if gi % world_size == rank:
            yield local, item
            local += 1


def windows(items: Iterable[tuple[int, Any]], size: int) -> Iterator[list[tuple[int, Any]]]:
    """Consecutive lists of ``size`` items (window w holds local indices [w*size, (w+1)*size))."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def bucket(lengths: dict[int, int], *, batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group indices into batches of similar length: longest first, B * max_len <= batch_tokens.

    A single sample longer than ``batch_tokens`` still gets its own batch.
    """
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * longest > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return [sorted(b) for b in batches]


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """A config's ``dtype``: 'auto' = bfloat16 on GPU, float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_device(device: str) -> torch.device:
    """A config's ``device``: 'auto' = cuda:LOCAL_RANK when CUDA is there, else cpu."""
    if device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this machine has no CUDA device (or torch {torch.__version__} "
                             "was built without CUDA); use --device cpu or auto")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def dist_env() -> tuple[int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world


def barrier(world: int) -> None:
    if world == 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
