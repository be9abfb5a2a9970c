"""What a path that should have been a regular file is, in words, for the one-line refusals of every
package (an input given to capture, a member inside a dataset)."""

from __future__ import annotations

import stat


def file_kind(mode: int) -> str:
    """What an ``lstat`` (or ``stat``) mode is, in words (for a path that should have been a regular file)."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    special = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device",
               stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((f"{name}, not a regular file" for test, name in special.items() if test(mode)), "not a regular file")
