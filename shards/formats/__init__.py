"""The storage formats, one module each: arrow.py (Arrow IPC stream shards), wds.py (WebDataset tar shards)."""
