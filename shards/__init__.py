"""The on-disk dataset format: schema, writers, readers, manifest, checksums, target bundle.

Knows nothing about models; capture/ writes through it and train/ reads through it.
"""
