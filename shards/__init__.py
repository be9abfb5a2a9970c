"""The on-disk dataset format: schema, writers, readers, manifest, checksums, target bundle.

Each storage format (Arrow, WebDataset) is one reader/writer class pair in ``shards.formats``, known to the rest only
through its registry entry. Knows nothing about models; capture/ writes through it and train/ reads through it. It
alone names the dataset's files: others ask ``shards.manifest`` for paths and status. Every atomic write (files and
the bundle directory) goes through ``common.atomic``.

Beside the format, what the dataset's contract defines for its readers: the head spec and teacher head math
(``head``: the bundle's frozen head applied) and the tap numbering rules (``taps``). What every package shares and
the format does not own (errors, progress, atomic writes, locks, chat-template settings) is ``common``, below it.
"""
