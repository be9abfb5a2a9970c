"""Dependencies run one way (capture -> shards <- train): shards/ imports neither, nor torch.nn."""

import ast
from pathlib import Path

SHARDS = Path(__file__).resolve().parents[2] / "shards"


def test_shards_imports_no_models_and_no_consumers():
    bad = []
    for path in sorted(SHARDS.rglob("*.py")):  # shards/formats/ too
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                if n.split(".")[0] in ("capture", "train", "transformers") or n.startswith("torch.nn"):
                    bad.append(f"{path.relative_to(SHARDS)}: {n}")
    assert len(list(SHARDS.glob("*.py"))) >= 10
    assert not bad, bad
