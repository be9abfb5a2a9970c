"""MTP heads trained over a frozen target (config, model, loss, export: its layouts; heads: the head modules)."""

LAYOUTS: tuple[str, ...] = ("deepseek", "vllm-qwen3-next", "nemo-salm", "tapdraft-vllm")
"""Accepted ``--layout`` values for MTP exports (``export.convert``)."""
DEFAULT_LAYOUT = "deepseek"
"""The layout of an export that names none: the checkpoint's own names."""
