"""DFlash: the block-diffusion drafter (model, config, loss, anchors, the speculators layout, the shipped
modeling file in serving/)."""
