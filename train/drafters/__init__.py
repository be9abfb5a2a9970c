"""Drafter families, one folder each, found through ``base.FAMILIES`` (family name -> module path).

    base.py     the Drafter protocol, LossOutput and the loss-normalisation rule, the family registry
    common/     parts several families share: layers, masks, divergences, teacher rows, the fused loss,
                row chunks, the reduced draft vocabulary, chain alignment (MTP and EAGLE-3), export files
    dflash/ dflash2/ dspark/ eagle3/ lilicorr/ mtp/ mtp_native/   each family's model, config, loss, layouts

A family is known to the rest of the code only through its ``FAMILIES`` line: its module defines ``CONFIG`` and
``DRAFTER``, and the drafter class owns its export layouts.
"""
