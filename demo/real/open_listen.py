"""Teach the speech LLM's listener open speech: espeak-ng speech of sentences people wrote to a chat model.

The closed listener (``listen``) hears five templates over 60 words; the encoder (Whisper tiny.en's, trained on 680k
hours of open speech) is not what closes it, the projector's training is. Here the projector learns from sentences of
ShareGPT's requests, in a work directory whose every stage resumes:

    sentences   the user turns of ShareGPT V3 in ``broad``'s seeded order, cut into sentences; kept: ``MIN_WORDS`` to
                ``MAX_WORDS`` words of letters (an apostrophe inside a word), no other character but , ; : . ! ?, one
                of the commonest English words among them (``ENGLISH``); no sentence twice (case and punctuation off). Held-out sentences come from the conversations the broad
                data holds out (``broad.HELD_OUT_RESERVE``), training ones from the rest; none is both. The
                transcript is the sentence in lower case, its words alone (``transcript``).
    speech      espeak-ng, the voices cycled (``listen.VOICES``), each utterance's speed moved by up to
                ``SPEED_JITTER`` words a minute (seeded per utterance)
    cache       the encoder's frames of the training utterances, ``CHUNK`` a file (``frames/NNNNN.pt``, half
                precision), or with ``encoder_layers`` its log-mel inputs (``mels/``: the encoder then runs every
                update); the held-out utterances as wavs (``audio/``)
    training    ``listen.fit`` on the projector (and the encoder's top ``encoder_layers`` layers), from the closed
                listener's (``listen.build_listener``), resumable (``fit.pt``); a share of every pass is the closed
                task's own training sentences, so it keeps them
    evaluation  the saved directory (``model/``, the Qwen2-Audio layout) reloaded: WER on the held-out open sentences
                and on the closed task's held-out set (``listen.sentences``' test split), written to ``listen.json``

    python -m tapdraft.demo.real listen-open --workdir open_listen --sentences 20000 --steps 4000
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import soundfile as sf
import torch

from tapdraft.common.atomic import staged
from tapdraft.demo.real import listen
from tapdraft.demo.real.answer import add_low_rank, merge_low_rank
from tapdraft.demo.real.broad import HELD_OUT_RESERVE, conversations, sharegpt_records

MIN_WORDS, MAX_WORDS = 4, 16
"""A sentence's words: long enough to carry context, short enough to speak in a few seconds."""
SPEED_JITTER = 20
"""Words a minute a voice's speed moves by, either way, per utterance."""
CHUNK = 500
"""Training utterances per frames file: the unit the cache resumes by."""
_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_PUNCT = ",;:.!?"
ENGLISH = frozenset("a an the to of and or in on at for with is are was be it this that i you we my your can how what "
                    "do not".split())
"""A kept sentence holds one of these words: ShareGPT's requests pass broad's ASCII test in German or Spanish too."""


def split_sentences(text: str) -> list[str]:
    """``text``'s sentences that espeak-ng and a transcript agree on (module docstring), in order."""
    out = []
    for s in _BREAK.split(text):
        words = s.split()
        bare = [w.rstrip(_PUNCT) for w in words]
        if (MIN_WORDS <= len(words) <= MAX_WORDS and all(_WORD.fullmatch(w) for w in bare)
                and ENGLISH & {w.lower() for w in bare}):
            out.append(" ".join(words))
    return out


def transcript(sentence: str) -> str:
    """What the listener writes for ``sentence``: lower case, its words alone (apostrophes kept)."""
    return " ".join(w.rstrip(_PUNCT).lower() for w in sentence.split())


def open_sentences(records: list[dict[str, Any]], n_train: int, n_test: int, seed: int = 0
                   ) -> tuple[dict[str, list[str]], dict[str, int]]:
    """``{"train", "test"}`` sentences of ShareGPT's requests (held-out ones from the reserved conversations), and
    how many each source held. Raises when the sources hold fewer than asked."""
    convs, _ = conversations(records)
    random.Random(seed).shuffle(convs)  # broad.sharegpt_splits' order: its reserve is the held-out source
    sources = {"test": convs[-HELD_OUT_RESERVE:], "train": convs[:-HELD_OUT_RESERVE]}
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for split, n in (("test", n_test), ("train", n_train)):
        found = []
        for conv in sources[split]:
            for turn in conv["conversations"]:
                if turn["from"] != "User":
                    continue
                for s in split_sentences(turn["value"]):
                    key = listen.normalise(s)
                    if key not in seen:
                        seen.add(key)
                        found.append(s)
        counts[split] = len(found)
        if len(found) < n:
            raise ValueError(f"ShareGPT's {split} conversations hold {len(found)} usable sentences; asked for {n}")
        out[split] = random.Random(seed + 1).sample(found, n)
    return out, counts


def voice_of(i: int, seed: int) -> tuple[str, int]:
    """Utterance ``i``'s voice and speed: the voices cycled, the speed jittered (seeded by ``seed`` and ``i``)."""
    voice, speed = listen.VOICES[i % len(listen.VOICES)]
    return voice, speed + random.Random(f"{seed}:{i}").randint(-SPEED_JITTER, SPEED_JITTER)


FROZEN_LM = ("auto", "bfloat16", "float32")
"""``OpenListenConfig.frozen_lm``'s choices: a torch dtype's name, or ``auto``."""


@dataclass(frozen=True)
class OpenListenConfig:
    n_train: int = 20000
    """Training sentences, each spoken once."""
    n_test: int = 200
    """Held-out open sentences."""
    steps: int = 4000
    """Projector updates."""
    batch: int = 8
    """Utterances per update."""
    lr: float = 1e-3
    """AdamW learning rate (cosine to 0)."""
    closed_share: float = 0.1
    """Share of the training pairs that are the closed task's own sentences (``listen.sentences``' train split)."""
    seed: int = 0
    """Sentences, voices, order."""
    encoder_layers: int = 0
    """The audio encoder's top layers (and its final norm) trained with the projector at ``encoder_lr``; 0: the
    projector alone, through which 600 updates on 4,500 sentences left the loss flat from update 230 (docs/LOG.md
    2026-12-07). The whole encoder at the projector's rate forgot how to hear (``answer.AnswerConfig.train_encoder``)."""
    encoder_lr: float = 3e-5
    """The encoder layers' AdamW learning rate."""
    frozen_lm: str = "auto"
    """The frozen LM's precision while the projector trains through it: ``bfloat16`` (a bf16 copy, ``listen.fit``'s
    ``frozen_dtype``: the LM's matmuls, most of an update, on the CPU's bf16 units), ``float32``, or ``auto``: bf16 on
    a CPU with bf16 instructions, else fp32. With ``lm_rank`` the LM trains: fp32 (``auto``) only."""
    lm_rank: int = 0
    """A low-rank update of the LM's linear weights (``answer.add_low_rank``, merged into the saved model) trained
    with the projector; 0: the LM frozen. The projector and the encoder's top layers both left the loss at the same
    plateau (docs/LOG.md 2026-12-07): the frozen LM's reading of the frames looked like the limit."""

    def __post_init__(self) -> None:
        if min(self.n_train, self.n_test, self.steps, self.batch) < 1 or self.lr <= 0:
            raise ValueError("n_train, n_test, steps and batch must be >= 1 and lr > 0")
        if self.encoder_layers < 0 or self.encoder_lr <= 0:
            raise ValueError("encoder_layers must be >= 0 and encoder_lr > 0")
        if self.frozen_lm not in FROZEN_LM:
            raise ValueError(f"frozen_lm is one of {', '.join(FROZEN_LM)}; got {self.frozen_lm!r}")
        if self.lm_rank < 0:
            raise ValueError(f"lm_rank must be >= 0 (0: the LM frozen), got {self.lm_rank}")
        if self.lm_rank and self.frozen_lm == "bfloat16":
            raise ValueError("lm_rank trains the LM, which then runs in float32: drop frozen_lm=bfloat16")
        if not 0 <= self.closed_share < 1:
            raise ValueError(f"closed_share is a share of the training pairs, in [0, 1); got {self.closed_share}")

    def frozen_dtype(self) -> torch.dtype:
        from tapdraft.train.fit import cpu_has_bf16

        if self.frozen_lm == "auto":
            return torch.bfloat16 if cpu_has_bf16() and not self.lm_rank else torch.float32
        return getattr(torch, self.frozen_lm)


def stage_sentences(work: Path, cfg: OpenListenConfig, records: list[dict[str, Any]] | None = None) -> dict:
    """``work/sentences.json`` (made once; a rerun with other sizes or seed is refused)."""
    path = work / "sentences.json"
    want = {"n_train": cfg.n_train, "n_test": cfg.n_test, "seed": cfg.seed}
    if path.exists():
        doc = json.loads(path.read_text())
        if doc["made_with"] != want:
            raise ValueError(f"{path} was made with {doc['made_with']}, not {want}: use another --workdir")
        return doc
    if records is None:
        records, _ = sharegpt_records()
    picks, counts = open_sentences(records, cfg.n_train, cfg.n_test, cfg.seed)
    doc = {"made_with": want, "available": counts, **picks}
    with staged(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def stage_frames(work: Path, model, fe, sentences: list[str], seed: int, log=print, mels: bool = False) -> list:
    """The encoder's frames of every training utterance, spoken and encoded ``CHUNK`` at a time into
    ``work/frames/NNNNN.pt`` (a rerun keeps the files made); all of them, in order. With ``mels``, the encoder's
    inputs instead (``work/mels/``: ``listen.audio_inputs`` items, for an encoder that trains), rebuilt on reading."""
    out: list = []
    t0 = time.time()
    tower = model.model.audio_tower
    for c in range(-(-len(sentences) // CHUNK)):
        path = work / ("mels" if mels else "frames") / f"{c:05d}.pt"
        if not path.exists():
            ids = range(c * CHUNK, min((c + 1) * CHUNK, len(sentences)))
            waves = [listen.speak(sentences[i], *voice_of(i, seed)) for i in ids]
            made = ([{"x": a["x"].half(), "feat_len": a["feat_len"], "n_out": a["n_out"]}
                     for a in listen.audio_inputs(tower, waves, fe)] if mels
                    else [f.half() for f in listen.encode_audio(model, waves, fe)])
            with staged(path) as tmp, open(tmp, "wb") as f:
                torch.save(made, f)
            log(f"spoke and encoded {ids.stop}/{len(sentences)} training sentences ({time.time() - t0:.0f}s)")
        kept = torch.load(path, weights_only=True)
        out += ([listen.audio_input(tower, a["x"].float(), a["feat_len"], a["n_out"]) for a in kept] if mels
                else kept)
    return out


def stage_waves(work: Path, split: str, sentences: list[str], voice: Callable[[int], tuple[str, int]]
                ) -> list[np.ndarray]:
    """Utterances as ``work/audio/SPLIT-NNNNN.wav`` (kept across reruns), sentence ``i`` in ``voice(i)``, read back."""
    out = []
    for i, s in enumerate(sentences):
        path = work / "audio" / f"{split}-{i:05d}.wav"
        if not path.exists():
            with staged(path) as tmp:
                sf.write(tmp, listen.speak(s, *voice(i)), 16000, subtype="PCM_16", format="WAV")
        out.append(sf.read(path, dtype="float32")[0])
    return out


def closed_voice(i: int) -> tuple[str, int]:
    """The closed listener's held-out voices (``listen.train_listener``: cycled from the test split's first), so its
    WER here is comparable with the closed listener's own."""
    return listen.VOICES[i % len(listen.VOICES)]


def training_pairs(tok, open_texts: list[str], closed_texts: list[str], share: float
                   ) -> tuple[list[listen.Example], list[int]]:
    """The open sentences' transcription pairs and, for ``share`` of all pairs, the closed task's (cycled); and which
    closed sentence each closed pair hears (indices into ``closed_texts``; their frames follow the open ones)."""
    n_closed = round(share * len(open_texts) / (1 - share)) if closed_texts else 0
    closed = [i % len(closed_texts) for i in range(n_closed)]
    texts = [transcript(t) for t in open_texts] + [closed_texts[i] for i in closed]
    return listen.transcription_examples(tok, texts), closed


def closed_task() -> dict[str, list[str]]:
    """The closed listener's sentences (``listen.sentences`` at its own configuration's sizes and seed)."""
    c = listen.ListenConfig
    return listen.sentences(c.n_train, c.n_test, c.n_oov, c.seed)


def held_out(work: Path, cfg: OpenListenConfig, doc: dict | None = None
             ) -> dict[str, tuple[list[str], list[np.ndarray], int]]:
    """The evaluation's two sets as (transcripts, waves, the listener's reply cap): the held-out open sentences in the
    voices the training never gave them (``voice_of`` at ``seed + 1``; 4-16 words, 48 tokens) and the closed task's
    held-out set in its own listener's voices (``closed_voice``; ``listen.transcribe``'s 24, as the closed listener
    is scored); spoken once into ``work/audio/`` and read back, so every transcriber hears the same waves."""
    doc = doc or stage_sentences(work, cfg)
    closed = closed_task()["test"]
    return {"open_held_out": ([transcript(s) for s in doc["test"]],
                              stage_waves(work, "test", doc["test"], lambda i: voice_of(i, cfg.seed + 1)), 48),
            "closed_held_out": (closed, stage_waves(work, "closed-test", closed, closed_voice), 24)}


def train_open_listener(work: Path, cfg: OpenListenConfig, start: Path, log=print) -> dict:
    """The whole chain in ``work`` from the closed listener's directory ``start``; the report (``listen.json``)."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    t0 = time.time()
    work.mkdir(parents=True, exist_ok=True)
    doc = stage_sentences(work, cfg)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(start, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(start)
    tower = model.model.audio_tower
    if cfg.encoder_layers > len(tower.layers):
        raise ValueError(f"encoder_layers {cfg.encoder_layers}: the encoder has {len(tower.layers)} layers")
    mels = cfg.encoder_layers > 0
    frames = stage_frames(work, model, proc.feature_extractor, doc["train"], cfg.seed, log, mels=mels)
    closed = closed_task()
    examples, picks = training_pairs(proc.tokenizer, doc["train"], closed["train"], cfg.closed_share)
    heard = sorted(set(picks))
    closed_waves = stage_waves(work, "closed-train", [closed["train"][i] for i in heard],
                               lambda j: voice_of(heard[j], cfg.seed))
    closed_frames = (listen.audio_inputs(tower, closed_waves, proc.feature_extractor) if mels
                     else listen.encode_audio(model, closed_waves, proc.feature_extractor))
    audio = frames + [closed_frames[heard.index(i)] for i in picks]
    log(f"{len(frames)} open and {len(picks)} closed training pairs ready ({time.time() - t0:.0f}s)")
    torch.manual_seed(cfg.seed)
    params = [{"params": list(model.model.multi_modal_projector.parameters())}]
    if mels:
        top = [p for layer in tower.layers[-cfg.encoder_layers:] for p in layer.parameters()]
        params.append({"params": top + list(tower.layer_norm.parameters()), "lr": cfg.encoder_lr})
    if cfg.lm_rank:
        params.append({"params": add_low_rank(model.model.language_model, cfg.lm_rank)})
    losses = listen.fit(model, examples, audio, params, cfg.steps, cfg.batch, cfg.lr, cfg.seed, log,
                        resume=work / "fit.pt", frozen_dtype=cfg.frozen_dtype())
    merge_low_rank(model.model.language_model)
    with staged(work / "model") as tmp:
        model.save_pretrained(tmp)
        proc.save_pretrained(tmp)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(work / "model", dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(work / "model")
    sets = held_out(work, cfg, doc)
    report = {"config": asdict(cfg), "start": str(start), "final_loss": float(np.mean(losses[-20:])),
              **{name: listen.score_transcripts(refs, listen.transcribe(model, proc, waves, max_new_tokens=cap))
                 for name, (refs, waves, cap) in sets.items()},
              "sentences_available": doc["available"], "seconds": round(time.time() - t0)}
    with staged(work / "listen.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
    return report
