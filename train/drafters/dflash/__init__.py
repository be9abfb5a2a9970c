"""DFlash: the block-diffusion drafter (model, config, loss, anchors, the speculators layout, the shipped
modeling file in serving/)."""

LAYOUTS: tuple[str, ...] = ("speculators",)
"""Export layouts besides the native one (no ``--layout``): speculators' DFlash format."""
