"""LiLiCorr: DFlash's backbone with a lattice reranker over each slot's top candidates (``model``, ``lattice``)."""
