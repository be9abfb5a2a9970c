"""The demo's capture half, each step cached in a work directory.

:func:`prepare_demo` builds (or reuses)

    DIR/target/     the trained SALM (SALM.save_pretrained); reused when present
    DIR/data/       wav files + SPLIT.templated.jsonl (templated replies) and SPLIT.jsonl, written by
                    ``tapdraft regenerate`` from it: assistant turns are the TARGET'S OWN greedy replies
                    (``reference`` keeps the templated answer; empty or truncated replies are dropped and
                    counted in SPLIT.regenerate.json), so offline acceptance on this data is exact for
                    greedy decoding. The quick demo keeps truncated replies (its target barely trained).
    DIR/dataset/    the captured dataset (both splits)
    DIR/demo.json   what each step did (target training, data, capture) and which mode built it
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tapdraft.capture.config import CaptureConfig
from tapdraft.capture.generation import GenerationConfig, ReplyConfig
from tapdraft.capture.replies.regenerate import RegenerateConfig
from tapdraft.capture.replies.regenerate import regenerate as run_regenerate
from tapdraft.capture.targets.load import quiet_loading
from tapdraft.capture.targets.salm.model import SALM
from tapdraft.capture.targets.salm.target import SALMTarget
from tapdraft.demo.target import FULL, QUICK, DemoSize, build_demo_salm, train_demo_salm
from tapdraft.demo.task import SAMPLE_RATE, sample_example, tone_audio
from tapdraft.common.atomic import staged


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the body, the caller's count restored after: the demo's models are tiny (a
    1 M-parameter model gains little from more threads, and loses a lot on shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def open_workdir(workdir: str | Path, record: str, *, quick: bool, seed: int,
                 what: str) -> tuple[Path, Path, dict[str, Any]]:
    """Create ``workdir`` and read its JSON ``record`` of what each step did ({} when new), with ``quick`` and
    ``seed`` set; a workdir built at the other size is refused. Returns (root, record path, record)."""
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / record
    info: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if info and info.get("quick") != quick:
        raise ValueError(f"{root} holds a {'quick' if info.get('quick') else 'full'} {what}; use another --workdir")
    info.update(quick=quick, seed=seed)
    return root, path, info


def write_split(salm: SALM, target_dir: Path, data_dir: Path, split: str, n: int, *, seed: int, regenerate: bool,
                max_new_tokens: int = 32, keep_truncated: bool = False, progress: bool = True) -> dict[str, Any]:
    """Write n wav files + ``split.jsonl``: templated replies, rewritten by ``tapdraft regenerate`` (the
    target's greedy replies; empty or truncated ones dropped and counted) when ``regenerate``."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    (data_dir / "audio").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        digits, task, prompt, ref = sample_example(rng)
        wave = tone_audio(digits, rng)
        sid = f"{split}-{i:06d}"
        rel = f"audio/{sid}.wav"
        sf.write(data_dir / rel, wave, SAMPLE_RATE, subtype="PCM_16")
        rows.append({
            "id": sid,
            "conversations": [
                {"from": "User", "type": "audio", "value": rel, "duration": round(len(wave) / SAMPLE_RATE, 4)},
                {"from": "User", "type": "text", "value": prompt},
                {"from": "Assistant", "type": "text", "value": ref},
            ],
            "reference": ref, "task": task, "digits": digits,
        })
    path = data_dir / f"{split}.jsonl"
    templated = data_dir / f"{split}.templated.jsonl" if regenerate else path
    with staged(templated) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not regenerate:
        return {"samples": n, "target_matches_reference": None, "regenerated": False}
    doc = run_regenerate(RegenerateConfig(
        target=str(target_dir.resolve()), data=str(templated.resolve()), out=str(path.resolve()), progress=progress,
        replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=max_new_tokens), keep_truncated=keep_truncated),
    ), target=SALMTarget(salm, target_dir))
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    exact = sum(r["conversations"][-1]["value"] == r["reference"] for r in recs)
    return {"samples": len(recs), "dropped": doc["counts"]["dropped"],
            "target_matches_reference": round(exact / max(len(recs), 1), 4), "regenerated": True}


@dataclass
class DemoPaths:
    workdir: Path
    target: Path
    data: Path
    train_manifest: Path
    val_manifest: Path
    dataset: Path
    info: dict[str, Any]
    """What each step did, as kept in ``workdir/demo.json`` across runs."""

    def record(self, key: str, value: Any) -> None:
        """Keep ``value`` under ``key`` in ``demo.json`` for later runs."""
        self.info[key] = value
        (self.workdir / "demo.json").write_text(json.dumps(self.info, indent=2))


def prepare_demo(
    workdir: str | Path,
    *,
    quick: bool = False,
    regenerate: bool = True,
    seed: int = 0,
    progress: bool = True,
    capture_overrides: dict[str, Any] | None = None,
) -> DemoPaths:
    """Build (or reuse) DIR/target, DIR/data and DIR/dataset; every step is cached in ``workdir``."""
    size = QUICK if quick else FULL
    root, info_path, info = open_workdir(workdir, "demo.json", quick=quick, seed=seed, what="demo")
    # the demo's own progress only: no "Loading weights" / "Writing model shards" bars
    with one_thread(), quiet_loading():
        return _prepare(root, size, quick, regenerate, seed, progress, capture_overrides, info, info_path)


def _prepare(root: Path, size: DemoSize, quick: bool, regenerate: bool, seed: int, progress: bool,
             capture_overrides: dict[str, Any] | None, info: dict[str, Any], info_path: Path) -> DemoPaths:
    from tapdraft.capture.pipeline import capture

    tdir, ddir, dsdir = root / "target", root / "data", root / "dataset"
    if (tdir / "salm_config.json").is_file():
        salm = SALM.from_pretrained(tdir)
    else:
        salm = build_demo_salm(size, seed)
        info["train"] = train_demo_salm(salm, size, seed=seed, progress=progress)
        tmp = root / "target.tmp"
        salm.save_pretrained(tmp)
        if tdir.exists():
            shutil.rmtree(tdir)
        tmp.replace(tdir)
        salm = SALM.from_pretrained(tdir)
    made = {split: d.get("regenerated") for split, d in info.get("data", {}).items()}
    if any(r is not None and r != regenerate and (ddir / f"{split}.jsonl").is_file() for split, r in made.items()):
        raise ValueError(f"{ddir} holds replies {'from' if not regenerate else 'not from'} the target "
                         f"(regenerate={not regenerate}); use another workdir or the same setting")
    with torch.no_grad():
        for split, n, s in (("train", size.train_samples, seed + 1), ("validation", size.val_samples, seed + 2)):
            if not (ddir / f"{split}.jsonl").is_file():
                info.setdefault("data", {})[split] = write_split(
                    salm, tdir, ddir, split, n, seed=s, regenerate=regenerate, max_new_tokens=size.max_new_tokens,
                    keep_truncated=quick, progress=progress)
    info_path.write_text(json.dumps(info, indent=2))
    cfg = CaptureConfig(
        target=str(tdir.resolve()), out=str(dsdir),
        data=(("train", str((ddir / "train.jsonl").resolve())),
              ("validation", str((ddir / "validation.jsonl").resolve()))),
        draft_layers=2, top_k=16 if quick else 32, batch_tokens=4096, window=256, progress=progress,
        responses_from_target=None if regenerate else False,  # regenerated: read from the sidecar
    )
    if capture_overrides:
        cfg = replace(cfg, **capture_overrides)
    manifest = capture(cfg, target=None)
    info["capture"] = manifest.get("run_stats", {})
    info_path.write_text(json.dumps(info, indent=2))
    return DemoPaths(root, tdir, ddir, ddir / "train.jsonl", ddir / "validation.jsonl", dsdir, info)
