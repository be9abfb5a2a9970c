"""tapdraft's public Python entry point, for the teams that use its datasets:

    import tapdraft
    ds = tapdraft.open_dataset("path/or/fsspec/url")   # a finished dataset (manifest checked, shards verified on read)
    ds.sample("train", 0); ds.stream("train", seed=0, rank=0, world_size=1); ds.bundle()

A thin re-export: the implementation lives in ``tapdraft.shards.reader``, the one package that knows the format.
The whole project is this one namespace (``tapdraft.capture``, ``tapdraft.shards``, ``tapdraft.train``, ...).
"""

__version__ = "0.2.0"

from tapdraft.shards.reader import Dataset, open_dataset  # noqa: E402  (after the version, which setuptools reads)

__all__ = ["Dataset", "__version__", "open_dataset"]
