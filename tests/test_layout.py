"""The package layout: no import circle anywhere (lazy, function-level imports included) and every
import runs along capture -> shards <- train, with speculate above capture and train, demo above all,
cli on top, and shards importing no model code."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tapdraft", "capture", "shards", "train", "speculate", "demo")
ALLOWED = {  # package -> project packages it may import
    "tapdraft": {"shards"},  # the public entry point: a re-export of shards.reader
    "shards": set(),
    "capture": {"shards"},
    "train": {"shards"},
    "speculate": {"capture", "shards", "train"},
    "demo": {"capture", "shards", "train", "speculate"},
    "cli": {"capture", "shards", "train", "speculate", "demo"},
}
MODEL_CODE = ("transformers", "torch.nn", "capture", "train")


def _modules() -> dict[str, Path]:
    mods = {"cli": ROOT / "cli.py"}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every module (project or not) that ``path`` imports anywhere in its body, lazy imports included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in imports_of(f, known) if i in known} for m, f in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_lazy_and_indirect_circles(tmp_path):
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from shards import writer\n    import capture.load\n")
    assert imports_of(probe, {"shards.writer"}) >= {"shards", "shards.writer", "capture.load"}


def test_no_import_circle_anywhere():
    assert not find_cycles(_graph())


def test_imports_run_one_way():
    bad = []
    for mod, deps in _graph().items():
        top = mod.split(".")[0]
        for d in deps:
            dtop = d.split(".")[0]
            if dtop != top and dtop not in ALLOWED[top]:
                bad.append(f"{mod} -> {d}")
    assert not bad, bad


def test_shards_imports_no_model_code():
    bad = []
    for mod, f in _modules().items():
        if mod.split(".")[0] == "shards":
            bad += [f"{mod} -> {i}" for i in imports_of(f, set()) if i.startswith(MODEL_CODE)]
    assert not bad, bad


def test_storage_formats_are_named_only_in_shards_formats(tmp_path):
    """A format is known through its registry entry (shards.formats.FORMATS): no "arrow" / "wds" string outside
    shards/formats/ but the CLI's --format option, so a new format is one module, not edits in many files."""
    names = {"arrow", "wds"}

    def named(path: Path) -> list[int]:
        return [n.lineno for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Constant) and n.value in names]

    probe = tmp_path / "probe.py"
    probe.write_text('def f(cfg):\n    """Mentions arrow in prose."""\n    return cfg.format == "wds"\n')
    assert named(probe) == [3]  # the check sees a comparison, not a docstring
    bad = [f"{f.relative_to(ROOT)}:{line}" for mod, f in _modules().items()
           if mod != "cli" and not mod.startswith("shards.formats") for line in named(f)]
    assert not bad, f"storage format named outside shards/formats/ (ask the registry): {bad}"


def test_target_code_lives_only_under_capture_targets():
    """A target family is code under capture/targets/ alone: no Target subclass elsewhere in capture/, and the
    rest of capture/ reaches the families only through the interface (base) and the loader (load)."""
    mods = _modules()
    known = set(mods)
    assert {"capture.targets.base", "capture.targets.load", "capture.targets.causal_lm"} <= known
    bad = []
    for mod, f in mods.items():
        if mod.split(".")[0] != "capture" or mod.startswith("capture.targets"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                bad += [f"{mod}: class {node.name}({b})" for b in bases if b.endswith("Target")]
        bad += [f"{mod} -> {i}" for i in imports_of(f, known)
                if i.startswith("capture.targets.") and i.split(".")[2] not in ("base", "load")]


def test_family_code_lives_in_its_folder():
    """A drafter family is one folder, ``train/drafters/<family>/``, known elsewhere only by its ``FAMILIES`` line:
    every folder there but ``common`` is a registered family; no train module outside the family folders imports
    one, names one (no ``if family == ...``, no default outside the registry) or carries its name as a file prefix."""
    base = ROOT / "train" / "drafters" / "base.py"
    registry = next(n.value for n in ast.walk(ast.parse(base.read_text()))
                    if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "FAMILIES")
    families = dict(ast.literal_eval(registry))
    folders = {p.name for p in (ROOT / "train" / "drafters").iterdir() if (p / "__init__.py").is_file()} - {"common"}
    assert folders == set(families), f"family folders {sorted(folders)} vs FAMILIES {sorted(families)}"
    assert all(mod.startswith(f"train.drafters.{name}.") for name, mod in families.items()), families
    bad = []
    for mod, f in _modules().items():
        parts = mod.split(".")
        if parts[0] != "train" or (len(parts) > 2 and parts[1] == "drafters" and parts[2] in families):
            continue
        if any(parts[-1].startswith(name) for name in families):
            bad.append(f"{mod}: a family's name as its file name")
        bad += [f"{mod} imports {i}" for i in imports_of(f, set()) if i.split(".")[:2] == ["train", "drafters"]
                and len(i.split(".")) > 2 and i.split(".")[2] in families]
        if f == base:
            continue
        bad += [f"{mod}:{n.lineno} names family {n.value!r}" for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.Constant) and n.value in families]
    assert not bad, bad
