"""Drafter families, one folder each, found through ``FAMILIES`` here (family name -> module path).

    base.py     the Drafter protocol, LossOutput and the loss-normalisation rule, the family lookup
    common/     parts several families share: layers, masks, divergences, teacher rows, the fused loss,
                row chunks, the reduced draft vocabulary, chain alignment (MTP and EAGLE-3), export files
    dflash/ dflash2/ dspark/ eagle3/ lilicorr/ mtp/ mtp_native/   one folder per family, its files named by role:
                config.py (CONFIG's class) and model.py (the drafter) in each; loss.py, export.py where it has its own

A family is known to the rest of the code only through its ``FAMILIES`` line: its module defines ``CONFIG`` and
``DRAFTER``, and the drafter class owns its export layouts; the family's package (``__init__``) names those layouts
in ``LAYOUTS`` (and ``DEFAULT_LAYOUT`` when the default is one of them), so the CLI lists them without importing torch.
The registry lives here, not in base.py, for the same reason.
"""

from __future__ import annotations

import importlib

FAMILIES: dict[str, str] = {
    "dflash": "tapdraft.train.drafters.dflash.model",
    "dflash2": "tapdraft.train.drafters.dflash2.model",
    "mtp": "tapdraft.train.drafters.mtp.model",
    "eagle3": "tapdraft.train.drafters.eagle3.model",
    "mtp_native": "tapdraft.train.drafters.mtp_native.model",
    "dspark": "tapdraft.train.drafters.dspark.model",
    "lilicorr": "tapdraft.train.drafters.lilicorr.model",
}
"""Family name -> module defining ``CONFIG`` and ``DRAFTER``."""
DEFAULT_FAMILY = "dflash"
"""The family of a recipe or run config that names none."""


def export_layouts() -> dict[str, tuple[tuple[str, ...], str | None]]:
    """Family -> (the layouts ``export --layout`` takes for it, its default among them or None for the native
    layout), from each family's package, which imports nothing heavy."""
    out = {}
    for name, module in FAMILIES.items():
        pkg = importlib.import_module(module.rpartition(".")[0])
        out[name] = (tuple(pkg.LAYOUTS), getattr(pkg, "DEFAULT_LAYOUT", None))
    return out

