"""A quality target with a real BPE vocabulary: a small Qwen3 causal LM trained briefly on English text.

The demo's 54-word vocabulary lets a rank-256 codebook hold a full bigram table, so drafter families
cannot be ranked on it. This target has a byte-level BPE vocabulary of 8,192 tokens trained on the
Python documentation topics that ship with the interpreter (``pydoc_data.topics``, ~465 kB of
English prose with some code), and is a plain HF causal LM (``Qwen3ForCausalLM.save_pretrained``
plus the tokenizer and a ChatML template that marks assistant turns), so capture loads it with
``load_target`` like any other causal LM.

Conversations: the user asks to continue a passage (``prompt_words`` words of the docs); the
assistant reply is the TARGET'S OWN greedy continuation (so offline greedy tau is exact). The LM is
trained on the same conversation shape with the real continuation, on windows at random offsets of
the first ``corpus_words`` words of the topics. A corpus it can largely memorise in the budget is
deliberate: trained on all 75k words for 3 minutes (loss 4.1) its greedy replies were one phrase
repeated for every prompt ('the "x" is a "x" is ...'); on 3,000 words (loss 1.1) they are
prompt-dependent documentation prose. Drafter-train prompts start in the first 85% of each topic,
validation prompts in the rest, so the drafters are evaluated on continuations they never saw.

:func:`prepare_bpe` builds (or reuses), each step cached in a work directory:

    DIR/target/     the LM, tokenizer and chat template (HF layout)
    DIR/data/       SPLIT.corpus.jsonl (the true continuations) and SPLIT.jsonl, written from it by
                    ``tapdraft regenerate`` (replies = the target's greedy output; SPLIT.regenerate.json)
    DIR/dataset/    captured with the CLI's defaults
    DIR/bpe.json    what each step did (LM training, data, capture)

Full size: 6 layers x 128 wide, 3.3 M parameters (2.1 M of them the untied embedding and lm_head);
240 LM steps took 264 s on one thread of a loaded 2-core machine, replies 52 s, capture 25 s.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from tapdraft.capture.targets.salm.model import CHAT_TEMPLATE

SPECIALS = ("<|pad|>", "<|im_start|>", "<|im_end|>")
PROMPT = "Continue this passage from the Python documentation:\n"


@dataclass(frozen=True)
class BPESize:
    """Tokenizer, LM shape, training budget and data sizes of the BPE quality target."""

    vocab_size: int = 8192
    """BPE vocabulary including the three ChatML specials."""
    hidden: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_steps: int = 240
    """LM training steps (about 1 s each on one idle core)."""
    train_seconds: float = 360.0
    """Wall-clock cap on LM training (a safety net on a loaded machine; the step budget normally ends it)."""
    batch_size: int = 16
    lr: float = 5e-3
    corpus_words: int = 3000
    """Words of documentation the LM is trained on (small enough to be largely memorised in the budget, so
    its greedy replies are real English that depends on the prompt rather than a repeated phrase)."""
    prompt_words: int = 16
    """Words of the passage the user gives."""
    reply_words: int = 24
    """Words of the real continuation the LM is trained to give (replies are the LM's own, capped below)."""
    max_new_tokens: int = 64
    """Greedy reply length cap in tokens when writing the data."""
    train_samples: int = 1000
    val_samples: int = 100

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIALS):
            raise ValueError(f"vocab_size must hold the 256 byte symbols and the specials, got {self.vocab_size}")
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_steps", "batch_size",
                     "prompt_words", "reply_words", "max_new_tokens", "train_samples", "val_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"BPESize.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("BPESize: hidden must be divisible by heads, and heads by kv_heads")


FULL = BPESize()
QUICK = BPESize(vocab_size=1024, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, max_steps=150,
                train_seconds=120.0, batch_size=8, lr=1e-2, max_new_tokens=12, train_samples=12, val_samples=4)
"""Seconds-long, for tests: 150 steps is about where the tiny LM's greedy replies become text that re-tokenizes
to the same ids (after 60 steps none did). Head dim 32: the smallest vLLM's CPU attention serves (16 and 24
are refused), so the serving tests use this shape too."""


# ------------------------------------------------------------------------------------------ text
def corpus(size: BPESize) -> list[list[str]]:
    """The LM's text: whole ``pydoc_data.topics`` entries in key order, whitespace collapsed, until
    ``corpus_words`` words."""
    from pydoc_data.topics import topics

    out, n = [], 0
    for key in sorted(topics):
        if n >= size.corpus_words:
            break
        words = topics[key].split()
        if len(words) >= size.prompt_words + size.reply_words:
            out.append(words)
            n += len(words)
    return out


def windows(texts: Sequence[Sequence[str]], size: BPESize, n: int, *, part: str,
            generator: torch.Generator) -> list[tuple[str, str]]:
    """n (prompt, continuation) windows at random offsets: ``train`` starts in the first 85% of each text,
    ``validation`` in the rest, ``all`` anywhere (LM training)."""
    w = size.prompt_words + size.reply_words
    spans = []
    for i, words in enumerate(texts):
        last = len(words) - w  # last valid start
        cut = int(0.85 * last)
        lo, hi = {"train": (0, cut), "validation": (cut + 1, last), "all": (0, last)}[part]
        spans += [(i, s) for s in range(lo, hi + 1)]
    pick = torch.randint(len(spans), (n,), generator=generator).tolist()
    out = []
    for j in pick:
        i, s = spans[j]
        words = texts[i]
        out.append((" ".join(words[s : s + size.prompt_words]), " ".join(words[s + size.prompt_words : s + w])))
    return out


def corpus_text() -> list[str]:
    """Every topic's text, whitespace collapsed per paragraph (the tokenizer's training corpus)."""
    from pydoc_data.topics import topics

    return [" ".join(p.split()) for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]


def build_bpe_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE fast tokenizer trained on ``texts`` with ChatML specials and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([*texts, PROMPT, "user\nassistant\n"], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def conversation(prompt: str, reply: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": PROMPT + prompt}]
    return msgs if reply is None else [*msgs, {"role": "assistant", "content": reply}]


# ------------------------------------------------------------------------------------------ model
def build_bpe_lm(tok: Any, size: BPESize, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def _batch(tok: Any, convs: Sequence[list[dict[str, str]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on padding) for full conversations."""
    rows = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)] = torch.tensor(r), 1
    return ids, attn, torch.where(attn.bool(), ids, torch.full_like(ids, -100))


def train_bpe_lm(lm: Any, tok: Any, texts: Sequence[Sequence[str]], size: BPESize, *, seed: int = 0,
                 progress: bool = True) -> dict[str, Any]:
    """Next-token CE on whole conversations (prompt and reply) over windows of ``texts`` at random
    offsets, AdamW + cosine, until the time or step cap."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=size.lr, weight_decay=0.01, betas=(0.9, 0.98))
    lm.train()
    t0, step, ema, first = time.perf_counter(), 0, None, None
    with Progress(TextColumn("train BPE target"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                  disable=not progress) as bar:
        task = bar.add_task("train", total=size.max_steps, info="")
        while step < size.max_steps and time.perf_counter() - t0 < size.train_seconds:
            frac = max((time.perf_counter() - t0) / size.train_seconds, step / size.max_steps)
            lr = size.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr
            pairs = windows(texts, size, size.batch_size, part="all", generator=gen)
            ids, attn, labels = _batch(tok, [conversation(*p) for p in pairs])
            loss = lm(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            step += 1
            x = float(loss.detach())
            first = x if first is None else first
            ema = x if ema is None else 0.95 * ema + 0.05 * x
            bar.update(task, completed=step, info=f"step {step}  loss {ema:.3f}")
    lm.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "first_loss": round(first or 0.0, 4),
            "final_loss_ema": round(ema or 0.0, 4)}


# ------------------------------------------------------------------------------------------ data
def write_split(target_dir: Path, pairs: Sequence[tuple[str, str]], path: Path, size: BPESize, *,
                progress: bool = True) -> dict[str, Any]:
    """``path`` (JSONL) with the target's greedy replies, written by ``tapdraft regenerate`` from the corpus
    windows (``SPLIT.corpus.jsonl``: the passage's true continuation as the reply to replace). Empty replies
    and replies that do not re-tokenize to the same ids (BPE can emit a non-canonical split) are dropped
    and counted; replies cut at ``max_new_tokens`` are kept (marked), so every kept reply is token for
    token what the target decodes greedily."""
    from tapdraft.capture.generation import GenerationConfig, ReplyConfig
    from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
    from tapdraft.common.atomic import staged

    src = path.with_name(path.stem + ".corpus.jsonl")
    rows = [{"id": f"{path.stem}-{i:06d}", "conversations": [
        {"from": "User", "type": "text", "value": PROMPT + prompt},
        {"from": "Assistant", "type": "text", "value": cont}]} for i, (prompt, cont) in enumerate(pairs)]
    with staged(src) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = regenerate(RegenerateConfig(
        target=str(target_dir.resolve()), data=str(src.resolve()), out=str(path.resolve()), progress=progress,
        replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=size.max_new_tokens), keep_truncated=True)))
    out = [json.loads(x) for x in path.read_text().splitlines()]
    replies = [r["conversations"][-1]["value"] for r in out]
    return {"prompts": len(rows), "written": len(out), "dropped": doc["counts"]["dropped"],
            "truncated_at_cap": sum(bool(r.get("truncated")) for r in out),
            "distinct_replies": len(set(replies))}


@dataclass
class BPEPaths:
    workdir: Path
    target: Path
    train_manifest: Path
    val_manifest: Path
    dataset: Path
    info: dict[str, Any] = field(default_factory=dict)
    """What each step did, as kept in ``workdir/bpe.json``."""


def prepare_bpe(workdir: str | Path, *, quick: bool = False, seed: int = 0, progress: bool = True,
                size: BPESize | None = None) -> BPEPaths:
    """Build (or reuse) DIR/target, DIR/data and DIR/dataset on one torch thread; ``size`` replaces the
    FULL / QUICK size (a workdir is reused only for the size it was built with)."""
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.demo.data import one_thread, open_workdir

    size = size or (QUICK if quick else FULL)
    root, info_path, info = open_workdir(workdir, "bpe.json", quick=quick, seed=seed, what="BPE target")
    if info.setdefault("size", asdict(size)) != asdict(size):
        raise ValueError(f"{root} holds a BPE target of another size; use another workdir")
    tdir, ddir, dsdir = root / "target", root / "data", root / "dataset"
    with one_thread():
        if not (tdir / "config.json").is_file():
            t0 = time.perf_counter()
            tok = build_bpe_tokenizer(corpus_text(), size.vocab_size)
            info["tokenizer"] = {"vocab_size": len(tok), "seconds": round(time.perf_counter() - t0, 1)}
            lm = build_bpe_lm(tok, size, seed)
            info["train"] = train_bpe_lm(lm, tok, corpus(size), size, seed=seed, progress=progress)
            info["parameters"] = sum(p.numel() for p in lm.parameters())
            tmp = root / "target.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            lm.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            tmp.replace(tdir)
            info_path.write_text(json.dumps(info, indent=2))
        texts = corpus(size)
        ddir.mkdir(parents=True, exist_ok=True)
        for k, (split, n) in enumerate((("train", size.train_samples), ("validation", size.val_samples))):
            if not (ddir / f"{split}.jsonl").is_file():
                g = torch.Generator().manual_seed(seed + 1 + k)
                t0 = time.perf_counter()
                info.setdefault("data", {})[split] = write_split(
                    tdir, windows(texts, size, n, part=split, generator=g), ddir / f"{split}.jsonl", size,
                    progress=progress)
                info["data"][split]["seconds"] = round(time.perf_counter() - t0, 1)
        info_path.write_text(json.dumps(info, indent=2))
        # the CLI's defaults: only where the inputs and output live (that the replies are the target's own
        # comes from the regenerate sidecars beside them)
        cfg = CaptureConfig(target=str(tdir.resolve()), out=str(dsdir),
                            data=(("train", str((ddir / "train.jsonl").resolve())),
                                  ("validation", str((ddir / "validation.jsonl").resolve()))),
                            progress=progress)
        t0 = time.perf_counter()
        manifest = capture(cfg, target=None)
        info["capture"] = {**manifest.get("run_stats", {}), "seconds": round(time.perf_counter() - t0, 1)}
        info_path.write_text(json.dumps(info, indent=2))
    return BPEPaths(root, tdir, ddir / "train.jsonl", ddir / "validation.jsonl", dsdir, info)
