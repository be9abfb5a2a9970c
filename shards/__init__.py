"""The on-disk dataset format, and the shared kernel every package imports.

The format: schema, writers, readers, manifest, checksums, target bundle; each storage format (Arrow,
WebDataset) is one reader/writer class pair in ``shards.formats``, known to the rest only through its
registry entry. Knows nothing about models; capture/ writes through it and train/ reads through it. It
alone names the dataset's files: others ask ``shards.manifest`` for paths and status, and every atomic
write (files and the bundle directory) goes through ``shards.atomic``.

The kernel: the project's error types and exit codes (``errors``), progress bars (``progress``), the
head spec and teacher head math (``head``), the tap numbering rules (``taps``) and the chat-template
settings (``template``) live here because capture/, train/ and speculate/ all import shards.
"""
