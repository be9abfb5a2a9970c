"""Teach the real-parts speech LLM to answer a spoken request with the reply its LM gives the same request written.

The cross-modal alignment speech LLMs are built with (BLSP, Qwen2-Audio's pretraining): the frozen language model is
its own teacher. Its greedy reply to the written request is the target of the spoken one, so the audio side learns
to put into the LM what the written words put there, and the LM itself never changes.

    task        spoken-friendly requests from ``REQUESTS`` over ``listen``'s closed vocabulary ("tell me about a
                brave pilot", "write a short story where anna finds a red book"); train and held-out requests
                disjoint; an out-of-vocabulary set holds words never trained on
    start       the transcribing listener (``listen.build_listener``): its projector already puts words into the LM
    training    the projector (without ``train_projector`` the listener's is kept; with ``train_encoder`` the
                audio encoder too, at its own rate; with ``lm_rank`` a low-rank LM update, merged: the Qwen2-Audio
                layout is unchanged either way, so vLLM and ``capture`` load the result as any checkpoint); CE on
                the written reply's first ``reply_tokens`` tokens, or with ``distill`` KL from the frozen LM's
                top-k; a share of every pass is transcription, so the first task stays (its WER is measured after)
    evaluation  the saved directory reloaded as ``Qwen2AudioForConditionalGeneration``: on held-out spoken requests,
                how often the spoken reply's first 32 tokens equal the written reply's, the whole reply (up to
                ``eval_tokens``), the mean agreeing prefix; transcription WER on ``listen``'s held-out sentences;
                and that a reply follows its audio (closer to its own request's written reply than to another's)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tapdraft.demo.real.listen import (VOICES, Example, ListenConfig, TopK, audio_inputs, build_listener, encode_audio, fit,
                              score_transcripts, sentences, speak, teacher_top_k, transcribe,
                              transcription_examples)

ANSWER_VERSION = 1
"""Bump when the answerer's output changes (a new cache key)."""
REQUESTS = (
    "tell me about a {adj} {noun}",
    "write a short story where {name} finds a {color} {object}",
    "describe a {color} {object}",
    "write a poem about a {adj} {noun}",
    "what does a {noun} do at the {place}",
)
AUDIO_TURN = "<|audio_bos|><|AUDIO|><|audio_eos|>"
"""The user turn of a spoken request: the audio alone, no written instruction."""


@dataclass(frozen=True)
class AnswerConfig:
    n_train: int = 400
    """Training requests (each spoken once, voices cycled)."""
    n_test: int = 40
    """Held-out requests over trained words."""
    n_oov: int = 20
    """Held-out requests each holding a word never trained on."""
    reply_tokens: int = 32
    """The written reply's first tokens each training request learns (the span the first-32 figure judges)."""
    eval_tokens: int = 64
    """Tokens generated per held-out request, spoken and written; "whole" compares up to here."""
    steps: int = 400
    """Updates."""
    batch: int = 8
    """Requests per update."""
    transcribe_share: float = 0.5
    """Share of the training pairs that are transcription (``listen``'s sentences), so that task stays: at 0.25 its
    WER rose from the listener's 12.9% to 35.6%, at 0.5 it is 9.2% (``benchmarks/results/answer_share50.json``)."""
    lr: float = 1e-3
    """AdamW learning rate (cosine to 0)."""
    train_projector: bool = True
    """Train the projector (off: the listener's kept, and with it what the audio frames say to the LM; then the LM's
    low-rank update alone learns to take a spoken request as one: ``lm_rank`` must be set)."""
    train_encoder: bool = False
    """Train the audio encoder with the projector, at ``encoder_lr`` (off: the projector alone). At the projector's
    1e-3 the encoder forgot how to hear: transcription WER 169%, no reply right (docs/LOG.md 2026-12-04)."""
    encoder_lr: float = 1e-5
    """The encoder's AdamW learning rate when it trains (a pretrained encoder's fine-tuning rate)."""
    distill: bool = False
    """Learn the LM's distribution at each reply position given the written request (KL from its top ``top_k``), not
    only its greedy token (CE): the frozen LM's, computed once before training."""
    top_k: int = 64
    """With ``distill``: the teacher's log-probabilities kept per position (SmolLM2's whole rows would be 2.5 GB for
    400 requests)."""
    lm_rank: int = 0
    """Rank of a low-rank update to every linear layer of the LM, merged into its weights before saving (the layout
    unchanged); 0 keeps the LM frozen. It changes the LM's written replies too: the evaluation says by how much."""
    listen_steps: int = ListenConfig.steps
    """The transcribing listener it starts from."""
    seed: int = 0
    """Requests, voices, order."""

    def __post_init__(self) -> None:
        if min(self.n_train, self.n_test, self.reply_tokens, self.eval_tokens, self.steps, self.batch, self.top_k) < 1:
            raise ValueError("n_train, n_test, reply_tokens, eval_tokens, steps, batch, top_k must be >= 1")
        if self.lm_rank < 0:
            raise ValueError("lm_rank must be >= 0 (0: the LM frozen)")
        if not (self.train_projector or self.train_encoder or self.lm_rank):
            raise ValueError("nothing would train: keep train_projector, or set train_encoder or lm_rank")
        if not 0 <= self.transcribe_share < 1 or self.lr <= 0 or self.encoder_lr <= 0:
            raise ValueError("transcribe_share must be in [0, 1), lr and encoder_lr > 0")
        if self.n_transcribe > ListenConfig.n_train:
            raise ValueError(f"transcribe_share {self.transcribe_share} asks for {self.n_transcribe} transcription "
                             f"sentences, the listener has {ListenConfig.n_train}: lower it or n_train")

    @property
    def n_transcribe(self) -> int:
        """Transcription pairs beside the ``n_train`` requests, so that they are ``transcribe_share`` of all."""
        return round(self.transcribe_share / (1 - self.transcribe_share) * self.n_train)


def every_request() -> list[str]:
    """Every request ``REQUESTS`` makes over the trained vocabulary, in a fixed order."""
    from tapdraft.demo.real.listen import ADJS, COLORS, NAMES, NOUNS, OBJECTS, PLACES

    pool = dict(adj=ADJS, noun=NOUNS, name=NAMES, color=COLORS, object=OBJECTS, place=PLACES)
    out = []
    for t in REQUESTS:
        keys = [k for k in pool if "{" + k + "}" in t]
        out += [t.format(**dict(zip(keys, vals))) for vals in itertools.product(*(pool[k] for k in keys))]
    return out


def spoken_requests(out: Path, train: int, validation: int, held_out: int, seed: int = 1,
                    progress=None) -> dict[str, list[dict]]:
    """Spoken requests for a drafter's data, as conversations for ``tapdraft regenerate`` (the reply is the
    target's to write), wavs under ``out/audio``. ``held_out`` requests are ones neither the answerer (train or
    test) nor ``train`` / ``validation`` hold; those two take the other requests in every voice (a request spoken
    by another voice is another utterance), so their count may exceed the requests'."""
    from tapdraft.demo.real.listen import _spoken

    cfg = AnswerConfig()
    taken = set().union(*(requests(cfg)[k] for k in ("train", "test")))
    pool = every_request()
    random.Random(seed).shuffle(pool)
    fresh = [s for s in pool if s not in taken]
    if len(fresh) < held_out:
        raise ValueError(f"the templates hold {len(fresh)} requests the answerer did not train on; asked for "
                         f"{held_out} held out: ask for fewer")
    rest = [s for s in pool if s not in fresh[:held_out]]
    voiced = [(s, v) for v in range(len(VOICES)) for s in rest]
    if len(voiced) < train + validation:
        raise ValueError(f"the templates hold {len(voiced)} spoken requests to train on; asked for "
                         f"{train + validation}: ask for fewer")
    picks = {"train": voiced[:train], "validation": voiced[train:train + validation], "held_out": fresh[:held_out]}
    return _spoken(out, picks, progress, system=None, prompt="", label="request")


def requests(cfg: AnswerConfig) -> dict[str, list[str]]:
    """The train, held-out (``test``) and out-of-vocabulary (``oov``) requests: disjoint, a function of the seed."""
    return sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed, REQUESTS)


def speak_all(texts: dict[str, list[str]], voice: Iterator[tuple[str, int]]) -> dict[str, list[np.ndarray]]:
    """Every split's texts spoken in order, each in the next of ``voice``'s voices: a benchmark that speaks
    ``requests(cfg)`` from a fresh ``itertools.cycle(VOICES)`` hears the held-out audio the answerer was judged on."""
    return {k: [speak(s, *next(voice)) for s in v] for k, v in texts.items()}


def prompt_text(tok, request: str | None) -> str:
    """The chat prompt of a written request, or of a spoken one (``None``: the audio placeholder alone)."""
    return tok.apply_chat_template([{"role": "user", "content": AUDIO_TURN if request is None else request}],
                                   tokenize=False, add_generation_prompt=True)


def _cut(ids: list[int], end: int) -> list[int]:
    return ids[: ids.index(end) + 1] if end in ids else ids


def written_replies(model, tok, texts: list[str], max_new_tokens: int, batch: int = 16) -> list[list[int]]:
    """The LM's greedy replies to the written requests (ids, through ``<|im_end|>`` when the reply ends), batched
    with left padding: training targets. Held-out targets use ``reply`` one at a time, as the spoken side runs."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    side, tok.padding_side = tok.padding_side, "left"
    out = []
    try:
        for i in range(0, len(texts), batch):
            enc = tok([prompt_text(tok, t) for t in texts[i:i + batch]], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            with torch.no_grad():
                g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=end)
            out += [_cut(row.tolist(), end) for row in g[:, enc["input_ids"].shape[1]:]]
    finally:
        tok.padding_side = side
    return out


def reply(model, proc, request: str | None, wave: np.ndarray | None, max_new_tokens: int) -> list[int]:
    """One greedy reply's ids: to the written ``request``, or (``request`` None) to the spoken ``wave``."""
    tok = proc.tokenizer
    text = prompt_text(tok, request)
    if wave is None:
        inp = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        inp = proc(text=text, audio=[wave], sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        g = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False)
    return _cut(g[0, inp["input_ids"].shape[1]:].tolist(), tok.convert_tokens_to_ids("<|im_end|>"))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def score_replies(written: list[list[int]], spoken: list[list[int]], first: int = 32, tok=None) -> dict:
    """How often the spoken reply equals the written one over the ``first`` tokens and whole, the mean agreeing
    prefix, and whether each reply follows its audio (a longer prefix with its own request's written reply than
    with the next request's, counted where the two written replies differ there)."""
    n = len(written)
    cps = [common_prefix(w, s) for w, s in zip(written, spoken)]
    follows = sum(common_prefix(written[i], spoken[i]) > common_prefix(written[(i + 1) % n], spoken[i])
                  for i in range(n) if written[i][:first] != written[(i + 1) % n][:first])
    judged = sum(written[i][:first] != written[(i + 1) % n][:first] for i in range(n))
    out = {"n": n, f"first_{first}": sum(w[:first] == s[:first] for w, s in zip(written, spoken)) / n,
           "whole": sum(w == s for w, s in zip(written, spoken)) / n, "mean_prefix_tokens": float(np.mean(cps)),
           "follows_audio": f"{follows}/{judged}"}
    if tok is not None:
        out["examples"] = [{"written": tok.decode(w), "spoken": tok.decode(s)}
                           for w, s in list(zip(written, spoken))[:4]]
    return out


LM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LowRank(torch.nn.Module):
    """A weight's low-rank update, W + B A (B starts at zero: the model starts as it was)."""

    def __init__(self, weight: torch.Tensor, rank: int) -> None:
        super().__init__()
        out_f, in_f = weight.shape
        self.A = torch.nn.Parameter(torch.randn(rank, in_f, dtype=weight.dtype) / in_f ** 0.5)
        self.B = torch.nn.Parameter(torch.zeros(out_f, rank, dtype=weight.dtype))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.B @ self.A


def add_low_rank(lm: torch.nn.Module, rank: int) -> list[torch.nn.Parameter]:
    """A ``LowRank`` on every ``LM_LINEARS`` weight of ``lm``; the new parameters."""
    from torch.nn.utils import parametrize

    params = []
    for name, mod in lm.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LM_LINEARS:
            update = LowRank(mod.weight, rank)
            parametrize.register_parametrization(mod, "weight", update)
            params += [update.A, update.B]
    return params


def merge_low_rank(lm: torch.nn.Module) -> int:
    """Fold every ``LowRank`` into its weight (plain ``nn.Linear`` again, the checkpoint's names); how many."""
    from torch.nn.utils import parametrize

    merged = 0
    for mod in lm.modules():
        if parametrize.is_parametrized(mod, "weight"):
            parametrize.remove_parametrizations(mod, "weight", leave_parametrized=True)
            merged += 1
    return merged


def answer_examples(tok, replies: list[list[int]], first_audio: int, reply_tokens: int,
                    teachers: list[TopK] | None = None) -> list[Example]:
    """The answering task's pairs: the spoken prompt, the written request's reply (its first ``reply_tokens``),
    with ``teachers`` each its teacher over those tokens."""
    prompt = torch.tensor(tok(prompt_text(tok, None), add_special_tokens=False)["input_ids"])
    return [Example(first_audio + i, prompt, torch.tensor(r[:reply_tokens]), None if teachers is None else teachers[i])
            for i, r in enumerate(replies)]


def written_teachers(model, tok, requests: list[str], replies: list[list[int]], reply_tokens: int,
                     k: int) -> list[TopK]:
    """The frozen LM's top-``k`` over each written request's reply (``listen.teacher_top_k``)."""
    lm, head = model.model.language_model, model.lm_head
    return [teacher_top_k(lm, head, torch.tensor(tok(prompt_text(tok, q), add_special_tokens=False)["input_ids"]),
                          torch.tensor(r[:reply_tokens]), k) for q, r in zip(requests, replies)]


def train_answerer(cfg: AnswerConfig, out: Path, listener: Path, log=print) -> dict:
    """The whole item: speak the requests, write the LM's replies, train, save, reload, evaluate."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    t0 = time.time()
    asked = requests(cfg)
    heard = sentences(ListenConfig.n_train, ListenConfig.n_test, ListenConfig.n_oov, ListenConfig.seed)
    n_transcribe = cfg.n_transcribe
    voice = itertools.cycle(VOICES)
    waves = speak_all(asked, voice)
    heard_waves = {k: [speak(s, *next(voice)) for s in heard[k][:n]]
                   for k, n in (("train", n_transcribe), ("test", len(heard["test"])))}
    log(f"synthesised {sum(map(len, waves.values())) + sum(map(len, heard_waves.values()))} utterances in "
        f"{time.time() - t0:.0f}s")
    model = Qwen2AudioForConditionalGeneration.from_pretrained(listener, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(listener)
    tok = proc.tokenizer
    train_replies = written_replies(model, tok, asked["train"], cfg.reply_tokens)
    held = {k: [reply(model, proc, t, None, cfg.eval_tokens) for t in asked[k]] for k in ("test", "oov")}
    log(f"wrote the LM's replies in {time.time() - t0:.0f}s")
    tower = model.model.audio_tower
    train_waves = waves["train"] + heard_waves["train"]
    audio = (audio_inputs(tower, train_waves, proc.feature_extractor) if cfg.train_encoder
             else encode_audio(model, train_waves, proc.feature_extractor))
    teachers = (written_teachers(model, tok, asked["train"], train_replies, cfg.reply_tokens, cfg.top_k)
                if cfg.distill else None)  # before any update: the LM's own, as it was
    examples = (answer_examples(tok, train_replies, 0, cfg.reply_tokens, teachers)
                + transcription_examples(tok, heard["train"][:n_transcribe], first_audio=cfg.n_train))
    params = [{"params": list(model.model.multi_modal_projector.parameters())}] if cfg.train_projector else []
    if cfg.train_encoder:
        params.append({"params": list(tower.parameters()), "lr": cfg.encoder_lr})
    torch.manual_seed(cfg.seed)
    if cfg.lm_rank:
        params.append({"params": add_low_rank(model.model.language_model, cfg.lm_rank)})
    losses = fit(model, examples, audio, params, cfg.steps, cfg.batch, cfg.lr, cfg.seed, log)
    merge_low_rank(model.model.language_model)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    for f in listener.glob("LICENSE*"):
        shutil.copy(f, out / f.name)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(out)
    answers = {k: score_replies(held[k], [reply(model, proc, None, w, cfg.eval_tokens) for w in waves[k]],
                                tok=tok) for k in ("test", "oov")}
    if cfg.lm_rank:  # the LM changed: how far its own written replies moved from the frozen LM's
        answers["written_after"] = score_replies(held["test"], [reply(model, proc, t, None, cfg.eval_tokens)
                                                                for t in asked["test"]])
    info = {"config": asdict(cfg), "final_loss": float(np.mean(losses[-20:])), "answers_held_out": answers["test"],
            "answers_out_of_vocabulary": answers["oov"],
            "transcription_held_out": score_transcripts(heard["test"],
                                                        transcribe(model, proc, heard_waves["test"])),
            "train_seconds": round(time.time() - t0),
            "written_replies_after_vs_before": answers.get("written_after"),
            "trained": " + ".join(["multi_modal_projector"] * cfg.train_projector + ["audio_tower"] * cfg.train_encoder
                                  + [f"the LM at rank {cfg.lm_rank}, merged"] * bool(cfg.lm_rank)),
            "starts_from": listener.name}
    log(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=1))
    return info


def build_answerer(root: str | Path | None = None, cfg: AnswerConfig | None = None,
                   log=print) -> tuple[Path, dict]:
    """The answering speech LLM, cached as ``<root>/smollm2-whisper-tiny-answer-<key>``."""
    from tapdraft.demo.real.build import DEFAULT_ROOT, cached_dir

    cfg = cfg or AnswerConfig()
    listener, _ = build_listener(root, ListenConfig(steps=cfg.listen_steps), log)
    root = Path(root) if root is not None else DEFAULT_ROOT
    key = hashlib.sha256(f"{listener.name}:{ANSWER_VERSION}:{json.dumps(asdict(cfg), sort_keys=True)}".encode())
    return cached_dir(root, "smollm2-whisper-tiny-answer", key.hexdigest()[:12],
                      lambda d: train_answerer(cfg, d, listener, log))
