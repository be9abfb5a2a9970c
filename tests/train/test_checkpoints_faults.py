"""A full disk or a read-only run directory while training or exporting is one ``error:`` line naming the file and
what to do (exit 2), however the library underneath reports it: torch's writer (``RuntimeError: ... unexpected
pos``, no errno), a file object's ``OSError`` without a path, safetensors' ``Os { code: 28 }``, TensorBoard's
bytes path."""

from __future__ import annotations

import errno
import io

import pytest
import torch

from tapdraft.cli import main
from dflash_fixtures import synthetic_samples, tiny_bundle, tiny_layout, write_synthetic_dataset
from tapdraft.common import atomic
from tapdraft.train import checkpoints

# a budget set by hand: no start line (train.fit), so a fault's stderr is its one line alone
TRAIN = ["--recipe", "dflash_b8", "--set", "max_steps=2", "--set", "max_tokens=160", "--set", "progress=false",
         "--set", "drafter.max_loss_rows=8192"]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds") / "ds"
    bundle = tiny_bundle(root)
    layout = tiny_layout(bundle)
    samples = synthetic_samples(bundle, layout, 8, min_len=16, max_len=24)
    return write_synthetic_dataset(root, bundle, layout, {"train": samples[:6], "validation": samples[6:]},
                                   regenerated=False)


def _one_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    return err[0]


class _FullFile(io.BufferedWriter):
    """A real file whose disk fills after its first bytes: ``write`` raises ENOSPC without a path, as CPython's
    buffered writer does."""

    def write(self, b):  # noqa: ANN001, ANN201
        raise OSError(errno.ENOSPC, "No space left on device")


def test_train_out_of_disk_in_torch_save_is_one_line(ds, tmp_path, capsys, monkeypatch):
    real_open = open
    monkeypatch.setattr(checkpoints, "open", lambda f, mode="r": _FullFile(real_open(f, mode, buffering=0)),
                        raising=False)
    run = tmp_path / "run"
    line = _one_line(capsys, ["train", "--data", ds, "--out", str(run), *TRAIN])
    assert f"no space left on the device writing {run}/checkpoints/step-" in line and "free space" in line, line
    assert [p for p in run.rglob("*") if p.name.endswith(atomic.TMP_SUFFIX)] == []


def test_torch_writers_own_error_is_asked_of_the_filesystem(tmp_path, monkeypatch):
    """torch.save given a path reports a full disk as ``unexpected pos`` with no errno: ``staged`` asks the
    filesystem, and names the destination; the same error on a disk with room stays a traceback (a bug)."""
    from tapdraft.common.errors import classify

    def torch_full(obj, f):  # noqa: ANN001, ANN202
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4416 vs 4310")

    monkeypatch.setattr(torch, "save", torch_full)
    ck = checkpoints.Checkpoint(step=3, draft={"w": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="unexpected pos") as e:  # this disk has room: not said to be full
        checkpoints.save_checkpoint(tmp_path, ck, keep=1)
    assert classify(e.value) is None
    monkeypatch.setattr(atomic, "_NEARLY_FULL", 1 << 62)  # every disk is nearly full
    with pytest.raises(OSError) as e:
        checkpoints.save_checkpoint(tmp_path, ck, keep=1)
    code, msg = classify(e.value)
    assert code == 2 and msg.startswith(f"no space left on the device writing {tmp_path}/checkpoints/step-0000003;")
    assert not (tmp_path / "checkpoints" / "step-0000003").exists()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []


def test_a_read_only_run_directory_is_one_line(ds, tmp_path, capsys, monkeypatch):
    def read_only(f, mode="r"):  # noqa: ANN001, ANN202
        raise OSError(errno.EROFS, "Read-only file system", str(f))

    monkeypatch.setattr(checkpoints, "open", read_only, raising=False)
    line = _one_line(capsys, ["train", "--data", ds, "--out", str(tmp_path / "run"), *TRAIN])
    assert "the filesystem is read-only writing " in line and "choose a writable location" in line, line


def test_tensorboards_full_disk_names_its_path_as_text(ds, tmp_path, capsys, monkeypatch):
    """TensorBoard's writer opens its event file by a bytes path: the line must not print ``b'...'``. It writes
    from a thread of its own, whose traceback (Python's default thread hook) must not print either."""
    import threading

    from tensorboard.compat.tensorflow_stub.io import gfile

    tracebacks = []
    monkeypatch.setattr(threading, "excepthook", lambda args: tracebacks.append(args.exc_value))
    class FullIO:
        def open(self, filename, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN201
            raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(gfile, "io", FullIO())
    run = tmp_path / "run"
    line = _one_line(capsys, ["train", "--data", ds, "--out", str(run), *TRAIN])
    assert f"no space left on the device writing {run}/tensorboard/events.out" in line and "b'" not in line, line
    assert tracebacks == []


def test_export_out_of_disk_in_safetensors_is_one_line(ds, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", ds, "--out", str(run), *TRAIN])
    assert e.value.code == 0
    capsys.readouterr()
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "exp"
    line = _one_line(capsys, ["export", "--draft", str(run), "--out", str(out)])
    assert f"no space left on the device writing {out}/model.safetensors" in line, line
