"""The drafter protocol the loop, eval and export use, the family registry, and the ONE loss rule.

A drafter family (``dflash``, ``dflash2``, ``mtp``) is a module that defines ``CONFIG`` (a frozen
dataclass, validated in ``__post_init__``) and ``DRAFTER`` (a :class:`Drafter` subclass). The
registry maps a family name to that module path; nothing is imported until a family is asked for
(no import-time registration side effects). A new family adds one line to ``FAMILIES``.

Loss normalisation (the one home of the rule): a drafter's ``forward(batch)`` returns
:class:`LossOutput` whose ``terms`` are ``{name: (sum, count, weight)}`` of LOCAL, unnormalised
sums. :func:`combine_terms` all-reduces every count over the data-parallel group (one collective
for all terms) and returns ``sum_t weight_t * sum_t / max(global count_t, eps)``. Each rank's
gradient is then the gradient of its share of the GLOBAL mean, so DDP's gradient averaging is
undone by multiplying by world size (done here, so callers never think about it). With gradient
accumulation the loop divides by the number of micro-batches: each micro-batch's terms are
normalised by that micro-batch's global count.

Metrics follow the same shape: ``{name: (sum, count)}``, reduced by summing both over micro-batches
and ranks, reported as sum / count.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

FAMILIES: dict[str, str] = {
    "dflash": "train.dflash",
    "dflash2": "train.dflash2",
    "mtp": "train.mtp",
}
"""Family name -> module defining ``CONFIG`` and ``DRAFTER``."""


@dataclass
class LossOutput:
    """What a drafter's forward returns.

    terms: name -> (local sum [scalar tensor, differentiable], local count [scalar tensor], weight).
    metrics: name -> (local sum, local count), detached; reported as global sum / global count.
    """

    terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class AcceptanceCounts:
    """Teacher-forced acceptance counts by block position k = 1..K (eval hook output).

    ``accepted[k-1]``: blocks whose slots 1..k were all predicted correctly (valid at every slot).
    ``reached[k-1]``: blocks whose slots 1..k-1 were all correct and slot k is valid (a target
    exists and is supervised). The conditional acceptance alpha_k = accepted / reached, and
    tau = 1 + sum_k prod_{j<=k} alpha_j.
    ``correct[k-1]`` / ``valid[k-1]``: unconditional per-position accuracy.
    ``round_tokens`` / ``rounds``: greedy decoding replayed on the dataset (optional, 0 when a family
    does not replay): each reply decoded round by round from its first token, every round anchored
    where the previous one stopped, as a live decoder would; tokens emitted per round is then
    comparable with live decoding (uniform anchors overweight the easy positions inside a reply).
    """

    accepted: torch.Tensor
    reached: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    blocks: int = 0
    round_tokens: int = 0
    rounds: int = 0

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return AcceptanceCounts(
            self.accepted + other.accepted,
            self.reached + other.reached,
            self.correct + other.correct,
            self.valid + other.valid,
            self.blocks + other.blocks,
            self.round_tokens + other.round_tokens,
            self.rounds + other.rounds,
        )


class Drafter(nn.Module):
    """Base class of every drafter family.

    Subclasses implement:
      ``__init__(config, bundle, layout)``: build modules; frozen bundle tensors (embedding, final
          norm, lm_head) are registered as non-persistent buffers, so they are never trained,
          checkpointed or exported.
      ``forward(batch, generator=None) -> LossOutput``: the training loss on one collated batch
          (see ``train.data.collate``); ``generator`` drives any sampling (anchors) so runs are
          reproducible and resumable.
      ``acceptance(batch, generator=None) -> AcceptanceCounts``: teacher-forced acceptance (eval).
      ``export_config() -> dict``: the config serving engines read (``export`` writes it beside the
          draft-only weights; checkpoints keep it so export needs no dataset).
    and may override ``check_dataset`` to refuse a mismatched dataset before any step.
    """

    family: ClassVar[str] = ""

    def __init__(self, config: Any, bundle: Any, layout: Any) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def build(cls, config: Any, bundle: Any, layout: Any) -> "Drafter":
        cls.check_dataset(config, bundle, layout)
        return cls(config, bundle, layout)

    @classmethod
    def check_dataset(cls, config: Any, bundle: Any, layout: Any) -> None:
        """Raise ValueError when the dataset cannot train this drafter (default: accept)."""

    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        raise NotImplementedError

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> AcceptanceCounts:
        raise NotImplementedError

    def export_config(self) -> dict[str, Any]:
        """The serving config (architecture fields, tap ids in both numberings, ...); saved in checkpoints."""
        raise NotImplementedError

    def export(self, out_dir: str | Path, meta: dict[str, Any]) -> None:
        """Draft-only ``model.safetensors`` (float32) + ``config.json`` (``export_config`` + ``meta``)."""
        from train.export import write_export

        write_export(out_dir, self.trainable_state_dict(), self.export_config(), meta)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers only (the frozen bundle tensors are not persistent)."""
        return self.state_dict()


def get_family(name: str) -> tuple[type, type[Drafter]]:
    """Family name -> (ConfigClass, DrafterClass); ValueError lists the known names."""
    if name not in FAMILIES:
        raise ValueError(f"unknown drafter family {name!r}; known: {sorted(FAMILIES)}")
    try:
        mod = importlib.import_module(FAMILIES[name])
    except ModuleNotFoundError as e:
        raise ValueError(f"drafter family {name!r} is registered but its module {FAMILIES[name]} is missing: {e}")
    return mod.CONFIG, mod.DRAFTER


def config_from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Build a frozen config dataclass from a dict, refusing unknown keys (tuples from lists)."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(names)}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**kw)


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the DP group (identity when not distributed). Returns a new tensor."""
    t = t.detach().clone()
    if _world(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def combine_terms(
    terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    *,
    group: Any = None,
    ddp_averages: bool = True,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss normalisation rule: sum_t w_t * sum_t / global_count_t.

    Returns (loss to backpropagate on this rank, {name: globally normalised value of the term}).
    When ``ddp_averages`` (DDP averages gradients over ranks), the returned loss is multiplied by the
    world size so the averaged gradient is the gradient of the global normalised loss.
    A term whose global count is zero (its sum is then 0) is divided by 1 and stays in the graph, so every
    parameter receives a gradient and DDP never waits on an unused one).
    """
    if not terms:
        raise ValueError("a drafter returned no loss terms")
    names = list(terms)
    counts = torch.stack([terms[n][1].detach().float().reshape(()) for n in names])
    sums = torch.stack([terms[n][0].detach().float().reshape(()) for n in names])
    g_counts, g_sums = all_reduce_sum(torch.stack([counts, sums]), group).unbind(0)
    world = _world(group) if ddp_averages else 1
    loss = None
    values = {}
    for i, n in enumerate(names):
        s, _, w = terms[n]
        empty = bool(g_counts[i] <= eps)
        denom = torch.ones_like(g_counts[i]) if empty else g_counts[i]
        part = s * (float(w) * world) / denom
        loss = part if loss is None else loss + part
        values[n] = 0.0 if empty else float(g_sums[i] / denom)
    return loss, values


def reduce_metrics(
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]], *, group: Any = None
) -> dict[str, tuple[float, float]]:
    """All-reduce metric (sum, count) pairs in one collective -> {name: (global sum, global count)}."""
    if not metrics:
        return {}
    names = list(metrics)
    flat = torch.stack(
        [torch.stack([metrics[n][0].detach().float().reshape(()), metrics[n][1].detach().float().reshape(())]) for n in names]
    )
    flat = all_reduce_sum(flat, group)
    return {n: (float(flat[i, 0]), float(flat[i, 1])) for i, n in enumerate(names)}


def replay_rounds(
    loss_mask_BT: torch.Tensor, anchors_BN: torch.Tensor, correct_BNK: torch.Tensor, valid_BNK: torch.Tensor,
) -> tuple[int, int]:
    """Greedy speculative decoding replayed on teacher-forced block outcomes -> (tokens, rounds).

    Every supervised run (a reply) is decoded from its first token: a round at anchor p accepts
    the leading correct slots a of its valid ones; with a < valid it emits a + 1 tokens (the
    target's correction) and the next round is anchored at p + a + 1; when every valid slot is
    right it emits them, plus the target's next token when the reply goes on past the block (then
    the next round is anchored there), else the reply has ended.
    A round needs its anchor among ``anchors`` with a valid slot; otherwise the reply has ended.
    """
    K = correct_BNK.shape[-1]
    ok = (correct_BNK.bool() & valid_BNK).cpu()
    nvalid = valid_BNK.long().cumprod(-1).sum(-1).cpu()  # leading valid slots
    lead = ok.long().cumprod(-1).sum(-1)  # leading correct slots
    lm = loss_mask_BT.bool().cpu()
    tokens = rounds = 0
    for b in range(anchors_BN.shape[0]):
        row = {int(p): n for n, p in enumerate(anchors_BN[b].tolist()) if int(nvalid[b, n]) > 0}
        starts = [t for t in range(lm.shape[1]) if lm[b, t] and (t == 0 or not lm[b, t - 1])]
        for p in starts:
            while p in row:
                n = row[p]
                a, v = int(lead[b, n]), int(nvalid[b, n])
                rounds += 1
                if a < v:
                    tokens += a + 1
                    p += a + 1
                elif v == K and p + K + 1 < lm.shape[1] and lm[b, p + K + 1]:
                    tokens += K + 1  # a full block and the reply goes on: the target adds its token
                    p += K + 1
                else:
                    tokens += v  # the last draft was the reply's last token (eos): nothing follows
                    break
    return tokens, rounds


def tau_from_alpha(alpha: list[float]) -> float:
    """Acceptance length tau = 1 + sum_k prod_{j<=k} alpha_j (alpha_k conditional per position)."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return tau
