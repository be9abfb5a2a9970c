"""The demo target: a small SALM trained in about 90 CPU seconds on a synthetic spoken task.

Task ("tone-coded digits"): an audio of 2-5 digits, each digit d a 0.24 s tone at 400 + 170*d Hz
with a random level, slight detuning and noise, separated by 80 ms gaps (so one digit is ~4 encoder
frames of 80 ms). The user asks one of a few questions about it; the reply is templated:

    user:      <|audioplaceholder|> repeat the digits and add them .
    assistant: you said three one four . the sum is eight .

The reply's words depend on what the audio says (digits, their count, first/last digit, their
sum), so a drafter has real structure to learn (audio-conditioned content inside fixed templates).
A random-init target would have none; it is fine for unit tests, never for the demo.

:func:`prepare_demo` builds the whole capture half, each step cached in ``workdir``:

    DIR/target/     the trained SALM (SALM.save_pretrained); reused when present
    DIR/data/       wav files + train.jsonl + validation.jsonl (NeMo-style manifests); assistant turns
                    are the TARGET'S OWN greedy replies (``reference`` keeps the templated answer), so
                    offline acceptance measured on this data is exact for greedy decoding
    DIR/dataset/    the captured dataset (both splits)

Sizes (full demo): LM Qwen3 6 layers x 96 wide, vocab ~60; encoder FastConformer 1 layer x 64;
~0.8 M parameters; a 2-layer draft's default taps are [1, 3] plus the last layer, 5. Training adds
an auxiliary per-frame digit classifier on the adapter output (dense supervision for the random-init
encoder; discarded afterwards): in 300 steps without it the model learned the templates but not
which digit a tone is (11% of greedy replies equal the templated answer); with it 58% (4-layer
trial: repeat/first/last/count 100%, sums 23%). ``quick=True`` shrinks everything to a seconds-long
run for tests.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capture.config import CaptureConfig
from capture.salm import SALM, AudioConfig, build_word_tokenizer

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen")
TENS = ("", "", "twenty", "thirty", "forty")
COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}

TASKS = {
    # name: (prompt, reply builder, weight)
    "repeat_add": ("repeat the digits and add them .", lambda d: f"you said {_say(d)} . the sum is {_num(sum(d))} .", 4),
    "repeat": ("what did i say ?", lambda d: f"you said {_say(d)} .", 2),
    "sum": ("what is the sum ?", lambda d: f"the sum is {_num(sum(d))} .", 2),
    "count": ("how many digits ?", lambda d: f"there are {COUNTS[len(d)]} digits .", 1),
    "first": ("what is the first digit ?", lambda d: f"the first digit is {DIGITS[d[0]]} .", 1),
    "last": ("what is the last digit ?", lambda d: f"the last digit is {DIGITS[d[-1]]} .", 1),
}
SAMPLE_RATE = 16000
TONE_S, GAP_S, EDGE_S = 0.24, 0.08, 0.08


def _say(d: list[int]) -> str:
    return " ".join(DIGITS[x] for x in d)


def _num(n: int) -> str:
    if n < 10:
        return DIGITS[n]
    if n < 20:
        return TEENS[n - 10]
    return TENS[n // 10] + ("" if n % 10 == 0 else " " + DIGITS[n % 10])


def vocabulary() -> list[str]:
    words: list[str] = []
    for prompt, _, _ in TASKS.values():
        words += prompt.split()
    words += list(DIGITS) + list(TEENS) + [t for t in TENS if t]
    words += "you said the sum is there are digits first last digit .".split()
    return list(dict.fromkeys(words))


def tone_audio(digits: list[int], rng: np.random.Generator) -> np.ndarray:
    """float32 waveform at 16 kHz: one tone per digit with gaps, random level, detune and noise."""
    return _tones(digits, rng)[0]


def _tones(digits: list[int], rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The waveform and each digit's (start sample, end sample, digit)."""
    sr = SAMPLE_RATE
    parts = [np.zeros(int(EDGE_S * sr), np.float32)]
    spans, pos = [], parts[0].shape[0]
    for d in digits:
        n = int(TONE_S * sr)
        f = (400 + 170 * d) * (1 + rng.uniform(-0.01, 0.01))
        t = np.arange(n) / sr
        env = np.minimum(1, np.minimum(t, t[::-1]) / 0.01)  # 10 ms ramps
        parts += [(rng.uniform(0.2, 0.6) * env * np.sin(2 * np.pi * f * t)).astype(np.float32),
                  np.zeros(int(GAP_S * sr), np.float32)]
        spans.append((pos, pos + n, d))
        pos += n + parts[-1].shape[0]
    parts.append(np.zeros(int(EDGE_S * sr), np.float32))
    wave = np.concatenate(parts)
    return (wave + rng.normal(0, 0.01, wave.shape)).astype(np.float32), spans


def frame_labels(spans: list[tuple[int, int, int]], n_frames: int, frame_samples: int) -> list[int]:
    """Per encoder frame: the digit whose tone covers the frame's centre, else 10 (silence)."""
    out = []
    for k in range(n_frames):
        c = (k + 0.5) * frame_samples
        out.append(next((d for a, b, d in spans if a <= c < b), 10))
    return out


def sample_example(rng: np.random.Generator) -> tuple[list[int], str, str, str]:
    """(digits, task, prompt, templated reply)."""
    names = list(TASKS)
    w = np.array([TASKS[n][2] for n in names], dtype=np.float64)
    task = names[rng.choice(len(names), p=w / w.sum())]
    digits = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 6)))]
    prompt, reply, _ = TASKS[task]
    return digits, task, prompt, reply(digits)


# ------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class DemoSize:
    """Demo SALM sizes and training budget."""

    lm_hidden: int = 96
    lm_layers: int = 6
    lm_heads: int = 4
    lm_kv_heads: int = 2
    lm_intermediate: int = 288
    enc_hidden: int = 64
    enc_layers: int = 1
    enc_channels: int = 32
    train_seconds: float = 150.0
    """Wall-clock cap for target training (the step budget ends it first on an idle 2-core machine: ~90 s)."""
    max_steps: int = 300
    batch_size: int = 24
    lr: float = 4e-3
    train_samples: int = 1200
    """Conversations written to the train manifest (captured)."""
    val_samples: int = 120
    pool: int = 768
    """Distinct training audios (featurized once; the question asked about each is drawn per step)."""
    aux_weight: float = 1.0
    """Weight of the auxiliary per-frame digit loss during target training."""
    max_new_tokens: int = 32
    """Greedy reply length cap when regenerating assistant turns (templated replies are <= 14 words)."""


FULL = DemoSize()
QUICK = DemoSize(lm_hidden=32, lm_layers=3, lm_heads=2, lm_kv_heads=1, lm_intermediate=64, enc_hidden=16,
                 enc_channels=8, train_seconds=3.0, max_steps=20, batch_size=8, train_samples=12, val_samples=4,
                 pool=16, max_new_tokens=12)


def build_demo_salm(size: DemoSize, seed: int = 0) -> SALM:
    from transformers import ParakeetEncoderConfig, Qwen3Config

    tok = build_word_tokenizer(vocabulary())
    lm_cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=size.lm_hidden, intermediate_size=size.lm_intermediate,
        num_hidden_layers=size.lm_layers, num_attention_heads=size.lm_heads, num_key_value_heads=size.lm_kv_heads,
        head_dim=size.lm_hidden // size.lm_heads, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    enc_cfg = ParakeetEncoderConfig(
        hidden_size=size.enc_hidden, num_hidden_layers=size.enc_layers, num_attention_heads=4 if size.enc_hidden >= 64
        else 2, intermediate_size=size.enc_hidden * 2, subsampling_conv_channels=size.enc_channels, num_mel_bins=80,
        conv_kernel_size=9, dropout=0.0, dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0,
        attention_dropout=0.0,
    )
    return SALM.build(lm_config=lm_cfg, encoder_config=enc_cfg, tokenizer=tok, adapter_layers=0,
                      audio=AudioConfig(sample_rate=SAMPLE_RATE), seed=seed)


class _Pool:
    """Training examples: a fixed pool of featurized audios (feature extraction once), tasks drawn per step."""

    def __init__(self, salm: SALM, rng: np.random.Generator, n: int):
        self.salm, self.rng = salm, rng
        self.digits = [[int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 6)))] for _ in range(n)]
        feats, masks, self.labels = [], [], []
        hop = salm.config.audio.hop_length * salm.config.audio.subsampling_factor
        for s in range(0, n, 64):
            made = [_tones(d, rng) for d in self.digits[s : s + 64]]
            f, m = salm.featurize([w for w, _ in made])
            feats += list(f)
            masks += list(m)
            self.labels += [frame_labels(sp, salm.num_frames(w.shape[0]), hop) for w, sp in made]
        F = max(f.shape[0] for f in feats)
        self.feats = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, F - f.shape[0])) for f in feats])
        self.masks = torch.stack([torch.nn.functional.pad(m, (0, F - m.shape[0])) for m in masks])
        self._tok: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        names = list(TASKS)
        w = np.array([TASKS[k][2] for k in names], dtype=np.float64)
        self.names, self.p = names, w / w.sum()

    def tokens(self, prompt: str, reply: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (prompt, reply)
        if key not in self._tok:
            ph = self.salm.config.audio.placeholder
            self._tok[key] = self.salm.tokenize([{"role": "user", "content": f"{ph} {prompt}"},
                                                 {"role": "assistant", "content": reply}])
        return self._tok[key]

    def batch(self, n: int):
        """inputs_embeds [B, T, H], attention mask [B, T], labels [B, T] (-100 where unsupervised),
        audio frames [N, H] and their digit labels [N] (for the auxiliary frame loss)."""
        idx = self.rng.integers(0, len(self.digits), size=n)
        m = self.masks[idx]
        F = int(m.sum(-1).max())
        audio = self.salm.encode_features(self.feats[idx, :F], m[:, :F])
        frames = torch.cat(audio)
        frame_y = torch.tensor([y for i in idx for y in self.labels[i]])
        assert frames.shape[0] == frame_y.shape[0]
        exps = []
        for i, a in zip(idx, audio):
            prompt, reply, _ = TASKS[self.names[self.rng.choice(len(self.names), p=self.p)]]
            ids, mask = self.tokens(prompt, reply(self.digits[i]))
            exps.append(self.salm.expand(ids, mask, [a]))
        T = max(e.input_ids.shape[0] for e in exps)
        H = exps[0].inputs_embeds.shape[-1]
        emb = torch.zeros(n, T, H)
        attn = torch.zeros(n, T, dtype=torch.long)
        labels = torch.full((n, T), -100, dtype=torch.long)
        for b, e in enumerate(exps):
            t = e.input_ids.shape[0]
            emb[b, :t], attn[b, :t] = e.inputs_embeds, 1
            labels[b, :t] = torch.where(e.loss_mask, e.input_ids, torch.full_like(e.input_ids, -100))
        return emb, attn, labels, frames, frame_y


def train_demo_salm(salm: SALM, size: DemoSize, *, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Teacher-forced CE on assistant tokens, AdamW + cosine, until ``train_seconds`` or ``max_steps``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    pool = _Pool(salm, rng, size.pool)
    salm.train()
    # auxiliary frame classifier (digit or silence per 80 ms frame): dense supervision that teaches the
    # randomly initialised encoder to tell tones apart within tens of steps; discarded after training
    aux = torch.nn.Linear(salm.config.adapter.lm_hidden, 11)
    params = [p for p in salm.parameters() if p.requires_grad] + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=size.lr, weight_decay=0.01, betas=(0.9, 0.98))
    t0, step, ema = time.perf_counter(), 0, None
    with Progress(TextColumn("train demo target"), BarColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), disable=not progress) as bar:
        task = bar.add_task("train", total=size.train_seconds, info="")
        while step < size.max_steps:
            elapsed = time.perf_counter() - t0
            if elapsed >= size.train_seconds:
                break
            frac = min(1.0, max(elapsed / size.train_seconds, step / size.max_steps))
            lr = size.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            emb, attn, labels, frames, frame_y = pool.batch(size.batch_size)
            logits = salm(inputs_embeds=emb, attention_mask=attn).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
            aux_loss = torch.nn.functional.cross_entropy(aux(frames), frame_y)
            opt.zero_grad(set_to_none=True)
            (loss + size.aux_weight * aux_loss).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            ema = float(loss.detach()) if ema is None else 0.95 * ema + 0.05 * float(loss.detach())
            bar.update(task, completed=min(time.perf_counter() - t0, size.train_seconds),
                       info=f"step {step}  loss {ema:.3f}")
    salm.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "final_loss_ema": round(ema or 0.0, 4),
            "final_frame_loss": round(float(aux_loss.detach()), 4) if step else None}


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
            replies = salm.generate_batch(prompts, [[w] for w in waves], max_new_tokens=max_new_tokens)
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
