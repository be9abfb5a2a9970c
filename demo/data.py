"""The demo's capture half, each step cached in a work directory.

:func:`prepare_demo` builds (or reuses)

    DIR/target/     the trained SALM (SALM.save_pretrained); reused when present
    DIR/data/       wav files + train.jsonl + validation.jsonl (NeMo-style manifests); assistant turns
                    are the TARGET'S OWN greedy replies (``reference`` keeps the templated answer), so
                    offline acceptance measured on this data is exact for greedy decoding
    DIR/dataset/    the captured dataset (both splits)
    DIR/demo.json   what each step did (target training, data, capture) and which mode built it
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from capture.config import CaptureConfig
from capture.load import quiet_loading
from capture.salm import SALM
from demo.target import FULL, QUICK, DemoSize, build_demo_salm, train_demo_salm
from demo.task import SAMPLE_RATE, sample_example, tone_audio


@torch.no_grad()
def greedy_replies(
    salm: SALM,
    conversations: Sequence[list[dict[str, str]]],
    waveforms: Sequence[Sequence[np.ndarray]],
    *,
    max_new_tokens: int = 48,
) -> list[str]:
    """The target's greedy replies to conversations ending in a user turn (one waveform per placeholder).

    Prompts are left-padded into one batch with explicit position ids, so each reply equals the
    unbatched greedy reply up to float rounding.
    """
    flat = [w for ws in waveforms for w in ws]
    audio = salm.encode_audio(flat)
    exps, k = [], 0
    for msgs, ws in zip(conversations, waveforms):
        ids, mask = salm.tokenize(msgs, add_generation_prompt=True)
        exps.append(salm.expand(ids, mask, audio[k : k + len(ws)]))
        k += len(ws)
    B, P = len(exps), max(e.input_ids.shape[0] for e in exps)
    dev, H = salm.device, exps[0].inputs_embeds.shape[-1]
    emb = torch.zeros(B, P, H, dtype=exps[0].inputs_embeds.dtype, device=dev)
    attn = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, e in enumerate(exps):
        T = e.input_ids.shape[0]
        emb[b, P - T :], attn[b, P - T :] = e.inputs_embeds, 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    eos = salm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = salm.lm(inputs_embeds=emb, attention_mask=attn, position_ids=pos, use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    nxt = out.logits[:, -1].argmax(-1)
    new = torch.empty(B, 0, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    last = pos[:, -1]
    for _ in range(max_new_tokens):
        done |= nxt == eos
        new = torch.cat([new, torch.where(done, torch.full_like(nxt, eos), nxt)[:, None]], dim=1)
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=dev)], dim=1)
        last = last + 1
        out = salm.lm(input_ids=nxt[:, None], attention_mask=attn, position_ids=last[:, None], cache=cache,
                      use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        nxt = out.logits[:, -1].argmax(-1)
    replies = []
    for row in new.tolist():
        row = row[: row.index(eos)] if eos in row else row
        replies.append(salm.tokenizer.decode(row, skip_special_tokens=True))
    return replies


# ------------------------------------------------------------------------------------------ data
def write_split(salm: SALM, data_dir: Path, split: str, n: int, *, seed: int, regenerate: bool,
                batch_size: int = 64, max_new_tokens: int = 32) -> dict[str, Any]:
    """Write n wav files + ``split.jsonl``; assistant turns = the target's greedy replies when ``regenerate``."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    (data_dir / "audio").mkdir(parents=True, exist_ok=True)
    rows, exact = [], 0
    for start in range(0, n, batch_size):
        chunk = [sample_example(rng) for _ in range(min(batch_size, n - start))]
        waves = [tone_audio(d, rng) for d, *_ in chunk]
        prompts = [[{"role": "user", "content": f"{salm.config.audio.placeholder} {p}"}] for _, _, p, _ in chunk]
        if regenerate:
            replies = greedy_replies(salm, prompts, [[w] for w in waves], max_new_tokens=max_new_tokens)
        else:
            replies = [r for *_, r in chunk]
        for j, ((digits, task, prompt, ref), wave, reply) in enumerate(zip(chunk, waves, replies)):
            sid = f"{split}-{start + j:06d}"
            rel = f"audio/{sid}.wav"
            sf.write(data_dir / rel, wave, SAMPLE_RATE, subtype="PCM_16")
            if not reply.strip():
                reply = ref  # an empty greedy reply would be an empty assistant turn
            exact += reply == ref
            rows.append({
                "id": sid,
                "conversations": [
                    {"from": "User", "type": "audio", "value": rel, "duration": round(len(wave) / SAMPLE_RATE, 4)},
                    {"from": "User", "type": "text", "value": prompt},
                    {"from": "Assistant", "type": "text", "value": reply},
                ],
                "reference": ref, "task": task, "digits": digits,
            })
    path = data_dir / f"{split}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return {"samples": n, "target_matches_reference": round(exact / max(n, 1), 4), "regenerated": regenerate}


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
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    info_path = root / "demo.json"
    info: dict[str, Any] = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info and info.get("quick") != quick:
        raise ValueError(f"{root} holds a {'quick' if info.get('quick') else 'full'} demo; use another --workdir")
    info.update(quick=quick, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1 M-parameter model gains little from more, and loses a lot on shared cores
    try:
        with quiet_loading():  # the demo's own progress only: no "Loading weights" / "Writing model shards" bars
            return _prepare(root, size, quick, regenerate, seed, progress, capture_overrides, info, info_path)
    finally:
        torch.set_num_threads(threads)


def _prepare(root: Path, size: DemoSize, quick: bool, regenerate: bool, seed: int, progress: bool,
             capture_overrides: dict[str, Any] | None, info: dict[str, Any], info_path: Path) -> DemoPaths:
    from capture.pipeline import capture

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
                info.setdefault("data", {})[split] = write_split(salm, ddir, split, n, seed=s, regenerate=regenerate,
                                                                  max_new_tokens=size.max_new_tokens)
    info_path.write_text(json.dumps(info, indent=2))
    cfg = CaptureConfig(
        target=str(tdir.resolve()), out=str(dsdir),
        data=(("train", str((ddir / "train.jsonl").resolve())), ("validation", str((ddir / "validation.jsonl").resolve()))),
        draft_layers=2, top_k=16 if quick else 32, batch_tokens=4096, window=256, progress=progress,
        responses_from_target=regenerate,
    )
    if capture_overrides:
        cfg = replace(cfg, **capture_overrides)
    manifest = capture(cfg, target=None)
    info["capture"] = manifest.get("run_stats", {})
    info_path.write_text(json.dumps(info, indent=2))
    return DemoPaths(root, tdir, ddir, ddir / "train.jsonl", ddir / "validation.jsonl", dsdir, info)
