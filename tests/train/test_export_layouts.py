"""Each family declares its export layouts in its package (``LAYOUTS``, ``DEFAULT_LAYOUT``), which the CLI's
``--layout`` help is built from: the declaration is the drafter's own default, and a layout outside every
declaration is refused by the family's code."""

from __future__ import annotations

import pytest

from tapdraft.train.drafters import FAMILIES, export_layouts
from tapdraft.train.drafters.base import get_family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_declares_its_layouts_and_refuses_others(family):
    names, default = export_layouts()[family]
    _, drafter = get_family(family)
    assert drafter.default_layout == default
    assert default is None or default in names
    with pytest.raises(ValueError, match="layout"):
        drafter.export_layout({}, {"tapdraft": {"family": family}}, "no-such-layout")


def test_layout_help_names_every_declared_layout():
    from tapdraft.cli import _layout_help

    text = _layout_help()
    for family, (names, _) in export_layouts().items():
        assert all(n in text for n in names), (family, names)
        assert (family in text) == bool(names), family
