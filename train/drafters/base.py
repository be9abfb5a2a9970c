"""The drafter protocol the loop, eval and export use, the family lookup, the frozen target pieces, and the
ONE loss rule.

A drafter family (one per ``FAMILIES`` entry) is a folder
``train/drafters/<family>/`` whose model module defines ``CONFIG`` (a frozen dataclass, validated in
``__post_init__``) and ``DRAFTER`` (a :class:`Drafter` subclass, which also owns the family's export layouts). The
registry (``FAMILIES``, in ``train/drafters/__init__.py``, re-exported here) maps a family name to that module path;
nothing is imported until a family is asked for (no import-time registration side effects). A new family is one
folder, one line in ``FAMILIES`` and one recipe.

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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import head_spec, teacher_logits
from tapdraft.shards.schema import Layout
from tapdraft.shards.target_config import check_fields
from tapdraft.train.drafters import FAMILIES
from tapdraft.train.drafters.common import export_files



@dataclass
class LossOutput:
    """What a drafter's forward returns.

    terms: name -> (local sum [scalar tensor, differentiable], local count [scalar tensor], weight).
    metrics: name -> (local sum, local count), detached; reported as global sum / global count.
    """

    terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class FrozenHead(nn.Module):
    """The frozen target pieces a drafter reads, with one owner and one spelling in every family: the input embedding
    ``embed_tokens`` [V, H], the final norm ``norm_weight`` / ``norm_bias`` [H] and ``lm_head`` / ``lm_head_bias``
    ([V, H] / [V]; the embedding itself when tied), the bundle's names. Non-persistent buffers (absent biases are None
    buffers): never trained, checkpointed or exported. A drafter holds one as ``self.target``.

    ``dtype``: the buffers' dtype (None keeps the bundle's); ``to_dtype`` changes it later (the loop's head_dtype).
    """

    NAMES = ("embed_tokens", "norm_weight", "norm_bias", "lm_head", "lm_head_bias")

    def __init__(self, bundle: TargetBundle, dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__()
        self.spec = head_spec(bundle)

        def own(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(dtype or t.dtype).clone()

        self.register_buffer("embed_tokens", own(bundle.embed_tokens), persistent=False)
        self.register_buffer("norm_weight", own(bundle.norm_weight), persistent=False)
        self.register_buffer("norm_bias", own(bundle.norm_bias), persistent=False)
        self.register_buffer("lm_head", self.embed_tokens if self.spec.tied else own(bundle.lm_head), persistent=False)
        self.register_buffer("lm_head_bias", own(bundle.lm_head_bias), persistent=False)

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Store the tensors in ``dtype`` (bf16 on GPU halves their memory)."""
        for name in self.NAMES:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(dtype))

    def logits(self, hidden_RH: torch.Tensor) -> torch.Tensor:
        """The teacher: the target's logits [R, V] of pre-norm last-layer rows (``shards.head.teacher_logits``)."""
        return teacher_logits(hidden_RH, self.norm_weight, self.lm_head, self.spec, norm_bias_H=self.norm_bias,
                              lm_head_bias_V=self.lm_head_bias)


class DrafterConfig(Protocol):
    """What every family's ``CONFIG`` (a frozen dataclass) has: the draft layer's shape (None: the target's), the
    draft vocabulary (None: the target's), the loss's chunk of rows and the initialisation's scale."""

    @property
    def num_heads(self) -> int | None: ...
    @property
    def num_kv_heads(self) -> int | None: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def intermediate_size(self) -> int | None: ...
    @property
    def draft_vocab(self) -> int | None: ...
    @property
    def chunk_rows(self) -> int: ...
    @property
    def init_std(self) -> float: ...


class Drafter(nn.Module):
    """Base class of every drafter family.

    Subclasses implement:
      ``__init__(config, bundle, layout)``: build modules; the frozen bundle tensors (embedding, final
          norm, lm_head) are ``self.target``, a :class:`FrozenHead`, so they are never trained,
          checkpointed or exported.
      ``forward(batch, generator=None) -> LossOutput``: the training loss on one collated batch
          (see ``train.data.collate``); ``generator`` drives any sampling (anchors) so runs are
          reproducible and resumable.
      ``acceptance(batch, generator=None) -> AcceptanceCounts``: teacher-forced acceptance (eval).
      ``propose(ids, taps, temperature=0.0, generator=None, drafts=None) -> (tokens [K], q [K, V] or None)``:
          live drafts for speculative decoding (``speculate`` calls only this), computed through the same
          methods training and eval use, on a batch of one sequence (:func:`one_sequence_batch`); K is
          :meth:`draft_count` of ``drafts``.
      ``trained_drafts``: the drafts a round it was trained for (an engine's ``num_speculative_tokens``).
      ``export_config() -> dict``: the config serving engines read (``train.export`` writes it beside the
          draft-only weights; checkpoints keep it so export needs no dataset).
    and may override ``check_dataset`` to refuse a mismatched dataset before any step.
    """

    family: ClassVar[str] = ""
    fewer_drafts: ClassVar[bool] = False
    """Whether ``propose(drafts=N)`` can draft fewer than it was trained for, as an engine serving the export at
    ``num_speculative_tokens=N`` drafts them (a chain stops early; a DFlash block is N + 1 slots)."""
    target: FrozenHead
    """The frozen target pieces (every family sets it in ``__init__``)."""
    default_layout: ClassVar[str | None] = None
    """What an export without ``--layout`` is called in the summary (None: the family's native layout)."""
    serving_dir: ClassVar[Path | None] = None
    """The folder of the self-contained modeling files an export ships when its config names them in ``auto_map``."""

    def __init__(self, config: DrafterConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def build(cls, config: DrafterConfig, bundle: TargetBundle, layout: Layout) -> "Drafter":
        cls.check_dataset(config, bundle, layout)
        return cls(config, bundle, layout)

    @classmethod
    def check_dataset(cls, config: DrafterConfig, bundle: TargetBundle, layout: Layout) -> None:
        """Raise ValueError when the dataset cannot train this drafter (default: accept)."""

    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        raise NotImplementedError

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None):
        """Teacher-forced acceptance on one batch: a ``train.acceptance.AcceptanceCounts``."""
        raise NotImplementedError

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative-SAMPLING acceptance by draft position: (sum over rows of sum_v min(p_v, q_v), rows), [K] each.

        p is the target's exact row (its last hidden state through the head) at ``temperature``, q the
        distribution the drafter's ``propose`` samples from at that temperature, every draft position
        teacher-forced on the dataset's tokens (an estimate of live sampled decoding; greedy is ``acceptance``).
        """
        raise NotImplementedError(f"drafter family {self.family!r} has no sampled acceptance")

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Live drafts after a verified prefix.

        ``ids_T``: ids of positions 0..P (position P holds the last emitted token, which the target has
        not run yet); ``taps_PnH``: the target's taps of positions 0..P-1 in the dataset's tap order;
        ``extras``: the prefix's other dataset fields the live target gives (:data:`LIVE_FIELDS`);
        ``drafts``: how many (:meth:`draft_count`).
        Returns K drafted tokens (CPU) and, when sampling (temperature > 0), their distributions [K, V].
        """
        raise NotImplementedError(f"drafter family {self.family!r} has no live proposals")

    @property
    def trained_drafts(self) -> int:
        """The drafts a round this drafter was trained for: its export's ``num_speculative_tokens``."""
        raise NotImplementedError(f"drafter family {self.family!r} states no number of drafts")

    def draft_count(self, drafts: int | None) -> int:
        """K for ``propose``: the trained number (``drafts`` None), else ``drafts`` (:meth:`check_drafts`)."""
        return self.check_drafts(drafts, self.trained_drafts)

    @classmethod
    def check_drafts(cls, drafts: int | None, trained: int) -> int:
        """``drafts`` a round (None: ``trained``) for a draft trained for ``trained``: fewer needs a family that can
        draft fewer (:attr:`fewer_drafts`), and never more or none. Needs no weights, so a benchmark asks before it
        serves anything."""
        if drafts is None or drafts == trained:
            return trained
        if not cls.fewer_drafts:
            raise ValueError(f"a {cls.family} draft drafts the {trained} a round it was trained for, not {drafts}: "
                             f"leave the number of drafts out")
        if not 1 <= drafts <= trained:
            raise ValueError(f"drafts must be 1..{trained} (the {trained} a round this draft was trained for), got "
                             f"{drafts}")
        return drafts

    def export_config(self) -> dict[str, Any]:
        """The serving config (architecture fields, tap ids in both numberings, ...); saved in checkpoints."""
        raise NotImplementedError

    @classmethod
    def export_layout(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], layout: str | None, *,
                      verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights, ``export_config``) -> the same draft in ``layout`` (None: the native layout, as trained)."""
        if layout is None:
            return weights, config
        raise ValueError(f"a {cls.family!r} draft has one export layout: drop --layout")

    @classmethod
    def head_rows(cls, weights: dict[str, torch.Tensor], config: dict[str, Any],
                  lm_head: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Frozen target tensors an export must carry itself (``weights``, ``config``: the native trained weights and
        ``export_config``; ``lm_head``: the target's [V, H] lm_head, loaded only when called). None by default: engines use the target's own."""
        return {}

    @classmethod
    def write_export(cls, out_dir: str | os.PathLike, weights: dict[str, torch.Tensor], config: dict[str, Any],
                     meta: dict[str, Any]) -> Path:
        """Write an export (weights and config in one of this family's layouts) to ``out_dir``."""
        return export_files.write_export(out_dir, weights, config, meta, serving_dir=cls.serving_dir)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers only (the frozen bundle tensors are not persistent)."""
        return self.state_dict()


LIVE_FIELDS = ("final_hidden", "is_audio", "audio_embeds")
"""Per-position dataset fields a live decoder can give a proposal besides the taps, each for a prefix of the
positions, in the collated layout: ``final_hidden`` [P, H] (the last layer's pre-norm output), ``is_audio`` [n]
and ``audio_embeds`` [n, H] (the merged input embedding at audio rows, zeros elsewhere)."""


def one_sequence_batch(ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, dtype: torch.dtype, device: torch.device,
                       extras: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """One sequence in the collated layout; taps and ``extras`` (:data:`LIVE_FIELDS`) are padded to the ids' length
    with zeros / False (positions past the prefix are never read)."""
    T = ids_T.shape[0]

    def padded(x: torch.Tensor, fill_dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(T, *x.shape[1:], dtype=fill_dtype, device=device)
        out[: x.shape[0]] = x[:T].to(device=device, dtype=fill_dtype)
        return out[None]

    batch = {
        "input_ids": ids_T[None].to(device),
        "taps": padded(taps_PnH, dtype),
        "loss_mask": torch.ones(1, T, dtype=torch.bool, device=device),
        "is_audio": torch.zeros(1, T, dtype=torch.bool, device=device),
        "lengths": torch.tensor([T], device=device),
    }
    for name, x in (extras or {}).items():
        if name not in LIVE_FIELDS:
            raise ValueError(f"unknown live field {name!r}; known: {list(LIVE_FIELDS)}")
        batch[name] = padded(x, torch.bool if name == "is_audio" else dtype)
    return batch


def pick_tokens(logits_KV: torch.Tensor, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy (temperature 0: argmax, no distribution) or sampled tokens with their distributions q."""
    if temperature == 0:
        return logits_KV.argmax(-1), None
    q = torch.softmax(logits_KV.float() / temperature, -1)
    return torch.multinomial(q, 1, generator=generator).squeeze(-1), q


def layer_shape(bundle: TargetBundle, config: DrafterConfig) -> tuple[int, int, int, int, int]:
    """(hidden, heads, kv heads, head dim, intermediate) of a draft layer: the config's ``num_heads``,
    ``num_kv_heads``, ``head_dim`` and ``intermediate_size`` where set, else the target's (from the bundle); checked
    against the target config schema (``shards.target_config``: positive sizes, kv heads dividing heads, heads
    dividing the hidden size when head_dim is derived from it) before any layer is built."""
    tc = bundle.config
    H = tc["hidden_size"]
    heads = config.num_heads or tc.get("num_attention_heads")
    if heads is None:
        raise ValueError("the target bundle records no num_attention_heads: set drafter.num_heads")
    kv = config.num_kv_heads or tc.get("num_key_value_heads") or heads
    head_dim = config.head_dim or tc.get("head_dim")
    inter = config.intermediate_size or tc.get("intermediate_size")
    check_fields({"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                  "intermediate_size": inter}, "the draft layer's shape (the drafter config over the target bundle)",
                 "set drafter.num_heads, num_kv_heads, head_dim or intermediate_size, or use a bundle that "
                 "`tapdraft verify` passes")
    return H, heads, kv, head_dim or H // heads, inter or 4 * H


def get_family(name: str) -> tuple[type[DrafterConfig], type[Drafter]]:
    """Family name -> (ConfigClass, DrafterClass); ValueError lists the known names."""
    if name not in FAMILIES:
        raise ValueError(f"unknown drafter family {name!r}; known: {sorted(FAMILIES)}")
    try:
        mod = importlib.import_module(FAMILIES[name])
    except ModuleNotFoundError as e:
        raise ValueError(f"drafter family {name!r} is registered but its module {FAMILIES[name]} is missing: {e}")
    check_config_class(name, mod.CONFIG)
    return mod.CONFIG, mod.DRAFTER


CONFIG_MEMBERS = tuple(n for n, v in vars(DrafterConfig).items() if isinstance(v, property))


def check_config_class(family: str, config: type) -> None:
    """Refuse a family whose CONFIG is not a dataclass with every :class:`DrafterConfig` member as a field."""
    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    missing = [n for n in CONFIG_MEMBERS if n not in fields]
    if missing:
        raise ValueError(f"drafter family {family!r}: its CONFIG {config.__name__} lacks the fields "
                         f"{', '.join(missing)} every family's config has (train.drafters.base.DrafterConfig)")


def _world(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum over the DP group (identity when not distributed). Returns a new tensor."""
    t = t.detach().clone()
    if _world(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def combine_terms(
    terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    *,
    group: dist.ProcessGroup | None = None,
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
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]], *, group: dist.ProcessGroup | None = None
) -> dict[str, tuple[float, float]]:
    """All-reduce metric (sum, count) pairs in one collective -> {name: (global sum, global count)}."""
    if not metrics:
        return {}
    names = list(metrics)
    flat = torch.stack(
        [torch.stack([metrics[n][0].detach().float().reshape(()), metrics[n][1].detach().float().reshape(())])
         for n in names]
    )
    flat = all_reduce_sum(flat, group)
    return {n: (float(flat[i, 0]), float(flat[i, 1])) for i, n in enumerate(names)}
