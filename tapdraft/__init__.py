"""tapdraft's public Python entry point, for the teams that use its datasets:

    import tapdraft
    ds = tapdraft.open_dataset("path/or/fsspec/url")   # a finished dataset (manifest checked, shards verified on read)
    ds.sample("train", 0); ds.stream("train", seed=0, rank=0, world_size=1); ds.bundle()

A thin re-export: the implementation lives in ``shards.reader``, the one package that knows the format.
"""

from shards.reader import Dataset, open_dataset

__all__ = ["Dataset", "open_dataset"]
