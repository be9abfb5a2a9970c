"""The capture engines: what runs the target's forward (``capture``) and decodes its replies (``regenerate``), by the
name ``--engine`` takes. ``ENGINES`` maps each name to one :class:`Engine`, as ``shards.formats.FORMATS`` maps a
storage format's; the rest of capture asks the entry and never compares the name, so an engine is one class here
(and its folder, as ``capture/vllm/``), not a branch in every module that runs the target.

    transformers  in-process: the target's decoder runs in this process, on the capture's thread count (the default)
    vllm          a vLLM worker in its own environment (capture/vllm/): only the target's tokenizer and head load here

Importing this module imports nothing heavy (the CLI builds its ``--engine`` help from it); each method imports what
its engine needs.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    import torch

    from tapdraft.capture.generation import ReplyConfig
    from tapdraft.capture.targets.base import Target
    from tapdraft.capture.vllm.config import VLLMConfig
    from tapdraft.shards.schema import Layout


class RunSettings(Protocol):
    """What an engine reads of the run it serves: a ``CaptureConfig`` or a ``RegenerateConfig`` (both frozen
    dataclasses; named structurally, as ``capture.config`` imports this module)."""

    @property
    def target(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def replies(self) -> ReplyConfig | None: ...
    @property
    def vllm(self) -> VLLMConfig | None: ...
    @property
    def vllm_python(self) -> str | None: ...


class CaptureSettings(RunSettings, Protocol):
    """What a capture adds (``CaptureConfig``): the in-process thread count and the longest sample."""

    @property
    def threads(self) -> int | None: ...
    @property
    def max_length(self) -> int | None: ...
    @property
    def batch_tokens(self) -> int: ...


class ReplySettings(RunSettings, Protocol):
    """What a regeneration adds (``RegenerateConfig``): whether vLLM reuses a conversation's earlier turns."""

    @property
    def prefix_caching(self) -> bool: ...


class Engine:
    """One capture engine. ``cfg`` is the run it serves: a capture's (``CaptureSettings``) or a regeneration's
    (``ReplySettings``)."""

    name: str = ""
    capture_help: str = ""
    """What ``capture --engine NAME`` runs, for the help text."""
    regenerate_help: str = ""
    """What ``regenerate --engine NAME`` decodes with, for the help text."""
    loads_decoder: bool = True
    """Whether the target's decoder runs in this process (otherwise only its tokenizer and head are loaded)."""

    def settings(self, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1) -> VLLMConfig | None:
        """The engine's own settings (``cfg.vllm``) from the CLI's flags; None for an engine that has none."""
        return None

    def check_capture(self, cfg: CaptureSettings) -> None:
        """Validate (and complete, on the frozen ``cfg``) a capture's engine settings; ``ValueError`` if refused."""

    def check_regenerate(self, cfg: ReplySettings) -> None:
        """Validate (and complete) a regeneration's engine settings; ``ValueError`` if refused."""

    def preflight(self, cfg: RunSettings) -> None:
        """Checks that must pass before anything is loaded or written."""

    def check_target(self, target: Target, *, audio_embeds: bool = False) -> None:
        """Refuse a target (or a stored field) this engine cannot run, before anything is written."""

    def threads(self, cfg: CaptureSettings) -> int | None:
        """The CPU thread count ``cfg`` sets for this engine (None: not decided)."""
        return cfg.threads

    def recorded_threads(self, record: dict[str, Any]) -> Any:
        """Where a capture record keeps this engine's thread count (a dict with ``threads``, or None)."""
        return record

    def with_threads(self, cfg: CaptureSettings, n: int | None) -> CaptureSettings:
        """``cfg`` with this engine's thread count set to ``n``."""
        return dataclasses.replace(cfg, threads=n)

    @contextmanager
    def capture_session(self, cfg: CaptureSettings, target: Target, layout: Layout) -> Iterator[Any]:
        """What runs a capture's forwards (started once for all splits, stopped at the end); None: in-process."""
        from tapdraft.capture.stages import torch_threads
        import torch

        with torch_threads(cfg.threads or torch.get_num_threads()):  # None: a record from before the field
            yield None

    @contextmanager
    def reply_session(self, cfg: ReplySettings, target: Target, device: torch.device) -> Iterator[Any]:
        """What decodes a regeneration's replies; None: in-process (``capture.replies.windows``)."""
        yield None


class InProcess(Engine):
    name = "transformers"
    capture_help = "in-process"
    regenerate_help = "in-process, padded batches"

    def check_capture(self, cfg: CaptureSettings) -> None:
        if cfg.vllm is not None or cfg.vllm_python is not None:
            raise ValueError("vLLM settings were given but the engine is 'transformers'; add --engine vllm")

    def check_regenerate(self, cfg: ReplySettings) -> None:
        if cfg.prefix_caching:
            raise ValueError("--prefix-caching is vLLM's prefix cache; add --engine vllm")


class VLLM(Engine):
    name = "vllm"
    capture_help = "a vLLM worker in its own environment; text causal LMs and Qwen2-Audio"
    regenerate_help = ("a vLLM worker in its own environment, continuous batching; greedy only; text causal LMs and "
                       "Qwen2-Audio")
    loads_decoder = False

    def settings(self, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1) -> VLLMConfig:
        from tapdraft.capture.vllm.config import VLLMConfig

        return VLLMConfig(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                          data_parallel_size=data_parallel_size)

    def _default_settings(self, cfg: RunSettings) -> None:
        from tapdraft.capture.vllm.config import VLLMConfig

        if cfg.vllm is None:
            object.__setattr__(cfg, "vllm", VLLMConfig())

    def check_capture(self, cfg: CaptureSettings) -> None:
        self._default_settings(cfg)
        if cfg.replies is not None:
            raise ValueError("--regenerate runs generation in-process; capture with --engine vllm from a "
                             "regenerated input instead (tapdraft regenerate --engine vllm, then capture)")

    def check_regenerate(self, cfg: ReplySettings) -> None:
        if not cfg.replies.generation.greedy:
            raise ValueError("--engine vllm regenerates greedily only: vLLM's sampler draws other numbers than "
                             "tapdraft's per-reply seeded one, so its sampled replies would not be reproducible; "
                             "drop --temperature, or drop --engine vllm")
        self._default_settings(cfg)

    def preflight(self, cfg: RunSettings) -> None:
        from tapdraft.capture.vllm.engine import check_python

        check_python(cfg.vllm_python, cfg.vllm)

    def check_target(self, target: Target, *, audio_embeds: bool = False) -> None:
        from tapdraft.capture.vllm.engine import check_target

        check_target(target, audio_embeds=audio_embeds)

    def threads(self, cfg: CaptureSettings) -> int | None:
        assert cfg.vllm is not None, "check_capture fills in the vLLM settings"
        return cfg.vllm.threads

    def recorded_threads(self, record: dict[str, Any]) -> Any:
        return record.get("vllm")

    def with_threads(self, cfg: CaptureSettings, n: int | None) -> CaptureSettings:
        return dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, threads=n))

    @contextmanager
    def capture_session(self, cfg: CaptureSettings, target: Target, layout: Layout) -> Iterator[Any]:
        """The vLLM workers, their head proven against tapdraft's before any sample (the teacher rows are tapdraft's
        head on vLLM's states), on the capture's thread count (the teacher head's reductions too)."""
        import torch

        from tapdraft.capture.stages import resolve_dtype, torch_threads
        from tapdraft.capture.vllm.engine import VLLMEngine, layer_ids, prove_head

        assert cfg.vllm is not None
        longest = min(x for x in (cfg.max_length, target.max_positions) if x is not None) \
            if (cfg.max_length or target.max_positions) else cfg.batch_tokens
        threads = cfg.vllm.threads or torch.get_num_threads()  # None: a record from before VLLMConfig.threads
        with VLLMEngine(cfg.vllm, python=cfg.vllm_python, target_dir=cfg.target,
                        layer_ids=layer_ids(layout.tap_ids, layout.num_layers),
                        dtype=str(resolve_dtype(cfg.dtype, target.device)).removeprefix("torch."),
                        max_model_len=longest, threads=threads) as engine, torch_threads(threads):
            prove_head(engine, target, layout)
            yield engine

    @contextmanager
    def reply_session(self, cfg: ReplySettings, target: Target, device: torch.device) -> Iterator[Any]:
        """vLLM workers in generate mode (capture.vllm.regenerate)."""
        import torch

        from tapdraft.capture.generation import context_length
        from tapdraft.capture.stages import resolve_dtype
        from tapdraft.capture.vllm.engine import check_target
        from tapdraft.capture.vllm.regenerate import VLLMReplies

        check_target(target)
        assert cfg.vllm is not None
        ctx = context_length(target) or 8192
        with VLLMReplies(cfg.vllm, target, python=cfg.vllm_python, target_dir=cfg.target,
                         dtype=str(resolve_dtype(cfg.dtype, device)).removeprefix("torch."), max_model_len=ctx,
                         max_new_tokens=cfg.replies.generation.max_new_tokens,
                         threads=cfg.vllm.threads or torch.get_num_threads(),
                         prefix_caching=cfg.prefix_caching) as engine:
            yield engine


ENGINES: dict[str, Engine] = {"transformers": InProcess(), "vllm": VLLM()}
"""``--engine`` name -> its engine; the first is the default."""
DEFAULT_ENGINE = next(iter(ENGINES))


def get_engine(name: str, where: str) -> Engine:
    """The engine called ``name``; ``ValueError`` naming ``where`` (a config field) and the known names otherwise."""
    if name not in ENGINES:
        raise ValueError(f"{where} must be one of {tuple(ENGINES)}, got {name!r}")
    return ENGINES[name]


def engine_help(command: str) -> str:
    """The ``--engine`` help of ``command`` (capture or regenerate), one entry per registered engine."""
    return " | ".join(f"{e.name} ({e.capture_help if command == 'capture' else e.regenerate_help})"
                      for e in ENGINES.values())


def engine_settings(name: str, **flags: int) -> VLLMConfig | None:
    """The named engine's settings from the CLI's flags (None for an unknown name: the config then refuses it)."""
    return ENGINES[name].settings(**flags) if name in ENGINES else None
