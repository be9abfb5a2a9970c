"""Training configuration: TrainConfig, the run config (family + drafter config + train config),
recipes (YAML in ``train/recipes/``) and ``key=value`` overrides.

A recipe file:

    base: dflash              # optional: a recipe (or a _shared block in train/recipes/) merged first
    family: dflash            # a name in train.drafters.FAMILIES
    drafter: {block_size: 16, gamma: 7.0, ...}   # fields of the family's config class
    train: {lr: 6.0e-4, max_steps: 2000, ...}    # fields of TrainConfig

A recipe repeats nothing it shares: ``base:`` names the recipe it extends, merged section by
section under it (``dflash_b8`` is ``dflash`` with two drafter fields changed); the two training
budgets live once, in ``_train.yaml`` and ``_demo_train.yaml`` (names starting with ``_`` are
shared blocks, not recipes). ``--config FILE.yaml`` is merged on top (same shape); ``--set
key=value`` overrides one field: ``max_steps=100`` (unique names resolve to their section) or
``drafter.gamma=4``. Values are parsed as YAML and checked against the field's declared type by
``typed_config`` (a few lines over ``typing``; pydantic was weighed and not taken: see
docs/LOG.md); an unknown field or a wrong type is a ValueError naming the field and the allowed
names. The resolved config is saved as JSON in the
run directory and a resume refuses a checkpoint whose config differs (``RESUME_MUTABLE`` fields
excepted).

Names changed once (one name per concept across families; torch's dtype and device names, as capture
spells them): recipes, ``--config`` files, ``--set`` keys, saved run configs and checkpoints written before
go through ONE named migration, :func:`migrate_run_config` (``RENAMED_FIELDS``, ``RENAMED_VALUES``). Migrating
in place (rather than refusing with a conversion command) keeps every existing run directory resumable and
evaluable as it is: the renames are pure spellings, so the migration is total and loses nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tapdraft.common.template import template_kwargs as canonical_template_kwargs
from tapdraft.train.drafters import DEFAULT_FAMILY
from tapdraft.train.drafters.base import DrafterConfig, get_family

RECIPES_DIR = Path(__file__).parent / "recipes"

RENAMED_FIELDS: dict[tuple[str, str], str] = {
    ("drafter", "ce_chunk_size"): "chunk_rows",  # DFlash / DFlash2; EAGLE-3 and MTP always said chunk_rows
}
"""(section, old field name) -> today's name."""
RENAMED_VALUES: dict[tuple[str, str], dict[Any, Any]] = {
    ("train", "precision"): {"bf16": "bfloat16", "fp32": "float32"},
    ("train", "head_dtype"): {"bf16": "bfloat16", "fp32": "float32"},
    ("train", "device"): {"cuda": "cuda:0"},
}
"""(section, field) -> {old value: today's value}."""
DTYPES = ("auto", "bfloat16", "float32")
"""``train.precision`` and ``train.head_dtype`` values (torch's dtype names; head_dtype auto: train.loop.head_dtype)."""

MAX_LR = 1.0
"""The largest peak learning rate accepted: AdamW steps each weight by about lr, so past 1 a run only diverges."""

RESUME_MUTABLE = frozenset({"max_steps", "log_every", "ckpt_every", "keep_checkpoints", "progress", "num_threads",
                            "eval_every", "eval_samples", "diverge_ratio"})
"""TrainConfig fields a resume may change (everything else must equal the checkpoint's)."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, data and bookkeeping settings of one training run."""

    split: str = "train"
    """Dataset split to train on."""
    seed: int = 0
    """Base seed: sample order, anchors and init derive from it."""
    max_steps: int = 1000
    """Optimizer steps."""
    lr: float = 6e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Max global grad norm (<= 0 disables clipping)."""
    diverge_ratio: float = 20.0
    """A step whose loss exceeds this many times max(1, the first step's loss) stops training as diverged, as a
    non-finite loss or gradient does (0: only non-finite stops it). A watchdog: it changes no step it lets through."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_tokens: int | None = 8192
    """Padded tokens per micro-batch (batch size x longest sequence); None: fitted to the device at start for a
    family that counts its draft stack's cost (``train.fit``), else 8192."""
    max_batch_size: int = 16
    """Sequences per micro-batch at most."""
    max_seq_len: int | None = None
    """Truncate longer samples (None keeps them whole)."""
    shuffle_buffer: int = 0
    """Reader shuffle buffer (samples) on top of its block shuffle."""
    num_workers: int = 0
    """DataLoader processes that read, decode and collate (0: in the training process)."""
    device: str = "auto"
    """auto (cuda:0 if available), cpu or cuda:N (each torchrun rank takes cuda:N + its LOCAL_RANK)."""
    precision: str = "auto"
    """auto (bfloat16 autocast on GPU, float32 on CPU), bfloat16 or float32."""
    head_dtype: str = "auto"
    """dtype of the frozen embedding and lm_head, so of the vocabulary matmuls: auto (bfloat16 on GPU, float32 on
    CPU), bfloat16 or float32."""
    log_every: int = 10
    """Steps between metric lines (JSONL + console)."""
    ckpt_every: int = 500
    """Steps between checkpoints (a final one is always written)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones deleted)."""
    eval_every: int = 0
    """Steps between held-out acceptance measurements during training (0: none; ``tapdraft eval`` after)."""
    eval_samples: int = 64
    """Samples of the held-out split each of those measurements reads (the first ones, in file order)."""
    fingerprint: str | None = None
    """Expected target fingerprint; a dataset of another target is refused (None: accept the dataset's)."""
    chat_template: str | None = None
    """Jinja file of the chat template the drafter will be served with; a dataset captured with another is
    refused (None: accept the dataset's)."""
    template_kwargs: dict[str, Any] | None = None
    """Chat-template kwargs it will be served with, e.g. {enable_thinking: false}; a dataset captured with
    others is refused (None: accept the dataset's)."""
    num_threads: int | None = None
    """torch CPU threads (None leaves torch's default)."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "grad_accum", "max_tokens", "max_batch_size", "log_every", "ckpt_every",
                     "keep_checkpoints"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.diverge_ratio != 0 and not self.diverge_ratio > 1:
            raise ValueError(f"train.diverge_ratio must be > 1 (or 0: off), got {self.diverge_ratio}")
        if self.eval_every < 0 or self.eval_samples < 1:
            raise ValueError(f"train.eval_every must be >= 0 (0: off) and train.eval_samples >= 1, got "
                             f"{self.eval_every} and {self.eval_samples}")
        if self.num_workers < 0:
            raise ValueError(f"train.num_workers must be >= 0, got {self.num_workers}")
        if not 0 <= self.seed < 1 << 32:  # every RNG seeded from it takes this range (numpy's legacy one: no more)
            raise ValueError(f"train.seed must be in [0, 2**32), got {self.seed}")
        if self.warmup_steps < 0 or not 0 < self.lr <= MAX_LR or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need warmup_steps >= 0, 0 < lr <= {MAX_LR} and 0 <= min_lr_ratio <= 1, got "
                             f"{self.warmup_steps}, {self.lr} and {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.weight_decay <= 1
                and math.isfinite(self.grad_clip)):
            raise ValueError(f"need 0 <= beta1, beta2 < 1, 0 <= weight_decay <= 1 and a finite grad_clip, got "
                             f"{self.beta1}, {self.beta2}, {self.weight_decay} and {self.grad_clip}")
        if self.device not in ("auto", "cpu") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"train.device must be auto, cpu or cuda:N (e.g. cuda:0), got {self.device!r}")
        for name in ("precision", "head_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"train.{name} must be auto, bfloat16 or float32, got {getattr(self, name)!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"train.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.template_kwargs is not None:
            object.__setattr__(self, "template_kwargs", canonical_template_kwargs(self.template_kwargs))


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs: which drafter family, its config, and the training config."""

    family: str
    drafter: DrafterConfig
    train: TrainConfig

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "drafter": _plain(dataclasses.asdict(self.drafter)),
                "train": _plain(dataclasses.asdict(self.train))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """A run config dict (today's or one written before the renames: :func:`migrate_run_config`)."""
        d = migrate_run_config(d)
        unknown = set(d) - {"family", "drafter", "train"}
        if unknown:
            raise ValueError(f"config has unknown top-level keys {sorted(unknown)}; use family, drafter, train")
        family = d.get("family", DEFAULT_FAMILY)
        cfg_cls, _ = get_family(family)
        drafter = typed_config(cfg_cls, d.get("drafter") or {}, "drafter")
        train = typed_config(TrainConfig, d.get("train") or {}, "train")
        return cls(family, drafter, train)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


def migrate_run_config(d: dict[str, Any]) -> dict[str, Any]:
    """A run config (recipe, config file, saved ``config.json`` or a checkpoint's ``config``) in the names used
    before the renames -> today's names (``RENAMED_FIELDS``, ``RENAMED_VALUES``); today's comes back equal.

    ValueError when one section holds a field under both its old and its new name."""
    out = dict(d)
    for section in ("drafter", "train"):
        if not isinstance(out.get(section), dict):
            continue
        sec = dict(out[section])
        for (where, old), new in RENAMED_FIELDS.items():
            if where == section and old in sec:
                if new in sec:
                    raise ValueError(f"{section} sets both {old} and {new} (its new name); keep {new}")
                sec[new] = sec.pop(old)
        for (where, name), values in RENAMED_VALUES.items():
            if where == section and isinstance(sec.get(name), str) and sec[name] in values:
                sec[name] = values[sec[name]]
        out[section] = sec
    return out


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


_SCALARS: dict[Any, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
"""Declared scalar type -> the YAML/JSON value types it accepts (bool is never an int or a float here)."""


def _finite(x: float, where: str) -> float:
    """Every float setting is a finite number: inf or nan (YAML's .inf, --set lr=inf) trains nothing but NaNs."""
    if not math.isfinite(x):
        raise ValueError(f"{where}: {x} is not a finite number; give a finite value")
    return x


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """``value`` as the declared field type ``tp`` (unions, None, tuples from lists, scalars) or ValueError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check_type(value, arm, where)
            except ValueError:
                pass
        raise ValueError(f"{where}: {value!r} does not match {tp}")
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(_check_type(v, typing.get_args(tp)[0], where) for v in value)
    if origin is dict and isinstance(value, dict):
        key_tp, value_tp = typing.get_args(tp)
        return {_check_type(k, key_tp, where): _check_type(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is Any or (tp is type(None) and value is None):
        return value
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            x = float(value)
        except ValueError:
            x = None
        if x is not None:
            return _finite(x, where)
    elif tp in _SCALARS and isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
        return _finite(float(value), where) if tp is float else value
    raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r} ({type(value).__name__})")


def typed_config(cls: type, d: dict[str, Any], section: str) -> Any:
    """A frozen config dataclass from a dict: unknown keys refused, every value checked against its field's type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{section} has no field(s) {unknown}; known: {sorted(names)}")
    return cls(**{k: _check_type(v, hints[k], f"{section}.{k}") for k, v in d.items()})


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    q = RECIPES_DIR / f"{name_or_path}.yaml"
    if q.is_file():
        return q
    known = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml") if not x.stem.startswith("_"))
    raise ValueError(f"unknown recipe {name_or_path!r}: not a YAML file and not one of {known}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file with its ``base:`` chain resolved (each base merged first, this file on top)."""
    if path.resolve() in seen:
        raise ValueError(f"recipe {path} is its own base (via {[p.name for p in seen]}); break the cycle")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not plain YAML ({str(e).splitlines()[0]}); fix that line") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} must hold a mapping with keys base, family, drafter, train")
    doc = migrate_run_config(doc)
    base = doc.pop("base", None)
    if base is None:
        return doc
    if not isinstance(base, str):
        raise ValueError(f"{path}: base must be one recipe name (for example base: dflash), got {base!r}")
    return _merge(_read_yaml(recipe_path(base), (*seen, path.resolve())), doc)


def parse_override(item: str, raw: dict[str, Any]) -> tuple[str, str, Any]:
    """``key=value`` -> (section, field, parsed value); the key may be bare or section-qualified."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value (for example max_steps=100)")
    key, text = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:  # a !!python tag (never constructed: safe_load), an unclosed bracket
        why = str(e).splitlines()[0]
        raise ValueError(f"--set {item!r}: the value is not plain YAML ({why}); give a number, a string, a list or "
                         "a mapping, e.g. --set max_steps=100") from None
    key, value = _renamed_override(key, value)
    cfg_cls, _ = get_family(raw.get("family", DEFAULT_FAMILY))
    fields = {"drafter": {f.name for f in dataclasses.fields(cfg_cls)},
              "train": {f.name for f in dataclasses.fields(TrainConfig)}}
    if "." in key:
        section, name = key.split(".", 1)
        if section not in fields or name not in fields[section]:
            raise _unknown_field(key, fields, raw.get("family", DEFAULT_FAMILY))
        return section, name, value
    hits = [s for s in fields if key in fields[s]]
    if not hits:
        raise _unknown_field(key, fields, raw.get("family", DEFAULT_FAMILY))
    if len(hits) > 1:
        raise ValueError(f"field {key!r} exists in {hits}; qualify it, e.g. {hits[0]}.{key}=...")
    return hits[0], key, value


def _renamed_override(key: str, value: Any) -> tuple[str, Any]:
    """An override key (bare or qualified) and value written with a name from before the renames -> today's
    (the same tables :func:`migrate_run_config` applies)."""
    section, _, bare = key.rpartition(".")
    for sec in (section,) if section else ("drafter", "train"):
        if (sec, bare) in RENAMED_FIELDS:
            bare = RENAMED_FIELDS[(sec, bare)]
        values = RENAMED_VALUES.get((sec, bare), {})
        if isinstance(value, str) and value in values:
            value = values[value]
    return (f"{section}.{bare}" if section else bare), value


def _unknown_field(key: str, fields: dict[str, set[str]], family: str) -> ValueError:
    """``--set KEY=...`` names no field: the closest names when there are some, else every field by section."""
    bare = key.split(".", 1)[-1]
    names = {n: f"{s}.{n}" for s in ("drafter", "train") for n in fields[s]}
    close = [bare] if bare in names else difflib.get_close_matches(bare, list(names), n=3, cutoff=0.75)
    where = f"`tapdraft train --show-recipe RECIPE` lists the fields of a {family} run with their values"
    if close:
        close = [names[c] for c in close] if "." in key else close
        return ValueError(f"unknown field {key!r}; did you mean {' or '.join(close)}? ({where})")
    return ValueError(f"unknown field {key!r}; drafter fields ({family}): {sorted(fields['drafter'])}; "
                      f"train fields: {sorted(fields['train'])}")


def list_recipes() -> list[tuple[str, str, str]]:
    """(name, family, the first line of its leading comment) of every recipe in ``train/recipes``."""
    rows = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        if path.stem.startswith("_"):
            continue
        comment = next((ln.lstrip("# ").strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        rows.append((path.stem, str(_read_yaml(path).get("family", DEFAULT_FAMILY)), comment))
    return rows


def show_recipe(recipe: str) -> str:
    """A recipe fully resolved (its base chain and every default) as YAML: every key ``--set`` accepts."""
    run = load_run_config(recipe)
    head = (f"# recipe {recipe} ({recipe_path(recipe)}), resolved with every default. `--set KEY=VALUE` overrides "
            "any field:\n# a bare name resolves to its section (max_steps=100), or qualify it (drafter.gamma=4).\n")
    return head + yaml.safe_dump(run.to_dict(), sort_keys=False)


def load_run_config(recipe: str, *, config_file: str | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Recipe (name or YAML path) + optional YAML file + key=value overrides -> validated RunConfig."""
    raw = _read_yaml(recipe_path(recipe))
    if config_file is not None:
        p = Path(config_file)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        raw = _merge(raw, _read_yaml(p))
    raw.setdefault("drafter", {})
    raw.setdefault("train", {})
    for item in overrides:
        section, name, value = parse_override(item, raw)
        raw[section] = {**(raw.get(section) or {}), name: value}
    return RunConfig.from_dict(raw)
