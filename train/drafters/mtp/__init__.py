"""MTP heads trained over a frozen target (model, head modules, loss, export layouts)."""

LAYOUTS: tuple[str, ...] = ("deepseek", "vllm-qwen3-next", "nemo-salm", "tapdraft-vllm")
"""Accepted ``--layout`` values for MTP exports (``layouts.convert``)."""
DEFAULT_LAYOUT = "deepseek"
"""The layout of an export that names none: the checkpoint's own names."""
