"""CaptureConfig: everything that decides what a capture writes, frozen and validated.

The resolved config is written as ``capture_config.json`` beside the dataset and into its
manifest. A rerun into the same directory resumes only when every field outside
:data:`RUNTIME_FIELDS` matches; otherwise it is refused with the differing field named, because a
dataset whose first half used other taps, another batch composition or another target is not one
dataset.

How shards are written is the embedded :class:`shards.writer.ShardConfig` (``shard``); the JSON
record flattens its fields beside the capture's own (``format``, ``shard_bytes``, ...), as the CLI
flags name them. Records written before the embedding lack ``batch_bytes``, records written before
chat-template settings existed lack ``chat_template`` and ``template_kwargs``:
:func:`migrate_capture_record` fills them in with the values those captures used, and makes the
absolute paths older records hold portable (a name relative to its root, as records are written now).

The record also holds ``inputs``: each split's input (by its portable name) and the sha256 of its
content (``capture.inputs.input_digest``). A resume over an input whose content changed is refused
naming the file (``common.errors.InputChangedError``): reordering or editing a manifest between a kill and
the rerun would otherwise give duplicated and missing samples. Records written before inputs were
hashed have no ``inputs``; their resume is allowed with a warning that the content is not checked.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tapdraft.capture.inputs import stored_source
from tapdraft.capture.engines import DEFAULT_ENGINE, ENGINES, get_engine
from tapdraft.capture.generation import ReplyConfig
from tapdraft.capture.vllm.config import VLLMConfig
from tapdraft.common.errors import InputChangedError
from tapdraft.common.template import template_kwargs
from tapdraft.shards.manifest import check_split
from tapdraft.shards.shard_file import LEGACY_SHARD_FIELDS, ShardConfig
from tapdraft.shards.taps import DEFAULT_TAPS_CODEC, TAPS_CODECS, foreign_layout_fields

_LEGACY_SHARD_DEFAULTS = {"batch_bytes": 4 << 20, "replies": None, "fused": True, **LEGACY_SHARD_FIELDS}
"""What captures recorded before ShardConfig (and regeneration, and the fp8 layout) was embedded used for the keys
they did not record."""
_LEGACY_TEMPLATE_DEFAULTS = {"chat_template": None, "template_kwargs": {}}
"""What captures recorded before template settings existed used: the tokenizer's template, no kwargs."""
_LEGACY_ENGINE_DEFAULTS = {"engine": "transformers", "vllm": None, "vllm_python": None, "threads": None}
"""What captures recorded before ``--engine`` (and the in-process thread count) existed used: the in-process engine,
on the thread count of the process (None)."""

RUNTIME_FIELDS = ("out", "stage", "on_error", "queue_size", "progress", "vllm_python", "allow_outside_paths")
"""Fields that may change between a run and its resume (where the dataset lives, how errors and progress are
handled): they do not change what is written."""

PLACEMENT_FIELDS = ("writers",)
"""Fields that decide which shard holds a sample, not what a sample is: a resume must keep them (the shards' names
follow from them), a dataset's lineage leaves them out (``capture.pipeline.lineage``)."""

PATH_FIELDS = ("target", "out", "llm_config", "chat_template", "vllm_python")
"""Fields holding one local path; recorded by name (:func:`portable_path`), like each input in ``data``."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
INPUTS_KEY = "inputs"
"""Record key: {split: {"input": portable name, "sha256": content hash or None}}."""


NO_OPTION = ("row_chunk", "queue_size")
"""CaptureConfig fields the CLI has no option for (set from Python only)."""


def option(name: str) -> str:
    """How a user typed the setting ``name``: its CLI option (``--draft-layers``), so a refusal uses the user's own
    words; the field itself for the few without one."""
    return f"CaptureConfig.{name}" if name in NO_OPTION else "--" + name.replace("_", "-")


@dataclass(frozen=True)
class CaptureConfig:
    """One capture run: target, inputs, what to store, how to batch and write it."""

    target: str
    """Target directory: a SALM (salm_config.json), a NeMo SALM checkpoint, an HF-native speech LLM (Qwen2-Audio)
    or an HF causal LM."""
    out: str
    """Dataset directory to create or resume, or a remote URL (s3://...): then the capture writes into ``stage``
    and uploads each finished shard in the background, the manifest last."""
    data: tuple[tuple[str, str], ...]
    """(split, input) pairs; an input is a JSONL manifest, an HF dataset dir, or ``hf:NAME[:split]``."""
    stage: str | None = None
    """Local staging directory of a capture into a remote ``out`` (None: ``shards.transfer.staging_dir``)."""
    max_samples: int | None = None
    """Capture only the first N inputs of each split (before rank slicing); None = all."""
    max_length: int | None = None
    """Skip (and count) samples whose expanded length exceeds this; never truncate. None = no limit."""
    top_k: int = 64
    """Teacher top-k per supervised row; 0 stores no teacher rows."""
    taps: tuple[int, ...] | None = None
    """Explicit HF tap ids (decoder layer outputs); None = ``shards.taps.capture_tap_ids``: the DFlash taps for
    ``draft_layers``, the one-layer draft's (the ``dflash`` recipe) and the last layer."""
    draft_layers: int = 5
    """Draft depth the default taps are chosen for."""
    dtype: str = "auto"
    """Target compute dtype: 'auto' = bfloat16 on GPU, float32 on CPU."""
    device: str = "auto"
    """'auto' = cuda if available (cuda:LOCAL_RANK under torchrun), else cpu."""
    codec: str = DEFAULT_TAPS_CODEC
    """Taps codec: 'bf16' (lossless) or 'fp8' (e4m3 + per-row scale, lossy; recorded in the manifest)."""
    final_hidden: bool = False
    """Store final_hidden separately (redundant when the last layer is a tap, which it is by default)."""
    audio_embeds: bool = False
    """Store the merged input embeddings at audio rows (for MTP heads over audio positions)."""
    batch_tokens: int = 16384
    """Padded tokens per forward batch (B * max T)."""
    max_batch_size: int = 64
    """Samples per forward batch at most."""
    window: int = 256
    """Inputs bucketed together by length; also the unit a resume recomputes from."""
    row_chunk: int = 1024
    """Teacher rows per lm_head chunk (bounds the [rows, vocab] buffer)."""
    shard: ShardConfig = dataclasses.field(default_factory=ShardConfig)
    """How samples become shard files (format, shard size, compression)."""
    on_error: str = "fail"
    """Bad input: 'fail' stops with sample id, line and reason (dataset stays resumable); 'skip' records it."""
    allow_outside_paths: bool = False
    """Let a JSONL's audio paths leave its directory (``..``, absolute paths); off, such a line is a bad input, so a
    shared manifest cannot make the capture read other files of this machine (capture/inputs.py)."""
    queue_size: int = 8
    """Batches in flight between compute and the background writer (bounds host memory)."""
    progress: bool = True
    """Show a progress bar."""
    llm_config: str | None = None
    """NeMo SALM checkpoints only: a local directory with the LLM's config.json and tokenizer, for a checkpoint
    that only names its LLM (``pretrained_llm``)."""
    responses_from_target: bool | None = None
    """Whether the assistant turns are the target's own greedy replies (then offline tau is exact for
    greedy decoding); None = derived: from ``replies`` when set, else from a regenerate sidecar beside
    the inputs, else unknown. Recorded in the manifest for the evaluator."""
    chat_template: str | None = None
    """Jinja file replacing the target tokenizer's chat template; None uses the tokenizer's own."""
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    """Variables the chat template is rendered with (enable_thinking, a system prompt...), as (key, value) pairs
    or a dict; recorded in the bundle and its fingerprint."""
    replies: ReplyConfig | None = None
    """Rewrite the assistant turns with the target's own replies first (``capture --regenerate``); None = as given."""
    fused: bool = True
    """With ``replies``: store the states of the generation pass itself (no second forward); False = two passes
    (regenerate into ``OUT.regenerated/``, then capture that), for bit-identical prefill taps."""
    engine: str = DEFAULT_ENGINE
    """What runs the target's forward, a name in ``capture.engines.ENGINES``: 'transformers' (in-process, the default)
    or 'vllm' (capture.vllm.engine)."""
    vllm: VLLMConfig | None = None
    """With engine 'vllm': how vLLM runs (defaults when None); must be None otherwise."""
    vllm_python: str | None = None
    """With engine 'vllm': the interpreter of the environment vLLM is installed in; None = this one."""
    threads: int | None = None
    """The in-process engine's CPU threads (its forward and teacher head; ``--engine vllm`` has ``vllm.threads``).
    None: this process's torch thread count when the run begins, or on a resume the count the capture began with
    (:func:`pin_threads`). Recorded: fp32 reductions round by the count, so only a resume at the same count writes
    the bytes an uninterrupted capture would."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1 or None, got {self.threads}")
        if not self.data:
            raise ValueError("--data is empty: give at least one (split, input) pair")
        object.__setattr__(self, "data", tuple((str(s), str(p)) for s, p in self.data))
        splits = [check_split(s) for s, _ in self.data]  # before any work: a bad name after a captured split was
        if len(set(splits)) != len(splits):             # refused only then, and its fix refused as a changed setting
            raise ValueError(f"--data names a split twice: {splits}")
        if self.taps is not None:
            object.__setattr__(self, "taps", tuple(sorted({int(t) for t in self.taps})))
        for name in ("max_samples", "max_length"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{option(name)} must be >= 1 or None, got {v}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if self.draft_layers < 1:
            raise ValueError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.codec not in TAPS_CODECS:
            raise ValueError(f"--codec must be one of {tuple(TAPS_CODECS)}, got {self.codec!r}")
        for name in ("batch_tokens", "max_batch_size", "window", "row_chunk", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option(name)} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.shard, ShardConfig):
            raise ValueError(f"CaptureConfig.shard must be a ShardConfig, got {type(self.shard).__name__}")
        object.__setattr__(self, "template_kwargs", tuple(template_kwargs(self.template_kwargs).items()))
        if self.chat_template is not None and not str(self.chat_template).strip():
            raise ValueError("--chat-template must be a file path or None")
        if self.replies is not None and not isinstance(self.replies, ReplyConfig):
            raise ValueError(f"CaptureConfig.replies must be a ReplyConfig or None, got {type(self.replies).__name__}")
        get_engine(self.engine, "CaptureConfig.engine").check_capture(self)
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"--on-error must be 'fail' or 'skip', got {self.on_error!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: every field, with ``shard``'s fields flattened to the top level and paths
        made portable (:func:`portable_path`), so a shared dataset does not carry one machine's layout."""
        d = dataclasses.asdict(self)
        d.update(d.pop("shard"))
        for key in PATH_FIELDS:
            d[key] = None if d[key] is None else portable_path(d[key])
        d["data"] = [[split, portable_path(spec)] for split, spec in self.data]
        d["taps"] = None if self.taps is None else list(self.taps)
        d["template_kwargs"] = dict(self.template_kwargs)
        return d

    def identity(self) -> dict[str, Any]:
        """The fields a resume must match."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}


def portable_path(spec: str) -> str:
    """A recorded path relative to its root: a file or directory by its name (``train.jsonl``, the
    target directory's name), ``hf:`` specs with a local directory likewise, hub names unchanged.
    The target's identity is its fingerprint and an input's its content, not where they sat."""
    if spec.startswith("hf:"):
        name, sep, split = spec[3:].partition(":")
        return "hf:" + stored_source(name, None) + sep + split
    return stored_source(spec, None)


RESTART_HINT = "or rerun with --restart to discard what was captured and start over"


def check_resume(path: Path, current: dict[str, Any], given: dict[str, str] | None = None) -> None:
    """Refuse to resume into ``path``'s dataset when a recorded field differs from ``current``; ``given``
    ({split: input as given}) names the inputs by their full path in the message."""
    if not path.is_file():
        return
    old = migrate_capture_record(json.loads(path.read_text()))
    for key in sorted(set(old) | set(current)):
        if key in RUNTIME_FIELDS or key == INPUTS_KEY or key in foreign_layout_fields(current.get("codec")):
            continue  # (another codec's byte layout, such as fp8's when taps are bf16, writes nothing)
        if old.get(key) != current.get(key):
            raise ValueError(
                f"{path.parent} was captured with {key}={old.get(key)!r}, this run has {key}={current.get(key)!r}. "
                f"Rerun with the original setting to resume, capture into a new --out directory, {RESTART_HINT}."
            )
    _check_inputs(path, old.get(INPUTS_KEY), current.get(INPUTS_KEY) or {}, given or {})


def _check_inputs(path: Path, old: dict[str, Any] | None, now: dict[str, Any], given: dict[str, str]) -> None:
    if old is None:
        warnings.warn(f"{path} predates input hashing: the content of the inputs is not checked on this resume; "
                      "make sure they are unchanged since the capture began", stacklevel=3)
        return
    for split, cur in now.items():
        was = old.get(split) or {}
        if was.get("sha256") is None or cur.get("sha256") is None:
            continue
        if was["sha256"] != cur["sha256"]:
            name = Path(given[split]).absolute() if split in given else cur["input"]
            raise InputChangedError(
                f"input {name} (split {split}) changed since the capture in {path.parent.absolute()} began (sha256 "
                f"{was['sha256'][:12]} then, {cur['sha256'][:12]} now): resuming would duplicate and lose samples. "
                f"Restore the original file to resume, capture into a new --out directory, {RESTART_HINT}."
            )


def migrate_capture_record(record: dict[str, Any]) -> dict[str, Any]:
    """A capture record as today's ``CaptureConfig.to_dict`` writes it (a new dict).

    Records written before paths were made portable hold absolute paths: they become portable too.
    """
    legacy = {**_LEGACY_SHARD_DEFAULTS, **_LEGACY_TEMPLATE_DEFAULTS, **_LEGACY_ENGINE_DEFAULTS}
    out = {**{k: v for k, v in legacy.items() if k not in record}, **record}
    for key in PATH_FIELDS:
        if isinstance(out.get(key), str):
            out[key] = portable_path(out[key])
    if isinstance(out.get("data"), list):
        out["data"] = [[split, portable_path(spec)] for split, spec in out["data"]]
    if isinstance(out.get("vllm"), dict) and "threads" not in out["vllm"]:  # recorded before the thread count was
        out["vllm"] = {**out["vllm"], "threads": None}
    return out


AUTO_WRITERS = 4
"""Writer lanes ``pin_writers`` gives a rank on a GPU with at least twice as many host cores: four lanes took an
H200's capture from 13.9k to 30.9k tokens/s at Qwen3's widths where one lane left it waiting (docs/performance.md,
``gpu_capture_writers.json``)."""


def auto_writers(device_type: str, cores: int) -> int:
    """Writer lanes for a rank with ``cores`` host cores of its own: on a CPU one (the forward needs the cores, and
    one lane keeps up with it), on a GPU ``AUTO_WRITERS`` where the cores allow, else half of them."""
    if device_type == "cpu":
        return 1
    return max(1, min(AUTO_WRITERS, cores // 2))


def rank_cores() -> int:
    """Host cores this process may run on, shared among the ranks of its node (``LOCAL_WORLD_SIZE``)."""
    import os

    from tapdraft.common.host import usable_cores

    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def pin_writers(cfg: CaptureConfig, record: Path, device_type: str, cores: int) -> CaptureConfig:
    """``cfg`` with its writer lanes decided: as given; else, resuming, the count recorded when the capture began
    (the lanes decide the shards' names, so a resume keeps them, on whatever machine); else
    :func:`auto_writers` for this device and ``cores``."""
    if cfg.shard.writers is not None:
        return cfg
    n = None
    if record.is_file():
        n = migrate_capture_record(json.loads(record.read_text())).get("writers")
    n = n or auto_writers(device_type, cores)
    return dataclasses.replace(cfg, shard=dataclasses.replace(cfg.shard, writers=n))


def pin_threads(cfg: CaptureConfig, record: Path, current: int) -> CaptureConfig:
    """``cfg`` with its engine's thread count decided (``vllm.threads`` or, in-process, ``threads``): as given;
    else, resuming, the count recorded in ``record`` when the capture began (with a warning when ``current``
    differs); else ``current``, this process's torch thread count. A capture resumed in a process with other
    threads (a shell with another ``--threads``, a test process whose earlier tests set torch's threads) so
    computes as it began, and the resumed dataset equals an uninterrupted one bit for bit. A record from before
    the field keeps None: the current count, as those captures ran."""
    engine = ENGINES[cfg.engine]
    if engine.threads(cfg) is not None:
        return cfg
    n: int | None = current
    if record.is_file():
        old = engine.recorded_threads(migrate_capture_record(json.loads(record.read_text())))
        if isinstance(old, dict):
            n = old.get("threads")
            if n is not None and n != current:
                warnings.warn(f"resuming the capture in {record.parent} with the {n} CPU threads it began with "
                              f"(this process has {current}), so that it computes as it began", stacklevel=2)
    return engine.with_threads(cfg, n)
