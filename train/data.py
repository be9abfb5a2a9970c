"""The training data path: sample stream -> epochs -> truncate -> filter -> token-budget batches -> collate.

Each stage is a small function over a plain iterable, so it can be tested on a Python list; they
are composed in one place, :class:`BatchStream`. Sample ORDER and its resume state belong to the
reader (``shards.reader`` ``ds.stream(...)``: a pure function of seed, epoch, world size and
workers, with a few-scalar ``state_dict()``); this module only remembers which epoch it is in and
the reader state at the first sample not yet handed out. Exact resume needs no buffer contents:
the batcher looks one sample ahead to decide where a batch ends, and the state it reports is the
reader state from BEFORE that lookahead sample was read, so a restored stream re-reads it.

:class:`WorkerBatchStream` runs the same pipeline in DataLoader worker processes (worker w reads
partition w of the reader), keeping exact resume by recording every worker's state and which
worker is next in the loader's round robin.

Every rank sees the same number of batches per step because the stream is endless (epochs loop)
and the loop runs a fixed number of steps; filters never make ranks disagree on step counts.

Collated batch (Bs sequences padded to T = longest in the batch):
    input_ids long [Bs, T] (pad 0), loss_mask bool [Bs, T] (False on pad), is_audio bool [Bs, T],
    lengths long [Bs], taps bf16 [Bs, T, n_taps, H], final_hidden bf16 [Bs, T, H] (if stored),
    topk_ids long [Bs, T, k], topk_logprobs float32 [Bs, T, k], topk_valid bool [Bs, T] (if stored;
    row t of sequence b holds the teacher's top-k for the token at t + 1),
    audio_embeds bf16 [Bs, T, H] (if stored; zeros at text rows), sample_id list[str].
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Iterator

import torch

STATE_VERSION = 1

OpenStream = Callable[[int, Any], Iterator[dict[str, Any]]]
"""(epoch, reader_state or None) -> iterator of sample dicts with a ``state_dict()`` method."""

OpenWorkerStream = Callable[[int, int, int, Any], Iterator[dict[str, Any]]]
"""(worker_id, num_workers, epoch, reader_state or None) -> the same, for one loader worker's partition."""


def derive_seed(*parts: Any) -> int:
    """The one seed-derivation rule: a 63-bit int from (base seed, purpose, step, rank, ...)."""
    h = hashlib.sha256(repr(tuple(parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def first_samples(open_stream: OpenStream, n: int) -> OpenStream:
    """``open_stream`` cut to each epoch's first ``n`` samples (evaluation's ``max_samples``)."""

    class _First:
        def __init__(self, it: Iterator[dict[str, Any]]) -> None:
            self.it, self.left = it, n

        def __iter__(self) -> "_First":
            return self

        def __next__(self) -> dict[str, Any]:
            if self.left <= 0:
                raise StopIteration
            self.left -= 1
            return next(self.it)

        def state_dict(self) -> Any:
            return self.it.state_dict()

    return lambda epoch, state: _First(open_stream(epoch, state))


def epochs(open_stream: OpenStream, state: dict[str, Any] | None = None, max_epochs: int | None = None):
    """Loop epochs; yield (sample, resume_state) where resume_state resumes AT that sample."""
    epoch = 0 if state is None else int(state["epoch"])
    reader_state = None if state is None else state["reader"]
    while max_epochs is None or epoch < max_epochs:
        it = open_stream(epoch, reader_state)
        reader_state = None
        yielded = False
        while True:
            pre = {"epoch": epoch, "reader": it.state_dict()}
            try:
                s = next(it)
            except StopIteration:
                break
            yielded = True
            yield s, pre
        if not yielded and (state is None or epoch > int(state["epoch"])):
            raise ValueError(
                f"epoch {epoch} gave this rank no samples: the split has fewer samples than ranks x workers"
            )
        epoch += 1


def truncate(sample: dict[str, Any], max_len: int) -> dict[str, Any]:
    """Cut a sample to its first ``max_len`` positions (teacher rows kept only if t + 1 < max_len)."""
    T = int(sample["input_ids"].shape[0])
    if T <= max_len:
        return sample
    out = dict(sample)
    for name in ("input_ids", "is_audio", "loss_mask", "taps", "final_hidden"):
        if name in out:
            out[name] = out[name][:max_len]
    if "audio_embeds" in out:
        out["audio_embeds"] = out["audio_embeds"][: int(sample["is_audio"][:max_len].sum())]
    if "topk_rows" in out:
        keep = out["topk_rows"] + 1 < max_len
        for name in ("topk_rows", "topk_ids", "topk_logprobs"):
            out[name] = out[name][keep]
    return out


def has_targets(sample: dict[str, Any]) -> bool:
    """True when some position t >= 1 is supervised (there is a next token to predict)."""
    return bool(sample["loss_mask"][1:].any())


def batch_by_tokens(items: Iterable[tuple[dict[str, Any], Any]], max_tokens: int, max_batch_size: int):
    """Group (sample, resume_state) items into lists whose PADDED size Bs * T_max <= max_tokens.

    Yields (samples, state) where ``state`` resumes at the first sample of the next batch (None at
    the end of a finite input). A sample longer than ``max_tokens`` forms a batch of its own. Order
    is preserved, so batching is a pure function of the input order.
    """
    if max_tokens < 1 or max_batch_size < 1:
        raise ValueError(f"max_tokens and max_batch_size must be >= 1, got {max_tokens}, {max_batch_size}")
    cur: list[dict[str, Any]] = []
    longest = 0
    for sample, state in items:
        T = int(sample["input_ids"].shape[0])
        if cur and (len(cur) >= max_batch_size or (len(cur) + 1) * max(longest, T) > max_tokens):
            yield cur, state
            cur, longest = [], 0
        cur.append(sample)
        longest = max(longest, T)
    if cur:
        yield cur, None


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad a list of schema samples into one batch dict (see the module docstring)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    Bs = len(samples)
    lengths = torch.tensor([int(s["input_ids"].shape[0]) for s in samples], dtype=torch.long)
    T = int(lengths.max())
    first = samples[0]
    out: dict[str, Any] = {
        "input_ids": torch.zeros(Bs, T, dtype=torch.long),
        "loss_mask": torch.zeros(Bs, T, dtype=torch.bool),
        "is_audio": torch.zeros(Bs, T, dtype=torch.bool),
        "lengths": lengths,
        "sample_id": [s.get("sample_id", "") for s in samples],
    }
    n, H = first["taps"].shape[1:]
    out["taps"] = torch.zeros(Bs, T, n, H, dtype=first["taps"].dtype)
    if "final_hidden" in first:
        out["final_hidden"] = torch.zeros(Bs, T, H, dtype=first["final_hidden"].dtype)
    if "topk_ids" in first:
        k = first["topk_ids"].shape[1]
        out["topk_ids"] = torch.zeros(Bs, T, k, dtype=torch.long)
        out["topk_logprobs"] = torch.full((Bs, T, k), float("-inf"), dtype=torch.float32)
        out["topk_valid"] = torch.zeros(Bs, T, dtype=torch.bool)
    if "audio_embeds" in first:
        out["audio_embeds"] = torch.zeros(Bs, T, H, dtype=first["audio_embeds"].dtype)
    for b, s in enumerate(samples):
        L = int(lengths[b])
        out["input_ids"][b, :L] = s["input_ids"].long()
        out["loss_mask"][b, :L] = s["loss_mask"]
        out["is_audio"][b, :L] = s["is_audio"]
        out["taps"][b, :L] = s["taps"]
        if "final_hidden" in out:
            out["final_hidden"][b, :L] = s["final_hidden"]
        if "topk_ids" in out:
            rows = s["topk_rows"].long()
            out["topk_ids"][b, rows] = s["topk_ids"].long()
            out["topk_logprobs"][b, rows] = s["topk_logprobs"].float()
            out["topk_valid"][b, rows] = True
        if "audio_embeds" in out:
            out["audio_embeds"][b, :L][s["is_audio"]] = s["audio_embeds"]
    return out


def to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class BatchStream:
    """The composed pipeline: endless, seeded, exactly resumable collated micro-batches.

    ``state_dict()`` after a batch resumes at the next batch: {"version", "epoch", "reader"}.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        *,
        max_tokens: int,
        max_batch_size: int,
        max_seq_len: int | None = None,
        state: dict[str, Any] | None = None,
        max_epochs: int | None = None,
    ) -> None:
        if state is not None and state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')} is not {STATE_VERSION}; cannot resume from it")
        self._state = state
        start = None if state is None else {"epoch": state["epoch"], "reader": state["reader"]}
        items: Iterable = epochs(open_stream, start, max_epochs)
        if max_seq_len is not None:
            items = ((truncate(s, max_seq_len), st) for s, st in items)
        items = ((s, st) for s, st in items if has_targets(s))
        self._batches = batch_by_tokens(items, max_tokens, max_batch_size)

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> dict[str, Any]:
        samples, state = next(self._batches)
        self._state = None if state is None else {"version": STATE_VERSION, **state}
        return collate(samples)

    def state_dict(self) -> dict[str, Any] | None:
        return self._state


class _WorkerIterable(torch.utils.data.IterableDataset):
    """One DataLoader worker's endless batch stream; yields (role, batch, state after the batch)."""

    def __init__(self, open_worker_stream: OpenWorkerStream, kwargs: dict[str, Any], states: list[Any],
                 rotation: int) -> None:
        self.open_worker_stream, self.kwargs, self.states, self.rotation = open_worker_stream, kwargs, states, rotation

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, W = (info.id, info.num_workers) if info is not None else (0, 1)
        role = (wid + self.rotation) % W
        fn = self.open_worker_stream
        stream = BatchStream(lambda epoch, st: fn(role, W, epoch, st), state=self.states[role], **self.kwargs)
        for batch in stream:
            yield role, batch, stream.state_dict()


class WorkerBatchStream:
    """:class:`BatchStream` spread over ``num_workers`` DataLoader processes, still exactly resumable.

    Worker *role* r reads partition r of ``num_workers`` (the reader's ``worker_id``). The
    DataLoader takes batches from its workers strictly round robin (the streams are endless), so the
    global batch order is roles ``rotation, rotation + 1, ...``; the state is every role's stream
    state plus the next role, and a resume starts the round robin there by rotating which role each
    new worker plays. ``state_dict()``: {"version", "num_workers", "states", "next_role"}.
    """

    def __init__(self, open_worker_stream: OpenWorkerStream, *, num_workers: int, max_tokens: int,
                 max_batch_size: int, max_seq_len: int | None = None, state: dict[str, Any] | None = None,
                 prefetch_factor: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if state is not None:
            if state.get("version") != STATE_VERSION or state.get("num_workers") != num_workers:
                raise ValueError(f"loader state {({k: state.get(k) for k in ('version', 'num_workers')})} does not "
                                 f"match version {STATE_VERSION} with {num_workers} workers; "
                                 "resume with the same settings")
            states, rotation = list(state["states"]), int(state["next_role"])
        else:
            states, rotation = [None] * num_workers, 0
        self._states, self._next = states, rotation
        self.num_workers = num_workers
        kwargs = {"max_tokens": max_tokens, "max_batch_size": max_batch_size, "max_seq_len": max_seq_len}
        ds = _WorkerIterable(open_worker_stream, kwargs, states, rotation)
        self._it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                                    prefetch_factor=prefetch_factor))

    def __iter__(self) -> "WorkerBatchStream":
        return self

    def __next__(self) -> dict[str, Any]:
        role, batch, state = next(self._it)
        assert role == self._next, (role, self._next)
        self._states[role] = state
        self._next = (role + 1) % self.num_workers
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "num_workers": self.num_workers, "states": list(self._states),
                "next_role": self._next}
