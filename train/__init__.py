"""Fit speculative-decoding drafters (DFlash, DFlash2, MTP) from a dataset, never the live target."""
