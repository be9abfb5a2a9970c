"""What the wheel holds: the ``tapdraft`` namespace alone at the top level, and only files the project tracks, so a
demo workdir, a run or an export left in the checkout can never ship (``.ci/wheel`` installs the built wheel into a
fresh venv and runs the demo outside the checkout).

The wheel is built from a copy of the tracked files (the checkout is never written to) with strays planted the way a
user leaves them: the README's demo output, a run inside a package folder. ``unexpected`` names what should not be
there; it is seen to fail on a planted top-level package and on package data that takes a stray file in."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.layout_guard import INSTALLED

ROOT = Path(__file__).resolve().parents[1]
STRAYS = ("demo_work/export/dflash/modeling_dflash.py", "demo_work/target/config.json",
          "train/runs/dflash/checkpoint.pt", "demo/real/demo_real_quick/exports/mtp/config.json")
"""Files a user's runs leave in a checkout (the first is what an earlier wheel shipped)."""


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def copy_tree(dst: Path, strays: tuple[str, ...] = STRAYS) -> Path:
    """The tracked files (links kept as links) under ``dst``, plus ``strays``."""
    for rel in tracked():
        src, out = ROOT / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(src.readlink())
        elif src.is_file():
            shutil.copy2(src, out)
    for rel in strays:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text("{}\n")
    return dst


def build_wheel(src: Path, out: Path) -> list[str]:
    """``pip wheel`` of ``src`` (no dependencies, this environment's setuptools); the wheel's file names."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    (wheel,) = out.glob("tapdraft-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def unexpected(names: list[str], files: set[str]) -> list[str]:
    """Wheel entries that are neither the dist-info nor a tracked file of an installed folder under ``tapdraft/``
    (``files``: the tracked paths, relative to the repository)."""
    bad = []
    for name in names:
        top, _, rest = name.partition("/")
        if top.endswith(".dist-info"):
            continue
        if top != "tapdraft":
            bad.append(f"{name}: a top-level name other than tapdraft")
            continue
        installed = rest.split("/")[0].removesuffix(".py") in INSTALLED  # tapdraft/capture/x.py is capture/x.py
        if (rest if installed else name) not in files:
            bad.append(f"{name}: not a file the project tracks")
    return bad


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_tree(d / "src"), d / "dist")


@pytest.mark.slow
def test_the_wheel_holds_the_tapdraft_namespace_and_tracked_files_only(wheel):
    assert not unexpected(wheel, set(tracked()))
    tops = {n.split("/")[0] for n in wheel if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tapdraft"}
    for needed in ("tapdraft/__init__.py", "tapdraft/cli.py", "tapdraft/capture/inputs.py",
                   "tapdraft/train/recipes/dflash_small.yaml", "tapdraft/engines/venv.sh", "tapdraft/engines/vllm.txt",
                   "tapdraft/engines/vllm_plugin/tapdraft_vllm/__init__.py",
                   "tapdraft/train/drafters/dflash/serving/modeling_dflash.py"):
        assert needed in wheel, f"{needed} missing from the wheel"
    assert not any("tapdraft/tests" in n or "benchmarks" in n or "demo_work" in n for n in wheel)
    entry = next(n for n in wheel if n.endswith("entry_points.txt"))
    assert entry


@pytest.mark.slow
def test_the_check_sees_a_planted_top_level_package_and_a_stray_file(tmp_path):
    src = copy_tree(tmp_path / "src")
    (src / "stray").mkdir()
    (src / "stray" / "__init__.py").write_text("")
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    text = text.replace('include = ["tapdraft", "tapdraft.*"]', 'include = ["tapdraft", "tapdraft.*", "stray"]')
    text = text.replace('"tapdraft.train" = ["recipes/*.yaml"', '"tapdraft.train" = ["runs/**/*", "recipes/*.yaml"')
    pyproject.write_text(text)
    bad = unexpected(build_wheel(src, tmp_path / "dist"), set(tracked()))
    assert "stray/__init__.py: a top-level name other than tapdraft" in bad
    assert "tapdraft/train/runs/dflash/checkpoint.pt: not a file the project tracks" in bad
