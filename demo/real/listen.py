"""Teach the real-parts speech LLM to listen: transcription of espeak-ng speech, training only the projector.

    task        5 sentence templates over a closed vocabulary (``VOCAB``); the train and held-out sentences
                are disjoint; an out-of-vocabulary set uses the same templates with words never trained on
    speech      espeak-ng (22,050 Hz, resampled to 16 kHz by FFT), a few voices and speeds
    training    the encoder's outputs are cached once (the padded frames masked, exactly as the model and
                the project's ``Qwen2AudioTarget`` run it); only the projector (384 -> 576, 221,760
                parameters) learns, through the frozen SmolLM2, on the reply tokens alone
    evaluation  the saved directory is reloaded as ``Qwen2AudioForConditionalGeneration`` + its processor and
                decodes greedily: WER on held-out in-vocabulary and out-of-vocabulary utterances, and the
                audio-swap check (the same prompt with another utterance's audio must give that one's words)

Outputs a model directory with the trained projector (cached like ``build.py``'s) and ``listen.json``
beside the weights with the numbers.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from tapdraft.demo.real.build import DEFAULT_ROOT, build_key, build_real_targets, cached_dir, log_mel

LISTEN_VERSION = 1
PROMPT = "Transcribe the audio."
SYSTEM = "You are a speech recognizer."

NOUNS = ["cat", "dog", "bird", "fish", "horse", "teacher", "doctor", "farmer", "child", "pilot"]
ADJS = ["small", "happy", "old", "quiet", "brave", "tired"]
VERBS = ["sees", "likes", "follows", "helps", "finds", "calls"]
COLORS = ["red", "blue", "green", "yellow", "black", "white"]
OBJECTS = ["pen", "cup", "book", "chair", "door", "ball", "lamp", "coat"]
ACTIONS = ["open", "close", "move", "clean", "bring", "paint"]
NAMES = ["anna", "peter", "maria", "john", "lucy", "tom"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]
PLACES = ["bank", "school", "station", "market", "church", "bridge"]
DIRS = ["left", "right"]
TEMPLATES = [
    "the {adj} {noun} {verb} the {noun2}",
    "please {action} the {color} {object}",
    "{name} has {number} {color} {object}s",
    "{name} turns {dir} at the {place}",
    "the {noun} is very {adj}",
]
OOV = dict(noun=["rabbit", "nurse", "sailor"], adj=["angry", "gentle"], verb=["watches", "pushes"],
           color=["purple", "orange"], object=["window", "bottle"], action=["carry", "break"],
           name=["oliver", "sofia"], number=["ten", "twelve"], place=["hospital", "library"], dir=["back"])
VOICES = [("en-us", 160), ("en-us", 140), ("en", 170), ("en-us+f3", 150), ("en+m3", 155)]


def _fill(template: str, rng: random.Random, pool: dict[str, list[str]]) -> str:
    vals = {k: rng.choice(v) for k, v in pool.items()}
    vals["noun2"] = rng.choice(pool["noun"])
    return template.format(**vals)


def sentences(n_train: int, n_test: int, n_oov: int, seed: int = 0,
              templates: list[str] | tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """Disjoint train and held-out sentences over the vocabulary, from ``templates`` (default: the transcription
    task's ``TEMPLATES``); OOV sentences each hold at least one unseen word."""
    templates = templates or TEMPLATES
    rng = random.Random(seed)
    pool = dict(noun=NOUNS, adj=ADJS, verb=VERBS, color=COLORS, object=OBJECTS, action=ACTIONS, name=NAMES,
                number=NUMBERS, place=PLACES, dir=DIRS)
    oov_pool = {k: OOV.get(k, v) for k, v in pool.items()}
    seen: set[str] = set()
    out: dict[str, list[str]] = {"test": [], "train": [], "oov": []}
    for split, n in (("test", n_test), ("train", n_train), ("oov", n_oov)):
        for _ in range(100 * n):
            if len(out[split]) == n:
                break
            s = _fill(rng.choice(templates), rng, oov_pool if split == "oov" else pool)
            if s not in seen and (split != "oov" or VOCAB_OOV & set(s.split())):
                seen.add(s)
                out[split].append(s)
        if len(out[split]) < n:
            raise ValueError(f"the templates hold fewer than {n} distinct {split} sentences")
    return out


VOCAB_OOV = {w for v in OOV.values() for w in v}


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling by FFT (no scipy/torchaudio here)."""
    n_out = int(round(len(x) * sr_out / sr_in))
    X = np.fft.rfft(x)
    Y = np.zeros(n_out // 2 + 1, dtype=X.dtype)
    k = min(len(X), len(Y))
    Y[:k] = X[:k]
    return (np.fft.irfft(Y, n_out) * (n_out / len(x))).astype(np.float32)


def speak(text: str, voice: str, speed: int) -> np.ndarray:
    """espeak-ng's speech for ``text`` as 16 kHz float32."""
    if shutil.which("espeak-ng") is None:
        raise FileNotFoundError("espeak-ng is not installed: apt-get install -y espeak-ng")
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", f.name, text], check=True)
        x, sr = sf.read(f.name, dtype="float32")
    return resample(x, sr, 16000)


def wer(ref: str, hyp: str) -> tuple[int, int]:
    """(word edits, reference words)."""
    r, h = ref.split(), hyp.split()
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)], len(r)


def normalise(s: str) -> str:
    return " ".join("".join(c for c in s.lower() if c.isalnum() or c.isspace()).split())


@dataclass(frozen=True)
class ListenConfig:
    n_train: int = 490
    """Training sentences (each spoken once, voices cycled)."""
    n_test: int = 30
    """Held-out in-vocabulary sentences."""
    n_oov: int = 20
    """Out-of-vocabulary sentences."""
    steps: int = 300
    """Projector updates."""
    batch: int = 8
    """Utterances per update."""
    lr: float = 2e-3
    """AdamW learning rate (cosine to 0)."""
    seed: int = 0
    """Sentences, voices, order."""

    def __post_init__(self) -> None:
        if min(self.n_train, self.n_test, self.steps, self.batch) < 1 or self.lr <= 0:
            raise ValueError("n_train, n_test, steps, batch must be >= 1 and lr > 0")


def _conversation(reply: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"<|audio_bos|><|AUDIO|><|audio_eos|>{PROMPT}"}]
    return msgs + ([{"role": "assistant", "content": reply}] if reply is not None else [])


def _prompt_text(tok) -> str:
    return tok.apply_chat_template(_conversation(None), tokenize=False) + "<|im_start|>assistant\n"


def audio_inputs(tower, waves: list[np.ndarray], fe) -> list[dict]:
    """Each wave's encoder input over its valid frames (+2 padded mel frames the convolutions read) instead of all
    3000, with its mask: ``tower_frames`` turns one into the frames the model computes (masked keys add nothing)
    at ~1/10 of the CPU time for 3 s of speech. Cached once when the encoder itself trains."""
    out = []
    for w in waves:
        m = log_mel([w], fe)
        feat_len, out_len = tower._get_feat_extract_output_lengths(m["feature_attention_mask"].sum(-1))
        n = int(feat_len[0]) + 1  # one padded encoder frame, masked
        out.append(audio_input(tower, m["input_features"][:, :, : 2 * n], int(feat_len[0]), int(out_len[0])))
    return out


def audio_input(tower, x: torch.Tensor, feat_len: int, n_out: int) -> dict:
    """One ``audio_inputs`` item from its log-mel frames ``x`` [1, mels, 2 (feat_len + 1)], the encoder frames they
    hold and the pooled frames they give: what a cache of them (``x``, ``feat_len``, ``n_out``) rebuilds one from."""
    from transformers.masking_utils import create_bidirectional_mask

    n = feat_len + 1
    valid = (torch.arange(n)[None, :] < feat_len).long()
    return {"x": x, "feat_len": feat_len, "n_out": n_out,
            "mask": create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, n, 1),
                                              attention_mask=valid)}


def tower_frames(tower, inp: dict) -> torch.Tensor:
    """The audio tower's pooled frames [T, D] for one ``audio_inputs`` item; differentiable when grad is on."""
    F = torch.nn.functional
    n = inp["mask"].shape[-1]
    h = F.gelu(tower.conv2(F.gelu(tower.conv1(inp["x"])))).permute(0, 2, 1) + tower.embed_positions.weight[:n]
    for layer in tower.layers:
        h = layer(h, inp["mask"])
        h = h[0] if isinstance(h, tuple) else h
    h = tower.layer_norm(tower.avg_pooler(h.permute(0, 2, 1)).permute(0, 2, 1))
    return h[0, : inp["n_out"]]


def encode_audio(model, waves: list[np.ndarray], fe) -> list[torch.Tensor]:
    """Each wave's encoder frames (before the projector), as the model computes them with the padded frames
    masked (``audio_inputs``)."""
    tower = model.model.audio_tower
    with torch.no_grad():
        return [tower_frames(tower, inp).clone() for inp in audio_inputs(tower, waves, fe)]


def encode_audio_full(model, waves: list[np.ndarray], fe) -> list[torch.Tensor]:
    """``encode_audio`` the model's way (all 3000 mel frames, padded ones masked): its reference."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = model.model.audio_tower
    out = []
    for w in waves:
        m = log_mel([w], fe)
        feat_len, out_len = tower._get_feat_extract_output_lengths(m["feature_attention_mask"].sum(-1))
        n_max = (m["input_features"].shape[-1] - 2) // 2 + 1
        valid = (torch.arange(n_max)[None, :] < feat_len[:, None]).long()
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, n_max, 1),
                                         attention_mask=valid)
        with torch.no_grad():
            h = tower(m["input_features"], attention_mask=mask).last_hidden_state
        out.append(h[0, : int(out_len[0])].clone())
    return out


class TopK(NamedTuple):
    """A teacher's top-k per reply position: log-probabilities [L, k] (over the whole vocabulary) and their ids."""
    logp: torch.Tensor
    ids: torch.Tensor


@dataclass(frozen=True)
class Example:
    """One training pair: a prompt holding one audio placeholder, the audio it stands for, the reply to learn."""
    audio: int
    """Index into the audio list ``fit`` is given."""
    prompt: torch.Tensor
    """Token ids with one ``<|AUDIO|>``, ending with the assistant turn's header."""
    reply: torch.Tensor
    """Reply ids (with ``<|im_end|>`` when the reply is whole)."""
    teacher: TopK | None = None
    """The frozen LM's top-k log-probabilities at each reply position given the written request (``teacher_top_k``):
    with one, each position learns that distribution (KL from it), not only the reply's token (CE). Computed once,
    before anything trains: a low-rank update to the LM then never moves its own teacher."""


def fit(model, examples: list[Example], audio: list, params: list, steps: int, batch: int, lr: float, seed: int,
        log=print, resume: Path | None = None, every: int = 100, frozen_dtype: torch.dtype = torch.float32
        ) -> list[float]:
    """Train ``params`` of ``model`` (all else frozen) on ``examples`` through the language model, on the reply
    positions alone (CE, or KL from the example's ``teacher``), their mean; the losses.
    ``params`` are parameters or AdamW groups (``{"params": [...], "lr": ...}``: a group's lr is scaled by the same
    cosine). ``audio[i]`` is a tensor of encoder frames (the encoder frozen and run once; a half-precision cache is
    widened per step) or an ``audio_inputs`` item (the encoder runs each step, with grad when its parameters are in
    ``params``). With ``resume``, the trained parameters, the optimiser, the schedule, the example order and the
    losses are saved there every ``every`` steps and at the end, and a rerun continues from the file: the same steps
    as one uninterrupted run. ``frozen_dtype=torch.bfloat16`` runs the frozen language model and head forward and
    backward in a bf16 copy (the model's own weights untouched; the trained parameters, their gradients and the loss
    in fp32): on a CPU with bf16 matrix units several times faster; refused when a trained parameter is in the LM."""
    lm = model.model.language_model
    head = model.lm_head
    proj = model.model.multi_modal_projector
    tower = model.model.audio_tower
    for p in model.parameters():
        p.requires_grad_(False)
    for p in (q for g in params for q in (g["params"] if isinstance(g, dict) else [g])):
        p.requires_grad_(True)
    if frozen_dtype != torch.float32:
        if any(p.requires_grad for p in (*lm.parameters(), *head.parameters())):
            raise ValueError("fit: frozen_dtype applies to a frozen language model; a parameter of it is trained")
        lm, head = copy.deepcopy(lm).to(frozen_dtype), copy.deepcopy(head).to(frozen_dtype)
        lm.config._attn_implementation = "eager"  # CPU's bf16 SDPA backward is slower than eager's matmuls
    audio_id = model.config.audio_token_id
    emb = lm.get_input_embeddings()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    trained = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]
    start = 0
    if resume is not None and resume.is_file():
        st = torch.load(resume, weights_only=False)
        if st["steps"] != steps or len(st["params"]) != len(trained):
            raise ValueError(f"{resume} is a run of {st['steps']} steps over {len(st['params'])} tensors, not "
                             f"{steps} over {len(trained)}: remove it to start again")
        with torch.no_grad():
            for q, v in zip(trained, st["params"]):
                q.copy_(v)
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        rng.setstate(st["rng"])
        order, losses, start = st["order"], st["losses"], st["step"]
        log(f"resumed at step {start} from {resume}")
    t0 = time.time()
    for step in range(start, steps):
        if len(order) < batch:
            order += rng.sample(range(len(examples)), len(examples))
        idx, order = order[:batch], order[batch:]
        seqs, labels, teachers = [], [], []
        for i in idx:
            ex = examples[i]
            teachers.append(ex.teacher)
            a = audio[ex.audio]
            frames = a.float() if isinstance(a, torch.Tensor) else tower_frames(tower, a)
            at = int((ex.prompt == audio_id).nonzero()[0, 0])
            with torch.no_grad():
                pre_e, post_e, r_e = emb(ex.prompt[:at]), emb(ex.prompt[at + 1:]), emb(ex.reply)
            x = torch.cat([pre_e, proj(frames).to(frozen_dtype), post_e, r_e])
            y = torch.full((x.shape[0],), -100)
            y[-len(ex.reply) - 1: -1] = ex.reply  # position t predicts token t+1
            seqs.append(x)
            labels.append(y)
        T = max(s.shape[0] for s in seqs)
        x_BTH = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, T - s.shape[0])) for s in seqs])
        y_BT = torch.stack([torch.nn.functional.pad(y, (0, T - y.shape[0]), value=-100) for y in labels])
        am = torch.stack([(torch.arange(T) < s.shape[0]).long() for s in seqs])
        h = lm(inputs_embeds=x_BTH, attention_mask=am).last_hidden_state
        logits = head(h[y_BT != -100])
        if all(t is None for t in teachers):
            loss = torch.nn.functional.cross_entropy(logits.float(), y_BT[y_BT != -100])
        else:
            lengths = [len(examples[i].reply) for i in idx]
            loss = reply_losses(logits.float(), y_BT[y_BT != -100], lengths, teachers).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:4d}  loss {np.mean(losses[-20:]):.4f}  {time.time() - t0:.0f}s")
        if resume is not None and ((step + 1) % every == 0 or step == steps - 1):
            _save_state(resume, {"steps": steps, "step": step + 1, "params": [q.detach().clone() for q in trained],
                                 "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": rng.getstate(),
                                 "order": order, "losses": losses})
    return losses


def _save_state(path: Path, state: dict) -> None:
    from tapdraft.common.atomic import staged

    with staged(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)


def teacher_top_k(lm, head, prompt: torch.Tensor, reply: torch.Tensor, k: int) -> TopK:
    """The LM's top-``k`` log-probabilities at the positions that predict ``reply``'s L tokens after the written
    ``prompt`` (no grad), normalised over the whole vocabulary."""
    ids = torch.cat([prompt, reply])
    with torch.no_grad():
        h = lm(input_ids=ids[None]).last_hidden_state[0, len(prompt) - 1: len(ids) - 1]
        top = torch.log_softmax(head(h).float(), -1).topk(k, -1)
    return TopK(top.values, top.indices)


def reply_losses(logits_NV: torch.Tensor, y_N: torch.Tensor, lengths: list[int],
                 teachers: list[TopK | None]) -> torch.Tensor:
    """Per reply position [N]: CE on the token, or where the example has a teacher the KL from its top-k renormalised
    (p over its k ids) to the student's log-probabilities at those ids, sum_j p_j (log p_j - log q_j): >= 0, and 0
    only when the student puts the teacher's renormalised mass on the same ids. Rows are the examples' replies in
    order, ``lengths[i]`` of them each; ``teachers[i]`` covers those ``lengths[i]`` positions."""
    logp = torch.log_softmax(logits_NV, -1)
    out, at = [], 0
    for n, t in zip(lengths, teachers):
        rows = logp[at:at + n]
        if t is None:
            out.append(-rows.gather(1, y_N[at:at + n, None])[:, 0])
        else:
            p = torch.log_softmax(t.logp, -1)
            out.append((p.exp() * (p - rows.gather(1, t.ids))).sum(-1))
        at += n
    assert at == logits_NV.shape[0], (at, logits_NV.shape)
    return torch.cat(out)


def transcription_examples(tok, texts: list[str], first_audio: int = 0) -> list[Example]:
    """The transcription task's pairs: the listener's prompt, the sentence as the reply."""
    prompt = torch.tensor(tok(_prompt_text(tok), add_special_tokens=False)["input_ids"])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return [Example(first_audio + i, prompt, torch.tensor(tok(t, add_special_tokens=False)["input_ids"] + [end]))
            for i, t in enumerate(texts)]


def train_projector(model, tok, frames: list[torch.Tensor], texts: list[str], cfg: ListenConfig,
                    log=print) -> list[float]:
    """Train ``model``'s projector in place on (encoder frames, transcript) pairs; the losses."""
    return fit(model, transcription_examples(tok, texts), frames,
               list(model.model.multi_modal_projector.parameters()), cfg.steps, cfg.batch, cfg.lr, cfg.seed, log)


def transcribe(model, proc, waves: list[np.ndarray], max_new_tokens: int = 24) -> list[str]:
    """Greedy replies of the saved model to the transcription prompt, one utterance at a time."""
    text = _prompt_text(proc.tokenizer)
    out = []
    for w in waves:
        inp = proc(text=text, audio=[w], sampling_rate=16000, return_tensors="pt")
        with torch.no_grad():
            g = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(proc.tokenizer.decode(g[0, inp["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def score_transcripts(refs: list[str], hyps: list[str]) -> dict:
    """WER over all words, exact matches, and the first five pairs (both normalised: case and punctuation off)."""
    e = [wer(normalise(r), normalise(h)) for r, h in zip(refs, hyps)]
    return {"wer": sum(a for a, _ in e) / max(1, sum(b for _, b in e)),
            "exact": sum(normalise(r) == normalise(h) for r, h in zip(refs, hyps)), "n": len(refs),
            "examples": [{"ref": r, "hyp": h} for r, h in list(zip(refs, hyps))[:5]]}


def train_listener(cfg: ListenConfig, out: Path, speech: Path, log=print) -> dict:
    """The whole item: synthesise, cache encoder outputs, train the projector, save, reload, evaluate."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    t0 = time.time()
    data = sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed)
    voice = itertools.cycle(VOICES)
    waves = {k: [speak(s, *next(voice)) for s in v] for k, v in data.items()}
    log(f"synthesised {sum(map(len, waves.values()))} utterances in {time.time() - t0:.0f}s")
    model = Qwen2AudioForConditionalGeneration.from_pretrained(speech, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(speech)
    frames = encode_audio(model, waves["train"], proc.feature_extractor)
    log(f"encoded the training audio in {time.time() - t0:.0f}s")
    torch.manual_seed(cfg.seed)
    losses = train_projector(model, proc.tokenizer, frames, data["train"], cfg, log)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    for f in speech.glob("LICENSE*"):
        shutil.copy(f, out / f.name)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(out)
    res = {k: score_transcripts(data[k], transcribe(model, proc, waves[k])) for k in ("test", "oov")}
    a, b = waves["test"][:10], waves["test"][10:20]
    ha, hb = transcribe(model, proc, a), transcribe(model, proc, b)
    follows = sum(normalise(x) != normalise(y) and wer(normalise(data["test"][10 + i]), normalise(y))[0]
                  < wer(normalise(data["test"][i]), normalise(y))[0] for i, (x, y) in enumerate(zip(ha, hb)))
    info = {"config": cfg.__dict__, "final_loss": float(np.mean(losses[-20:])), "in_vocabulary": res["test"],
            "out_of_vocabulary": res["oov"], "audio_swap_follows_audio": f"{follows}/10",
            "train_seconds": round(time.time() - t0), "trained": "multi_modal_projector only"}
    log(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=1))
    return info


def speech_splits(out: Path, train: int, validation: int, held_out: int, seed: int = 1,
                  progress=None) -> dict[str, list[dict]]:
    """Transcription requests for a drafter's data: spoken sentences of the listener's task as conversations for
    ``tapdraft regenerate`` (the prompt the listener was trained on; the reply is the target's to write), their
    16 kHz wavs under ``out/audio``. ``held_out`` sentences are ones neither the listener nor ``train`` /
    ``validation`` hold, so a drafter is judged on speech it did not see. Voices cycle as in training."""
    cfg = ListenConfig()
    listener = sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed)
    taken = set(listener["train"]) | set(listener["test"])
    pool = sentences(train + validation + held_out + len(taken), 0, 0, seed)["train"]
    fresh = [s for s in pool if s not in taken]
    if len(fresh) < held_out:
        raise ValueError(f"the templates hold {len(fresh)} sentences the listener did not train on; asked for "
                         f"{held_out} held out: ask for fewer")
    rest = [s for s in pool if s not in fresh[:held_out]]
    picks = {"train": rest[:train], "validation": rest[train:train + validation], "held_out": fresh[:held_out]}
    return _spoken(out, picks, progress)


def speech_other(out: Path, n: int, seed: int = 1, progress=None) -> list[dict]:
    """Requests of another kind than ``speech_splits``'s: spoken sentences each holding a word the listener never
    heard (its out-of-vocabulary pool), none of them the listener's own out-of-vocabulary test sentences; wavs
    under ``out/audio`` as ``other-NNNNN.wav``."""
    cfg = ListenConfig()
    taken = set(sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed)["oov"])
    pool = [s for s in sentences(0, 0, n + len(taken), seed)["oov"] if s not in taken]
    return _spoken(out, {"other": pool[:n]}, progress)["other"]


def _spoken(out: Path, picks: dict[str, list], progress=None, system: str | None = SYSTEM,
            prompt: str = PROMPT, label: str = "reference") -> dict[str, list[dict]]:
    """Conversations asking ``prompt`` of each spoken sentence (``system`` first when given), spoken into
    ``out/audio/SPLIT-NNNNN.wav`` (kept across reruns), the sentence under ``label`` (``reference``: what a
    transcript is scored against). A pick is a sentence (voices cycle as in training) or a (sentence, index into
    ``VOICES``) pair."""
    from tapdraft.demo.real.prompts import PENDING
    from tapdraft.common.atomic import staged

    (out / "audio").mkdir(parents=True, exist_ok=True)
    voice = itertools.cycle(VOICES)
    convs: dict[str, list[dict]] = {}
    done, total = 0, sum(map(len, picks.values()))
    for split, items in picks.items():
        convs[split] = []
        for i, item in enumerate(items):
            text, v = (item, next(voice)) if isinstance(item, str) else (item[0], VOICES[item[1]])
            sid = f"{split}-{i:05d}"
            rel = f"audio/{sid}.wav"
            if not (out / rel).exists():
                with staged(out / rel) as tmp:
                    sf.write(tmp, speak(text, *v), 16000, subtype="PCM_16", format="WAV")
            turns = [{"from": "System", "value": system}] if system is not None else []
            convs[split].append({"id": sid, label: text, "conversations": turns + [
                {"from": "User", "type": "text", "value": f"<|AUDIO|>{prompt}", "audio": rel},
                {"from": "Assistant", "type": "text", "value": PENDING}]})
            done += 1
            if progress is not None and done % 200 == 0:
                progress(f"spoke {done}/{total} sentences")
    return convs


def build_listener(root: str | Path | None = None, cfg: ListenConfig | None = None, log=print) -> tuple[Path, dict]:
    """The trained speech LLM, cached as ``<root>/smollm2-whisper-tiny-listen-<key>``."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    cfg = cfg or ListenConfig()
    targets = build_real_targets(root)
    import hashlib

    key = hashlib.sha256(f"{build_key()}:{LISTEN_VERSION}:{json.dumps(cfg.__dict__, sort_keys=True)}".encode())
    return cached_dir(root, "smollm2-whisper-tiny-listen", key.hexdigest()[:12],
                      lambda d: train_listener(cfg, d, targets.speech, log))
