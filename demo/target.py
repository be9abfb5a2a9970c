"""The demo target: a small SALM on a closed word vocabulary, trained in about 90 CPU seconds.

Sizes (full demo): LM Qwen3 6 layers x 96 wide, vocab ~60; encoder FastConformer 1 layer x 64;
~0.8 M parameters; a 2-layer draft's default taps are [1, 3] plus the last layer, 5. Training adds
an auxiliary per-frame digit classifier on the adapter output (dense supervision for the random-init
encoder; discarded afterwards): in 300 steps without it the model learned the templates but not
which digit a tone is (11% of greedy replies equal the templated answer); with it 58% (4-layer
trial: repeat/first/last/count 100%, sums 23%). ``QUICK`` shrinks everything to a seconds-long run
for tests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from tapdraft.capture.targets.base import DEFAULT_PLACEHOLDER
from tapdraft.capture.targets.salm.model import CHAT_TEMPLATE, SALM, SPECIAL_TOKENS, AudioConfig
from tapdraft.demo.task import SAMPLE_RATE, TASKS, _tones, frame_labels, vocabulary
from tapdraft.common.progress import Progress

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


def build_word_tokenizer(words: Sequence[str], *, placeholder: str = DEFAULT_PLACEHOLDER):
    """A word-level tokenizer over ``words`` (+ ChatML specials + the placeholder) with the chat template.

    Word-level on a closed vocabulary keeps the demo's LM tiny; any HF fast tokenizer works with the
    SALM with a chat template (capture.template derives the supervised tokens from any template).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [t if t != DEFAULT_PLACEHOLDER else placeholder for t in SPECIAL_TOKENS]
    base = ["user", "assistant", "system"]
    vocab: dict[str, int] = {}
    for w in [*specials, *base, *words]:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<|unk|>",
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", placeholder],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


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
    with Progress("train demo target", size.train_seconds, enabled=progress, fmt_count=lambda x: f"{x:.0f}s") as bar:
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
            bar.update(min(time.perf_counter() - t0, size.train_seconds), f"step {step}  loss {ema:.3f}")
    salm.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "final_loss_ema": round(ema or 0.0, 4),
            "final_frame_loss": round(float(aux_loss.detach()), 4) if step else None}
