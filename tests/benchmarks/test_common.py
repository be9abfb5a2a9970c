"""Every result file says which command produced it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_result_without_a_command_records_the_one_that_ran(tmp_path: Path) -> None:
    script = ("import benchmarks.common as c, pathlib; c.RESULTS = pathlib.Path(r'%s'); "
              "c.write_result('x.json', {'benchmark': 'x'}); "
              "c.write_result('y.json', {'benchmark': 'y', 'command': 'given'})" % tmp_path)
    runner = tmp_path / "runner.py"
    runner.write_text(script)
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(runner), "--flag", "3"], check=True, cwd=repo,
                   env={"PYTHONPATH": str(repo), "PATH": ""}, capture_output=True)
    assert json.loads((tmp_path / "x.json").read_text())["command"] == f"python {runner} --flag 3"
    assert json.loads((tmp_path / "y.json").read_text())["command"] == "given"
    assert "load_avg" in json.loads((tmp_path / "x.json").read_text())["machine"]
