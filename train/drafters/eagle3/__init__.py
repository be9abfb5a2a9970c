"""EAGLE-3: one fused-taps layer run as a chain (model and loss, in vLLM's layout)."""
