"""EAGLE-3: one fused-taps layer run as a chain (config, model, loss; exported in vLLM's layout)."""

LAYOUTS: tuple[str, ...] = ()
"""Export layouts besides the native one (vLLM's): none."""
