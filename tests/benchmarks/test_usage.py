"""Every benchmark's usage, as ``--help`` prints it (its module docstring), keeps an example command's lines: a line
of a plain docstring that ends in one backslash is joined to the next by Python, so the command a user copies runs
together with the next one's flags."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def joined_lines(source: str) -> list[int]:
    """Line numbers in ``source`` where its module docstring (unless raw) ends a line with an odd run of backslashes."""
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(getattr(body[0], "value", None), ast.Constant):
        return []
    node = body[0].value
    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
    if lines[0].lstrip()[:1] in "rR":
        return []
    return [node.lineno + i for i, line in enumerate(lines[:-1])
            if (len(line) - len(line.rstrip("\\"))) % 2 == 1]


def test_no_benchmark_usage_joins_its_command_lines() -> None:
    found = {p.name: joined_lines(p.read_text()) for p in sorted(BENCHMARKS.glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_a_planted_lone_backslash_is_seen() -> None:
    planted = '"""Usage.\n\n    python -m x --a 1 \\\n        --b 2\n"""\n'
    assert joined_lines(planted) == [3]
    assert joined_lines(planted.replace("\\\n", "\\\\\n")) == []
    assert joined_lines("r" + planted) == []
