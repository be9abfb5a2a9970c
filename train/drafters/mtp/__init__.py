"""MTP heads trained over a frozen target (model, head modules, loss, export layouts)."""
