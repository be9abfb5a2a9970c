"""A target's own MTP module fine-tuned in place (Qwen3.5), exported as a copy of the target (config, model,
export)."""

LAYOUTS: tuple[str, ...] = ()
"""Export layouts besides the native one (the target's own): none."""
