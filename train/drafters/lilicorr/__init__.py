"""LiLiCorr: DFlash's backbone with a lattice reranker over each slot's top candidates (config, model, lattice)."""

LAYOUTS: tuple[str, ...] = ()
"""Export layouts besides the native one: none."""
