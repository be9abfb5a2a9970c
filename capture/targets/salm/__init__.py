"""tapdraft's own SALM: the model directory (model) and its adapter (target)."""
