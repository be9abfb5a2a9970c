"""DFlash: the block-diffusion drafter (config, model, loss, export: the speculators layout and the Open Spec
Config block; anchors; the shipped modeling file in serving/)."""

LAYOUTS: tuple[str, ...] = ("speculators",)
"""Export layouts besides the native one (no ``--layout``): speculators' DFlash format."""
