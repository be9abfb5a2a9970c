"""DSpark: DFlash's backbone with next-token slots and a sequential low-rank Markov head, vLLM's Qwen3DSparkModel
(config, model, markov)."""

LAYOUTS: tuple[str, ...] = ("qwen3_omni",)
"""Export layouts besides the native one (no ``--layout``, ``Qwen3DSparkModel``): ``Qwen3OmniDSparkModel``."""
