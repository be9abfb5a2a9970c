"""Fused capture (``capture --regenerate``): taps and teacher rows from the generation pass itself.

Generation already runs the target over every prompt position (prefill) and every reply token
(one step each), so the states a dataset stores are there: :func:`capture.replies.generate.generate` with
``tap_ids`` keeps them, and :func:`fused_window` turns each finished conversation into the same
fields :func:`capture.forward.run_batch` writes (one home: ``sample_fields``), without a second
forward. The row is the prompt (template generation prompt included) followed by the reply ids as
generated, end of turn included; the template's text after the end-of-turn token (ChatML's newline)
is never run, so a fused row is that many unsupervised positions shorter than a two-pass row.

What differs from the two-pass path (regenerate, then capture the text): the prompt's states come
from a left-padded prefill and each reply token's from a single-token step against the KV cache,
so they equal a full forward's up to kernel rounding, not bit for bit (measured in docs/LOG.md).
``CaptureConfig.fused=False`` keeps the two-pass path for bit-identical prefill taps.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tapdraft.capture.forward import SampleSpec, sample_fields
from tapdraft.capture.generation import ReplyConfig
from tapdraft.capture.replies.windows import BAD_INPUT_REASONS, RunStats, process_window
from tapdraft.capture.stages import Skip
from tapdraft.capture.targets.base import Expanded, Prepared, Target

def reply_expanded(target: Target, prompt: Expanded, reply_ids: list[int]) -> Expanded:
    """The prompt followed by the generated ids, which are supervised (the template's generation block)."""
    dev = prompt.input_ids.device
    ids = torch.tensor(reply_ids, dtype=torch.long, device=dev)
    n = ids.shape[0]
    return Expanded(
        torch.cat([prompt.input_ids, ids]),
        torch.cat([prompt.is_audio, torch.zeros(n, dtype=torch.bool, device=dev)]),
        torch.cat([prompt.loss_mask.to(dev), torch.ones(n, dtype=torch.bool, device=dev)]),
        torch.cat([prompt.inputs_embeds, target.lm.get_input_embeddings()(ids).to(prompt.inputs_embeds.dtype)]),
    )


def fused_window(
    target: Target, replies: ReplyConfig, chunk: list[tuple[int, Any]], spec: SampleSpec, *, batch_tokens: int,
    max_batch_size: int, max_length: int | None, on_error: str, stats: RunStats | None = None,
    report: Callable[[], None] = lambda: None,
) -> tuple[list[Skip], list[Prepared], list[dict[str, torch.Tensor]]]:
    """Regenerate one capture window ((local index, Conversation | BadInput)) with states kept.

    Returns the skips (bad input, too long, and dropped replies with their reason as the kind), and
    the written conversations as (minimal :class:`Prepared`, stored fields) in index order.
    """
    items = [(li, li, item, "") for li, item in chunk]
    entries = process_window(target, replies, items, batch_tokens=batch_tokens, max_batch_size=max_batch_size,
                             on_error=on_error, stats=stats or RunStats(), tap_ids=list(spec.tap_ids), report=report)
    skips: list[Skip] = []
    batch: list[Prepared] = []
    exps: list[Expanded] = []
    states: list[tuple[torch.Tensor, torch.Tensor]] = []
    for (li, item), e in zip(chunk, entries):
        line, src = getattr(item, "line", None), getattr(item, "source", "")
        if e["status"] != "ok":
            kind = "too_long" if e["status"] == "too_long" else "error" if e["status"] in BAD_INPUT_REASONS \
                else e["status"]
            reason = e["message"] if kind in ("error", "too_long") else f"{e['status']}: {e['message']}"
            skips.append(Skip(li, e["sample_id"], reason, kind, line, src))
            continue
        g = e["generation"]
        full = reply_expanded(target, g.expanded, g.ids)
        T = int(full.input_ids.shape[0])
        if max_length is not None and T > max_length:
            skips.append(Skip(li, item.sample_id, f"too long: {T} positions > max_length {max_length}", "too_long",
                              line, src))
            continue
        empty = torch.empty(0, dtype=torch.long)
        batch.append(Prepared(li, item.sample_id, item.source, empty, empty.bool(), audio_seconds=g.audio_seconds,
                              length=T, line=line))
        exps.append(full)
        states.append((g.taps, g.last))
    results = sample_fields(target, exps, states, spec) if batch else []
    return skips, batch, results
