"""The storage formats, one module each with one writer and one reader class (``shards.formats.base``).

    arrow.py   Arrow IPC stream shards: record batches, random access, what ``datasets`` memory-maps
    wds.py     WebDataset tar shards: one zstd member per field, read whole, what ``webdataset`` streams

``FORMATS`` maps the name a manifest records under ``"format"`` (and ``ShardConfig.format`` takes) to its
``Format``; code outside this package goes through it and never names a format.
"""

from __future__ import annotations

from tapdraft.shards.formats.arrow import FORMAT as ARROW
from tapdraft.shards.formats.base import Format
from tapdraft.shards.formats.wds import FORMAT as WDS

FORMATS: dict[str, Format] = {f.name: f for f in (ARROW, WDS)}
DEFAULT_FORMAT = ARROW.name
"""Random access and the stock ``datasets`` loader: what a capture writes unless told otherwise."""


def format_help() -> str:
    """``--format``'s choices, as its help lists them."""
    return " | ".join(f"{f.name} ({f.help})" for f in FORMATS.values())


def get_format(name: object, where: str) -> Format:
    """The registry entry of ``name``; ValueError naming ``where`` (a file or setting) for an unknown one."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"{where}: storage format {name!r} is not one of {sorted(FORMATS)}; a dataset of another "
                         "format needs the tapdraft release that wrote it")
    return fmt
