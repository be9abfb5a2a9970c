"""Progress: plain periodic lines when not on a terminal (a log), nothing when disabled."""

import io
import re

from tapdraft.common.progress import Progress


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    with Progress("capture train", 5000, done=100, stream=out, every_s=0.0) as bar:
        bar.update(1200, "12.3 samples/s")
        bar.advance(300)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # two updates + the final line
    assert re.fullmatch(r"capture train: 1200/5000 \(24%\) 0:00:0\d 12\.3 samples/s", lines[0]), lines[0]
    assert lines[-1].startswith("capture train: 1500/5000 (30%)") and "\x1b" not in out.getvalue()


def test_plain_lines_are_periodic_and_disabled_is_silent():
    out = io.StringIO()
    with Progress("train", 10, stream=out, every_s=3600) as bar:
        for i in range(10):
            bar.update(i + 1)
    assert len(out.getvalue().splitlines()) == 1  # only the closing line
    assert out.getvalue().startswith("train: 10/10 (100%)")
    quiet = io.StringIO()
    with Progress("train", 10, stream=quiet, every_s=0.0, enabled=False) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""
