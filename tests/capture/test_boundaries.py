"""capture/ depends on shards/ (the format) and never on train/; capture/ and train/ never name the
dataset's files: they ask shards/ for paths and status through functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.layout_guard import local_name

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "capture"
ALLOWED_SHARDS = {"common.atomic", "shards.bundle", "common.errors", "shards.finalize", "shards.head", "common.lock",
                  "shards.manifest", "shards.order", "common.progress", "shards.schema", "shards.shard_file", "shards.taps",
                  "common.template", "shards.transfer", "shards.writer"}
# shards.writer, shards.shard_file (ShardConfig), shards.finalize: the writer's API, each name from its home
# shards.transfer: a capture into a URL stages locally and uploads through it (StagedUpload)
# shards.order: the one home of seed derivation (regenerate seeds each reply from it)
# common.lock: the one-writer lock, which regenerate holds on its output as capture and training do on theirs
DATASET_FILE = re.compile(
    r"(^|/)(manifest\.json|bundle\.json|weights\.safetensors|_parts|target/)"  # the directory's own files
    r"|\.arrow$|\.tar$|-of-\d|-rank\d"  # shard names
)


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {local_name(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(local_name(node.module))
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


def dataset_file_names(source: str) -> list[str]:
    """String constants in code (docstrings and error-message text aside) that name a dataset file or
    build a path with the bundle directory name ``"target"``."""
    tree = ast.parse(source)
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    messages = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Raise) for c in ast.walk(n)}
    messages |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs | messages:
            if DATASET_FILE.search(node.value):
                found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value == "target":
                    found.append(f"line {node.lineno}: / 'target'")
    return found


def test_the_name_check_catches_what_it_should():
    assert dataset_file_names('p = out / "manifest.json"')
    assert dataset_file_names('p = out / "target" / "x"')
    assert dataset_file_names('name = "data/train-00000-of-00001.arrow"')
    assert dataset_file_names('fp = json.load(open(root + "/target/bundle.json"))')
    assert not dataset_file_names('"""manifest.json is written last."""\nx = 1')
    assert not dataset_file_names('raise ValueError("manifest.json is missing")')
    assert not dataset_file_names('cfg = "capture_config.json"; t = cfg_target')


def test_capture_and_train_never_name_the_datasets_files():
    bad = []
    for pkg in ("capture", "train"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            bad += [f"{f.relative_to(ROOT)} {hit}" for hit in dataset_file_names(f.read_text())]
    assert not bad, "ask shards.manifest / shards.bundle for these paths:\n" + "\n".join(bad)
