"""EAGLE-3: one fused-taps layer run as a chain (model and loss, in vLLM's layout)."""

LAYOUTS: tuple[str, ...] = ()
"""Export layouts besides the native one (vLLM's): none."""
