"""The on-disk dataset format: schema, writers, readers, manifest, checksums, target bundle.

Knows nothing about models; capture/ writes through it and train/ reads through it. It alone names
the dataset's files: others ask ``shards.manifest`` for paths and status, and every atomic write
(files and the bundle directory) goes through ``shards.atomic``.
"""
