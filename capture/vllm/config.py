"""VLLMConfig: how ``--engine vllm`` runs vLLM, for capture and regenerate alike; here, in vLLM's own folder, so the
engine imports its settings from below rather than from the capture config that embeds them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VLLMConfig:
    """How ``capture --engine vllm`` runs vLLM (capture.vllm.engine); recorded, since parallel layouts change
    the rounding of the states."""

    tensor_parallel_size: int = 1
    """vLLM's tensor parallelism: devices one copy of the target is split over."""
    pipeline_parallel_size: int = 1
    """vLLM's pipeline parallelism: stages one copy of the target is split into."""
    data_parallel_size: int = 1
    """Independent vLLM engines, each on tensor x pipeline devices; a window's requests are dealt to them in turn."""
    max_num_batched_tokens: int | None = None
    """Tokens per vLLM step (longer prompts are prefilled in chunks); None = vLLM's default."""
    cpu_kv_cache_gib: int = 1
    """KV cache space of vLLM's CPU backend in GiB (``VLLM_CPU_KVCACHE_SPACE``; ignored on GPUs)."""
    threads: int | None = None
    """CPU threads: vLLM's ranks split them (``OMP_NUM_THREADS``), and a capture's teacher head runs on them.
    None: this process's torch thread count when the run begins, or on a capture's resume the count it began
    with (:func:`pin_threads`). Recorded by capture: the count orders fp32 reductions (two uninterrupted captures of
    the BPE target's 64 conversations at 1 and 2 threads: top-k log-probs of 15 samples up to 2.9e-6 apart, taps
    and ids equal; at one count, equal), so teacher rows equal to the last bit need the same count."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "cpu_kv_cache_gib"):
            if getattr(self, name) < 1:
                raise ValueError(f"VLLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"VLLMConfig.threads must be >= 1 or None, got {self.threads}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("VLLMConfig.max_num_batched_tokens must be >= 1 or None, "
                             f"got {self.max_num_batched_tokens}")
