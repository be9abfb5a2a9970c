"""Finalize killed at every rename, then rerun: the dataset comes out identical to an uninterrupted one."""

import shutil
from pathlib import Path

import pytest

import tapdraft.common.atomic as atomic
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter
from tests.shards.synthetic import random_sample, tiny_bundle, tiny_layout

CFG = ShardConfig(shard_bytes=2500, batch_bytes=800)
SPLITS = {"train": [5, 8, 3, 9, 6, 4, 7, 5], "dev": [6, 4, 7]}
RANKS = 2


class Kill(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException, so no handler swallows it)."""


def _writers(root: Path, layout, fp: str) -> None:
    """Every (split, rank) writer opened and closed: a fresh capture, or a capture's rerun (nothing left to do)."""
    for split, lengths in SPLITS.items():
        for r in range(RANKS):
            w = DatasetWriter(str(root), CFG, layout, split=split, rank=r, fingerprint=fp, lineage=split)
            for i, T in enumerate(lengths[r::RANKS]):
                if not w.is_done(i):
                    w.write(random_sample(layout, T, 1000 * r + i, audio_frames=T // 4), i)
            w.close()


def _finalize(root: Path, layout, fp: str) -> dict:
    return finalize_dataset(str(root), layout=layout, fingerprint=fp, capture_config={"x": 1})


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def staged_capture(tmp_path_factory):
    """(directory with every rank closed but not finalized, layout, fingerprint, reference tree)."""
    base = tmp_path_factory.mktemp("fin")
    layout = tiny_layout()
    pre = base / "pre"
    fp = tiny_bundle(str(pre / "target"), layout)
    _writers(pre, layout, fp)
    ref = base / "ref"
    shutil.copytree(pre, ref)
    _finalize(ref, layout, fp)
    return pre, layout, fp, _tree(ref)


def _count_renames(pre: Path, layout, fp: str, tmp: Path, monkeypatch) -> int:
    calls = []
    real = atomic._rename
    monkeypatch.setattr(atomic, "_rename", lambda a, b: (calls.append(1), real(a, b)))
    work = tmp / "count"
    shutil.copytree(pre, work)
    _finalize(work, layout, fp)
    monkeypatch.setattr(atomic, "_rename", real)
    return len(calls)


def test_kill_at_every_finalize_rename_then_rerun_gives_the_same_dataset(staged_capture, tmp_path, monkeypatch):
    pre, layout, fp, ref = staged_capture
    n = _count_renames(pre, layout, fp, tmp_path, monkeypatch)
    shards = sum(1 for k in ref if k.startswith("data/"))
    assert n >= shards + RANKS * len(SPLITS) + 2  # every shard, every part, card and manifest
    real = atomic._rename
    for k in range(n):
        work = tmp_path / f"k{k}"
        shutil.copytree(pre, work)
        calls = []

        def dying(a, b):
            calls.append(1)
            if len(calls) == k + 1:
                raise Kill(f"killed before rename {k}")
            real(a, b)

        monkeypatch.setattr(atomic, "_rename", dying)
        with pytest.raises(Kill):
            _finalize(work, layout, fp)
        monkeypatch.setattr(atomic, "_rename", real)
        _writers(work, layout, fp)  # the capture's rerun: writers reopen (and clean leftovers), then finalize
        _finalize(work, layout, fp)
        got = _tree(work)
        assert got.keys() == ref.keys(), f"kill before rename {k}: files differ"
        assert all(got[f] == ref[f] for f in ref), f"kill before rename {k}: contents differ"
    assert len(list(open_dataset(str(work)).stream("train", seed=0, shuffle=False))) == len(SPLITS["train"])
