"""The command line's face: help for every command, and user errors as one line with exit code 2."""

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "capture", "inspect", "verify", "train", "eval", "export", "speculate")


def test_every_command_has_help():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0
    for name in COMMANDS:
        assert name in top.output
        res = runner.invoke(app, [name, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output, name


def test_user_error_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "cli.py", "train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "manifest.json not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written
