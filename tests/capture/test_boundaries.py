"""capture/ depends on shards/ (the format) and never on train/; it never reaches into shards' file internals."""

from __future__ import annotations

import ast
from pathlib import Path

CAPTURE = Path(__file__).resolve().parents[2] / "capture"
ALLOWED_SHARDS = {"shards.bundle", "shards.schema", "shards.taps", "shards.writer"}


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


def test_capture_imports_only_the_public_shards_modules():
    files = sorted(CAPTURE.glob("*.py"))
    assert files
    for f in files:
        mods = _imports(f)
        assert not any(m == "train" or m.startswith("train.") for m in mods), f
        bad = {m for m in mods if m.startswith("shards") and m not in ALLOWED_SHARDS}
        assert not bad, f"{f.name} imports {bad}"
        assert not any(m in ("pyarrow", "webdataset", "zstandard") for m in mods), f"{f.name} touches the file format"
