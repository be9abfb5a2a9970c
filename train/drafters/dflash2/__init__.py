"""DFlash2: DFlash with convolutional sublayers and a learned path selector (config, model, selector; its
export layouts are DFlash's)."""

LAYOUTS: tuple[str, ...] = ("speculators",)
"""Export layouts besides the native one (no ``--layout``): speculators' DFlash2 format."""
