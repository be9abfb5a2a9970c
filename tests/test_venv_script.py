"""engines/venv.sh, the one way an engine's venv is built: two callers at once build it once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_callers_at_once_build_one_venv_and_both_get_it(tmp_path):
    """Test processes and a benchmark may ask for the same venv together; without the lock the second deleted the
    venv the first was building. A toy spec (no packages) keeps it to a venv and a pip upgrade."""
    engines = tmp_path / "engines"
    engines.mkdir()
    shutil.copy(ROOT / "engines" / "venv.sh", engines / "venv.sh")
    (engines / "toy.txt").write_text("# no packages: the venv alone\n")
    cmd = ["bash", str(engines / "venv.sh"), "toy", "--root", str(tmp_path / "venvs")]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    venv = Path(paths.pop())
    assert (venv / ".complete").is_file() and (venv / "bin" / "python").exists()
    builds = sum(err.count("building the toy venv") for _, err in outs)
    assert builds == 1, [err for _, err in outs]
