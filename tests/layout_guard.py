"""The package layout's rules as functions of a source root, so a test can run each on the real tree and on a
copy with one planted violation (tests/test_layout.py does both). Each check returns its violations as
``"file or module: what"`` strings; an empty list is a pass.

The rules: no import circle between modules (lazy and relative imports included); no circle between the rooms
of any package (its sub-modules and sub-folders: ``capture.config`` <-> ``capture.replies`` is one, even with no
module-level circle, since it leaves no order to read or build the rooms in); every arrow between packages runs
along ``ALLOWED``; shards/ imports no model code; a drafter family, a storage format, a capture engine and a taps
codec are named only in their homes: a family and a format not at all elsewhere in the library, an engine and a
codec in no comparison (their names are other things' too: vLLM the serving engine, bf16 a dtype); ``USERS``
(benchmarks, demo, engines, the CLI) may pass a name as a value but never branch on one.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Callable, Iterable

PACKAGES = ("tapdraft", "common", "capture", "shards", "train", "speculate", "engines", "demo", "benchmarks")
INSTALLED = ("common", "capture", "shards", "train", "speculate", "engines", "demo", "cli")
"""The folders (and cli.py) installed as ``tapdraft.NAME``: tapdraft/ holds a link to each, and code imports them by that
name alone (``bare_imports``). The graph below names a module by its folder (``capture.inputs``)."""
ALLOWED = {  # package -> project packages it may import
    "tapdraft": {"shards", "cli"},  # the public entry point (a re-export of shards.reader) and ``python -m tapdraft``
    "common": set(),  # errors, progress, atomic writes, locks, template settings: below everything
    "shards": {"common"},
    "capture": {"common", "shards"},
    "train": {"common", "shards"},
    "speculate": {"common", "capture", "shards", "train"},
    "engines": {"common", "capture", "shards", "train", "speculate"},  # serving runs a target and a draft
    "demo": {"common", "capture", "shards", "train", "speculate", "engines"},
    "benchmarks": {"common", "capture", "shards", "train", "speculate", "engines", "demo"},
    "cli": {"tapdraft", "common", "capture", "shards", "train", "speculate", "engines", "demo"},
}
MODEL_CODE = ("transformers", "torch.nn", "capture", "train")
BELOW_MODELS = ("common", "shards")
"""Packages that import no model code (``MODEL_CODE``): what a team reading a dataset installs and runs."""
USERS = ("cli", "benchmarks", "demo", "engines")
"""Where a name may be passed as a value (a flag's default, a measured configuration, the demo's choice, a peer's or
a serving engine's own name for a method), never branched on."""

PEER_CODE = ("benchmarks/peers.py", "engines/peers/modelopt_runner.py", "engines/vllm_plugin/tapdraft_vllm/candidate_heads.py")
"""Code that pairs a drafter family with a peer's of the same name (ModelOpt's ``dflash`` / ``dspark`` / ``eagle``
modes; the compared rows of benchmarks/peers.py; vLLM's DFlash2 and LiLiCorr heads the plugin steps): it names both by design, so the family rule leaves it
out (tests/test_layout.py checks that each still does, so the list cannot go stale)."""

FAMILY_REGISTRY = "train/drafters/__init__.py"
FORMAT_HOME = "shards.formats"
ENGINE_REGISTRY = "capture/engines.py"
CODEC_REGISTRY = "shards/taps.py"


# ------------------------------------------------------------------------------------------ the import graph
@functools.lru_cache(maxsize=None)
def _parsed(text: str) -> ast.Module:
    return ast.parse(text)


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree (parsed once per content: every rule walks the same files)."""
    return _parsed(path.read_text())


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for cli.py and every package present under ``root`` (tapdraft/'s links to the other
    folders are not walked: those files are counted where they live)."""
    mods = {"cli": root / "cli.py"} if (root / "cli.py").is_file() else {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else []:
            if any(p.is_symlink() for p in [f, *f.relative_to(root).parents][:-1] if (root / p).is_symlink()):
                continue
            if "build" in f.relative_to(root).parts:  # a setuptools build's copy of the sources (.ci/wheel leaves one)
                continue
            parts = f.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def local_name(name: str) -> str:
    """``tapdraft.capture.inputs`` -> ``capture.inputs``, ``tapdraft.cli`` -> ``cli``: the graph's name of a module
    imported by its installed name; any other name as it is."""
    head, _, rest = name.partition(".")
    return rest if head == "tapdraft" and rest.split(".")[0] in INSTALLED else name


def imports_of(path: Path, known: set[str], module: str = "") -> set[str]:
    """Every module (project or not) that ``path`` (the module ``module``) imports anywhere in its body, lazy
    imports included, named as the graph names them (``local_name``); a relative import is resolved against
    ``module``'s package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out |= {local_name(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(local_name(name))
            out |= {local_name(f"{name}.{a.name}") for a in node.names if local_name(f"{name}.{a.name}") in known}
    return out


def bare_imports(root: Path) -> list[str]:
    """An absolute import of an installed folder by its own name (``import capture``, ``from shards.x import y``) in
    the project's code or tests: installed, only ``tapdraft.capture`` exists, and in a checkout the bare name would
    load a second copy of the same module. (capture/vllm/side/ runs in vLLM's interpreter under a private name and
    imports itself relatively.)"""
    tests = sorted((root / "tests").rglob("*.py")) if (root / "tests").is_dir() else []
    bad = []
    for f in [*modules(root).values(), *tests]:
        for node in ast.walk(parse(f)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{f.relative_to(root)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in INSTALLED]
    return bad


def graph(root: Path) -> dict[str, set[str]]:
    """Project module -> the project modules it imports."""
    mods = modules(root)
    known = set(mods)
    return {m: {i for i in imports_of(f, known, m) if i in known} for m, f in mods.items()}


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
            if len(comp) > 1 or v in g.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def import_cycles(root: Path) -> list[str]:
    """Module-level import circles."""
    return [" <-> ".join(c) for c in find_cycles(graph(root))]


def room_cycles(root: Path) -> list[str]:
    """Arrows that close a circle between the rooms of one package (its direct sub-modules and sub-folders):
    each is an upward arrow, whichever of the circle's arrows one calls up."""
    g = graph(root)
    mods = modules(root)
    bad = []
    for pkg in sorted(m for m, f in mods.items() if f.name == "__init__.py"):
        depth = pkg.count(".") + 2

        def room(m: str) -> str:
            return ".".join(m.split(".")[:depth])

        rooms: dict[str, set[str]] = {}
        arrows: dict[tuple[str, str], list[str]] = {}
        for m, deps in g.items():
            if not m.startswith(pkg + "."):
                continue
            for d in deps:
                if d.startswith(pkg + ".") and room(d) != room(m):
                    rooms.setdefault(room(m), set()).add(room(d))
                    arrows.setdefault((room(m), room(d)), []).append(f"{m} -> {d}")
        for comp in find_cycles(rooms):
            bad += [a for (src, dst), lst in sorted(arrows.items()) if src in comp and dst in comp for a in lst]
    return bad


def upward_imports(root: Path) -> list[str]:
    """Arrows between packages that ``ALLOWED`` does not list."""
    bad = []
    for mod, deps in graph(root).items():
        top = mod.split(".")[0]
        bad += [f"{mod} -> {d}" for d in sorted(deps)
                if d.split(".")[0] != top and d.split(".")[0] not in ALLOWED[top]]
    return bad


def shards_model_code(root: Path) -> list[str]:
    """shards/ or common/ (``BELOW_MODELS``) importing a model library or model code."""
    return [f"{mod} -> {i}" for mod, f in modules(root).items() if mod.split(".")[0] in BELOW_MODELS
            for i in sorted(imports_of(f, set(), mod)) if i.startswith(MODEL_CODE)]


def target_code_outside_targets(root: Path) -> list[str]:
    """A Target subclass in capture/ outside capture/targets/, or a target family's module imported there (the rest
    of capture/ reaches the families only through the interface, base, and the loader, load)."""
    mods = modules(root)
    known = set(mods)
    bad = []
    for mod, f in mods.items():
        if mod.split(".")[0] != "capture" or mod.startswith("capture.targets"):
            continue
        for node in ast.walk(parse(f)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                bad += [f"{mod}: class {node.name}({b})" for b in bases if b.endswith("Target")]
        bad += [f"{mod} -> {i}" for i in sorted(imports_of(f, known, mod))
                if i.startswith("capture.targets.") and i.split(".")[2] not in ("base", "load")]
    return bad


# ------------------------------------------------------------------------------------------ names and their homes
def named(tree: ast.AST, names: Iterable[str]) -> list[int]:
    """Lines where a string constant is exactly one of ``names`` (a docstring that mentions one is not)."""
    names = set(names)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]


def compared(tree: ast.AST, names: Iterable[str]) -> list[int]:
    """Lines where one of ``names`` is an operand of a comparison (``x == "a"``, ``x in ("a", "b")``) or a
    ``match`` case: a branch on the name."""
    names = set(names)
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            operands = [n.left, *n.comparators]
            for o in list(operands):
                if isinstance(o, (ast.Tuple, ast.List, ast.Set)):
                    operands += o.elts
            if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                lines.append(n.lineno)
        elif isinstance(n, ast.MatchValue) and isinstance(n.value, ast.Constant) and n.value.value in names:
            lines.append(n.lineno)
    return lines


def branched(tree: ast.AST, names: Iterable[str], subject: str = "") -> list[int]:
    """Lines where one of ``names`` is compared in the condition of an ``if`` (statement or expression) or a
    ``while``, or is a ``match`` case: ``compared`` less the comparisons a test asserts. With ``subject``, only
    comparisons of something so named (``engine == "vllm"``, ``cfg.engine != ...``; "transformers" is also a
    library a test may compare a module name with)."""
    names = set(names)
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.IfExp, ast.While)):
            lines += [c.lineno for c in ast.walk(n.test) if isinstance(c, ast.Compare) and compared(c, names)
                      and (not subject or any(ast.unparse(o).endswith(subject) for o in [c.left, *c.comparators]))]
        elif isinstance(n, ast.MatchValue) and isinstance(n.value, ast.Constant) and n.value.value in names:
            lines.append(n.lineno)
    return sorted(set(lines))


def _scan(root: Path, names: set[str], home: Callable[[str, Path], bool],
          check: Callable[[ast.AST, set[str]], list[int]], what: str) -> list[str]:
    """``check`` over every module outside ``home`` (users get ``compared`` whatever ``check`` is)."""
    bad = []
    for mod, f in modules(root).items():
        if home(mod, f):
            continue
        rule = compared if mod.split(".")[0] in USERS else check
        bad += [f"{f.relative_to(root)}:{line} {what}" for line in rule(parse(f), names)]
    return bad


def _registry_keys(path: Path, name: str) -> set[str]:
    """The string keys of the dict literal assigned to ``name`` at the top of ``path``."""
    for n in parse(path).body:
        target = n.target if isinstance(n, ast.AnnAssign) else (n.targets[0] if isinstance(n, ast.Assign) else None)
        if getattr(target, "id", "") == name and isinstance(n.value, ast.Dict):
            return {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{path} holds no dict literal {name}")


def families(root: Path) -> dict[str, str]:
    base = root / FAMILY_REGISTRY
    registry = next(n.value for n in ast.walk(parse(base))
                    if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "FAMILIES")
    return dict(ast.literal_eval(registry))


FAMILY_FILES = ("config.py", "model.py")
"""What every family folder holds under these names: its settings (the ``CONFIG`` class) and its drafter (the
``FAMILIES`` module); a family's own loss and export layouts, where it has them, are ``loss.py`` and ``export.py``."""
ROLE_ALIASES = ("layouts.py", "losses.py", "configs.py", "settings.py", "exports.py", "speculators.py")
"""Names a role file has gone by: refused in a family folder, so a role has one file name everywhere."""


def family_folders(root: Path) -> list[str]:
    """Every folder in train/drafters/ but common is a registered family whose module is its ``model.py``, beside a
    ``config.py``, with no role file under another name."""
    fams = families(root)
    drafters = root / "train" / "drafters"
    folders = {p.name for p in drafters.iterdir() if (p / "__init__.py").is_file()} - {"common"}
    bad = [f"train/drafters/{f}/ is no FAMILIES entry" for f in sorted(folders - set(fams))]
    bad += [f"FAMILIES[{f!r}] has no folder" for f in sorted(set(fams) - folders)]
    bad += [f"FAMILIES[{n!r}] = {m} is not its folder's model.py" for n, m in fams.items()
            if m != f"tapdraft.train.drafters.{n}.model"]
    for f in sorted(folders & set(fams)):
        bad += [f"train/drafters/{f}/ has no {name}" for name in FAMILY_FILES if not (drafters / f / name).is_file()]
        bad += [f"train/drafters/{f}/{name} holds a role under another name (config, model, loss, export)"
                for name in ROLE_ALIASES if (drafters / f / name).is_file()]
    return bad


def family_outside_folder(root: Path) -> list[str]:
    """A family named, imported or used as a train/ file-name prefix outside its folder and the registry (users:
    branched on), but for ``PEER_CODE``."""
    fams = families(root)

    def home(mod: str, f: Path) -> bool:
        parts = mod.split(".")
        in_folder = parts[:2] == ["train", "drafters"] and len(parts) > 2 and parts[2] in fams
        return in_folder or f == root / FAMILY_REGISTRY or str(f.relative_to(root)) in PEER_CODE

    bad = _scan(root, set(fams), home, named, "names a drafter family")
    for mod, f in modules(root).items():
        if home(mod, f) or mod.split(".")[0] in USERS:
            continue
        if mod.split(".")[0] == "train" and any(mod.split(".")[-1].startswith(n) for n in fams):
            bad.append(f"{mod}: a family's name as its file name")
        bad += [f"{mod} imports {i}" for i in sorted(imports_of(f, set(), mod))
                if i.split(".")[:2] == ["train", "drafters"] and len(i.split(".")) > 2 and i.split(".")[2] in fams]
    return bad


def format_outside_home(root: Path) -> list[str]:
    """A storage format named outside shards/formats/ (each format module's ``NAME``, gathered in ``FORMATS``)."""
    names = {n.value.value for f in sorted((root / "shards" / "formats").glob("*.py"))
             for n in parse(f).body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and [getattr(t, "id", "") for t in n.targets] == ["NAME"]}
    assert names, "shards/formats/ declares no format NAME"
    return _scan(root, names, lambda mod, f: mod.startswith(FORMAT_HOME), named, "names a storage format")


def engine_outside_registry(root: Path) -> list[str]:
    """A branch on a capture engine's name outside its registry (``ENGINES``) and its own folder (capture/vllm/),
    tests included (``branched``: a test may assert what a record names, and picks an engine's settings from its
    entry as the library does)."""
    names = _registry_keys(root / ENGINE_REGISTRY, "ENGINES")
    reg = root / ENGINE_REGISTRY
    bad = _scan(root, names, lambda mod, f: f == reg or mod.startswith("capture.vllm"), compared,
                "branches on a capture engine")
    tests = sorted((root / "tests").rglob("*.py")) if (root / "tests").is_dir() else []
    return bad + [f"{f.relative_to(root)}:{line} branches on a capture engine" for f in tests
                  for line in branched(parse(f), names, "engine")]


def codec_outside_home(root: Path) -> list[str]:
    """A branch on a taps codec's name outside its table (``TAPS_CODECS``) and the byte layout (shards/codec.py)."""
    names = _registry_keys(root / CODEC_REGISTRY, "TAPS_CODECS")
    homes = {root / CODEC_REGISTRY, root / "shards" / "codec.py"}
    return _scan(root, names, lambda mod, f: f in homes, compared, "branches on a taps codec")
