"""The package layout (tests/layout_guard.py holds the rules): no import circle anywhere, none between the rooms of a
package, every import along capture -> shards <- train (speculate above capture and train, engines above speculate,
demo above them, benchmarks and cli on top, common below them all), shards and common importing no model code, and
each drafter family, storage format, capture engine and taps codec named only in its home.

Each rule runs twice: on the tree, where it must find nothing, and on a copy of the files it reads with one
violation planted, where it must report exactly that, so no rule can pass by seeing nothing."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests import layout_guard as guard

ROOT = Path(__file__).resolve().parents[1]


def _copy(dst: Path, *patterns: str) -> Path:
    """The files of ``patterns`` (globs relative to the repository) copied to the same places under ``dst``."""
    for pattern in patterns:
        files = sorted(ROOT.glob(pattern))
        assert files, f"{pattern} matches nothing in the tree"
        for f in files:
            (dst / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst / f.relative_to(ROOT))
    return dst


def _plant(root: Path, rel: str, text: str) -> None:
    """Append ``text`` to ``root/rel`` (created when missing)."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((path.read_text() if path.is_file() else "") + text)


# ------------------------------------------------------------------------------------------ the tree
def test_no_import_circle_anywhere():
    assert not guard.import_cycles(ROOT)


def test_no_circle_between_the_rooms_of_a_package():
    assert not guard.room_cycles(ROOT)


def test_imports_run_one_way():
    assert set(guard.ALLOWED) == {*guard.PACKAGES, "cli"}
    assert not guard.upward_imports(ROOT)


def test_every_package_is_in_the_graph():
    tops = {m.split(".")[0] for m in guard.graph(ROOT)}
    assert tops == {*guard.PACKAGES, "cli"}
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} <= set(guard.PACKAGES)


def test_every_import_uses_the_installed_name():
    assert not guard.bare_imports(ROOT)


def test_the_tapdraft_package_links_every_installed_folder():
    """tapdraft/NAME is a relative link to the top-level NAME, for each installed name and nothing else: the one
    namespace a checkout, a worktree and a wheel import alike."""
    pkg = ROOT / "tapdraft"
    links = {p.name.removesuffix(".py") for p in pkg.iterdir() if p.is_symlink()}
    assert links == set(guard.INSTALLED)
    for name in guard.INSTALLED:
        link = pkg / (name + ".py" if name == "cli" else name)
        assert not Path(link.readlink()).is_absolute() and link.resolve() == (ROOT / link.name).resolve()


def test_guard_sees_a_planted_bare_import(tmp_path):
    root = _copy(tmp_path, "shards/__init__.py", "shards/taps.py", "tests/conftest.py")
    assert not guard.bare_imports(root)
    _plant(root, "shards/taps.py", "\n\ndef _late():\n    import common.progress\n")
    _plant(root, "tests/conftest.py", "\nfrom capture.inputs import read_inputs\n")
    found = guard.bare_imports(root)
    assert len(found) == 2 and found[0].startswith("shards/taps.py:") and found[0].endswith("imports common.progress")
    assert found[1].startswith("tests/conftest.py:") and found[1].endswith("imports capture.inputs")


def test_shards_imports_no_model_code():
    assert not guard.shards_model_code(ROOT)


def test_target_code_lives_only_under_capture_targets():
    assert {"capture.targets.base", "capture.targets.load", "capture.targets.causal_lm"} <= set(guard.modules(ROOT))
    assert not guard.target_code_outside_targets(ROOT)


def test_family_folders_are_the_registry():
    assert not guard.family_folders(ROOT)


def test_family_code_lives_in_its_folder():
    assert not guard.family_outside_folder(ROOT)


def test_storage_formats_are_named_only_in_shards_formats():
    assert not guard.format_outside_home(ROOT)


def test_capture_engines_are_branched_on_only_in_their_registry():
    assert not guard.engine_outside_registry(ROOT)


def test_taps_codecs_are_branched_on_only_in_their_table():
    assert not guard.codec_outside_home(ROOT)


def test_peer_code_still_names_families():
    """Each ``PEER_CODE`` file exists and branches on a family: an exemption that no longer does is removed."""
    families = set(guard.families(ROOT))
    for rel in guard.PEER_CODE:
        assert guard.compared(ast.parse((ROOT / rel).read_text()), families), f"{rel} no longer needs its exemption"


# ------------------------------------------------------------------------------------------ the parts
def test_cycle_finder_sees_lazy_and_indirect_circles(tmp_path):
    assert guard.find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert guard.find_cycles({"a": {"b"}, "b": set()}) == []
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from shards import writer\n    import capture.load\n")
    assert guard.imports_of(probe, {"shards.writer"}) >= {"shards", "shards.writer", "capture.load"}


def test_relative_imports_resolve_against_their_package(tmp_path):
    probe = tmp_path / "side.py"
    probe.write_text("from . import wire\nfrom .worker import prompts\nfrom .. import engine\n"
                     "def f():\n    from ..side import generate\n")
    known = {"capture.vllm.side.wire", "capture.vllm.engine", "capture.vllm.side.generate"}
    got = guard.imports_of(probe, known, "capture.vllm.side.probe")
    assert {"capture.vllm.side.wire", "capture.vllm.side.worker", "capture.vllm.engine",
            "capture.vllm.side.generate"} <= got
    init = tmp_path / "__init__.py"
    init.write_text("from .wire import send\n")
    assert "capture.vllm.side.wire" in guard.imports_of(init, set(), "capture.vllm.side")


def test_names_are_told_from_branches():
    tree = ast.parse('"""Mentions arrow in prose."""\n'
                     'a = f(codec="fp8")\n'
                     'b = cfg.codec == "fp8"\n'
                     'c = x in ("bf16", "fp8")\n'
                     'match x:\n    case "fp8":\n        pass\n')
    assert sorted(guard.named(tree, {"fp8", "arrow"})) == [2, 3, 4, 6]  # a docstring that mentions one is not a name
    assert sorted(guard.compared(tree, {"fp8"})) == [3, 4, 6]  # a value passed on is not a branch
    test = ast.parse('assert x == "fp8"\ny = 1 if x == "fp8" else 2\nif x in ("fp8",):\n    pass\n'
                     'while x != "fp8":\n    pass\n')
    assert guard.branched(test, {"fp8"}) == [2, 3, 5]  # what a test asserts is not a branch
    two = ast.parse('if mod in ("fp8",):\n    pass\nif cfg.codec == "fp8":\n    pass\n')
    assert guard.branched(two, {"fp8"}, "codec") == [3]  # a module name that is also a codec's is not one


# ------------------------------------------------------------------------------------------ planted violations
def test_guard_sees_a_planted_relative_import_circle(tmp_path):
    root = _copy(tmp_path, "capture/__init__.py", "capture/vllm/__init__.py", "capture/vllm/side/*.py")
    assert not guard.import_cycles(root)
    _plant(root, "capture/vllm/side/wire.py", "\n\ndef _late():\n    from .worker import build_llm\n")
    assert any("capture.vllm.side.wire" in c and "capture.vllm.side.worker" in c for c in guard.import_cycles(root))


def test_guard_sees_a_planted_circle_between_rooms(tmp_path):
    """config -> replies/ while replies/ -> config: no module imports itself back, yet the rooms have no order."""
    root = _copy(tmp_path, "capture/__init__.py", "capture/config.py", "capture/replies/__init__.py",
                 "capture/replies/regenerate.py", "capture/replies/windows.py")
    assert not guard.room_cycles(root)
    _plant(root, "capture/config.py", "\nfrom tapdraft.capture.replies.windows import RunStats\n")
    assert not guard.import_cycles(root)
    assert "capture.config -> capture.replies.windows" in guard.room_cycles(root)


def test_guard_sees_a_planted_upward_import(tmp_path):
    root = _copy(tmp_path, "shards/__init__.py", "shards/taps.py", "capture/__init__.py", "capture/engines.py",
                 "common/__init__.py", "common/progress.py")
    assert not guard.upward_imports(root) and not guard.shards_model_code(root)
    _plant(root, "shards/taps.py", "\n\ndef _late():\n    from tapdraft.capture.engines import ENGINES\n")
    _plant(root, "common/progress.py", "\n\ndef _late():\n    from tapdraft.shards.taps import default_tap_ids\n"
                                       "    import torch.nn\n")
    assert guard.upward_imports(root) == ["common.progress -> shards.taps", "shards.taps -> capture.engines"]
    assert {"shards.taps -> capture.engines", "common.progress -> torch.nn"} <= set(guard.shards_model_code(root))


def test_guard_sees_target_code_outside_capture_targets(tmp_path):
    root = _copy(tmp_path, "capture/__init__.py", "capture/targets/*.py")
    assert not guard.target_code_outside_targets(root)
    _plant(root, "capture/planted.py", "from tapdraft.capture.targets.causal_lm import CausalLMTarget\n\n\n"
                                       "class MyTarget(CausalLMTarget):\n    pass\n")
    assert sorted(guard.target_code_outside_targets(root)) == [
        "capture.planted -> capture.targets.causal_lm", "capture.planted: class MyTarget(CausalLMTarget)"]


def test_guard_sees_a_family_outside_its_folder(tmp_path):
    root = _copy(tmp_path, "train/drafters/__init__.py", "train/drafters/*/*.py")
    assert not guard.family_folders(root) and not guard.family_outside_folder(root)
    _plant(root, "capture/planted.py", 'def pick(family):\n    if family == "dflash":\n        return 1\n')
    _plant(root, "benchmarks/planted.py", 'ROWS = {"ce": "dflash"}\n\n\ndef pick(row):\n'
                                          '    return row.family == "eagle3"\n')
    assert sorted(guard.family_outside_folder(root)) == ["benchmarks/planted.py:5 names a drafter family",
                                                         "capture/planted.py:2 names a drafter family"]
    _plant(root, "train/drafters/scratch/__init__.py", "")
    assert guard.family_folders(root) == ["train/drafters/scratch/ is no FAMILIES entry"]


def test_guard_sees_a_family_folder_without_its_role_files(tmp_path):
    root = _copy(tmp_path, "train/drafters/__init__.py", "train/drafters/*/*.py")
    assert not guard.family_folders(root)
    (root / "train/drafters/dspark/config.py").unlink()
    (root / "train/drafters/mtp/export.py").rename(root / "train/drafters/mtp/layouts.py")
    assert guard.family_folders(root) == [
        "train/drafters/dspark/ has no config.py",
        "train/drafters/mtp/layouts.py holds a role under another name (config, model, loss, export)"]


def test_guard_sees_a_storage_format_outside_shards_formats(tmp_path):
    root = _copy(tmp_path, "shards/formats/*.py")
    assert not guard.format_outside_home(root)
    _plant(root, "train/planted.py", 'def read(cfg):\n    """Reads arrow or wds."""\n    return cfg.format == "wds"\n')
    assert guard.format_outside_home(root) == ["train/planted.py:3 names a storage format"]


def test_guard_sees_an_engine_branch_outside_the_registry(tmp_path):
    root = _copy(tmp_path, "capture/engines.py", "capture/vllm/*.py")
    assert not guard.engine_outside_registry(root)  # the registry and vLLM's own folder may name it
    _plant(root, "cli.py", 'def settings(engine, n):\n    return {"n": n} if engine == "vllm" else None\n')
    _plant(root, "capture/planted.py", 'def load(cfg):\n    return dict(engine="vllm")\n')  # a value: not a branch
    assert guard.engine_outside_registry(root) == ["cli.py:2 branches on a capture engine"]
    _plant(root, "tests/engines/test_planted.py", 'def cfg(engine):\n    return None if engine == "transformers" else 1\n')
    assert guard.engine_outside_registry(root) == ["cli.py:2 branches on a capture engine",
                                                   "tests/engines/test_planted.py:2 branches on a capture engine"]


def test_guard_sees_a_codec_branch_outside_its_table(tmp_path):
    root = _copy(tmp_path, "shards/taps.py", "shards/codec.py")
    assert guard.compared(ast.parse((root / "shards/codec.py").read_text()), {"fp8"})  # the byte layout's own
    assert not guard.codec_outside_home(root)
    _plant(root, "shards/planted.py", 'def lossy(layout):\n    return layout.taps_codec != "bf16"\n')
    assert guard.codec_outside_home(root) == ["shards/planted.py:2 branches on a taps codec"]


@pytest.mark.parametrize("check", [guard.engine_outside_registry, guard.codec_outside_home, guard.family_folders])
def test_a_missing_registry_fails_loudly(tmp_path, check):
    with pytest.raises((AssertionError, FileNotFoundError, StopIteration)):
        check(tmp_path)
