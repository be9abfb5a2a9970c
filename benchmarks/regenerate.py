"""Regeneration cost: ``tapdraft regenerate`` vs a plain ``model.generate`` loop, and fused vs two-pass capture.

Two comparisons, each interleaved (A B A B ...), median of the pairs, absolute seconds beside:

    generate   A  capture.replies.regenerate.regenerate into a fresh file: prompt preparation (template, audio
                  decode, encoder), length buckets, batched KV-cache decoding, drop checks, part files,
                  keyed merge, sidecar. The target is loaded once, outside the timing.
               B  the plain loop a user would write: for each batch of the same size, in input order,
                  prepare + embed the prompts, left-pad, ``lm.generate(inputs_embeds=..., do_sample=False)``.
               figure: replies/s of A over replies/s of B (goal >= 1.0: the bookkeeping costs nothing)
    fused      A  capture with ``replies`` (fused: states from the generation pass)
               B  regenerate, then capture the regenerated file (two passes)
               figure: wall time A / B (goal <= 0.65)
    engines    (``--engines``) A  ``regenerate --engine vllm`` (capture's vLLM worker, continuous batching)
                               B  ``regenerate`` in-process, on the same prompts, same threads
               figure: decoding tokens/s of A over B (each run's own ``run_stats``: vLLM's start, a fixed
               cost per run, is reported beside, not in the rate); whether the two output files are equal
    prefix     (``--prefix-caching``) A  ``regenerate --engine vllm --prefix-caching`` on the multi-turn
                               conversations of ``--data`` (ShareGPT's, say), B  the same without it
               figure: decoding tokens/s of A over B; the prompt tokens vLLM's prefix cache held, and how many
               conversations came out equal

Targets: ``smollm2`` (the real SmolLM2-135M-Instruct that ``python -m tapdraft.demo.real build`` caches under
~/.cache/tapdraft/models/, vocab 49,152; prompts from the Python documentation's topics, as demo.bpe's
corpus), ``demo`` (the trained demo SALM in --workdir, built by the demo if missing; its own
tone-digit conversations) and ``real`` (a random-init Qwen3 of real width: hidden 1024, 8 layers,
vocab 151,936 with a word-level tokenizer of one word per id, so replies survive the text round
trip; text prompts of --prompt-tokens words; its replies never end, so every reply runs to
--max-new-tokens on both sides, kept as truncated). CPU, float32, one thread per side. The target fingerprint (one
sha256 pass over embedding + lm_head, kept on the loaded target) is computed once before the pairs
and reported beside them.

    python -m benchmarks.regenerate [--target demo|real|smollm2] [--pairs 5] [--samples 96] [--batch 16]
    python -m benchmarks.regenerate --target smollm2 --engines --samples 64 --max-new-tokens 128 --pairs 2 \\
        --threads 2 --vllm-python "$(engines/venv.sh vllm)/bin/python"
    python -m benchmarks.regenerate --target smollm2 --prefix-caching --data general/n500/data/validation.prompts.jsonl \\
        --samples 32 --max-new-tokens 192 --max-conversation-tokens 1024 --pairs 2 --batch 32 --window 16 \\
        --vllm-python "$(engines/venv.sh vllm)/bin/python"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result


def _plain_generate(target, convs, batch: int, max_new_tokens: int) -> int:
    """The baseline: prompts in input order, ``batch`` at a time, through the model's own generate."""
    stops, n = target.end_token_ids(), 0
    gen_model = target.lm
    with torch.inference_mode():
        for s in range(0, len(convs), batch):
            exps = target.embed([target.prepare_prompt(c, i) for i, c in enumerate(convs[s:s + batch])])
            B, P = len(exps), max(e.input_ids.shape[0] for e in exps)
            emb = torch.zeros(B, P, exps[0].inputs_embeds.shape[-1])
            attn = torch.zeros(B, P, dtype=torch.long)
            for b, e in enumerate(exps):
                T = e.input_ids.shape[0]
                emb[b, P - T:], attn[b, P - T:] = e.inputs_embeds, 1
            gen_model.generate(inputs_embeds=emb, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=stops, pad_token_id=stops[0])
            n += B
    return n


def _demo_inputs(workdir: Path, samples: int, tmp: Path):
    from tapdraft.demo.data import prepare_demo

    paths = prepare_demo(workdir, progress=False)
    src = paths.data / "train.templated.jsonl"
    lines = src.read_text().splitlines()[:samples]
    data = tmp / "in.jsonl"
    base = paths.data.resolve()
    recs = []
    for line in lines:  # absolute audio paths: the copy lives elsewhere
        r = json.loads(line)
        r["conversations"][0]["value"] = str(base / r["conversations"][0]["value"])
        recs.append(json.dumps(r))
    data.write_text("\n".join(recs) + "\n")
    return str(paths.target), data


def _real_inputs(tmp: Path, samples: int, prompt_tokens: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tapdraft.demo.target import build_word_tokenizer
    from tapdraft.demo.task import vocabulary

    V = 151936
    words = vocabulary()
    n_fixed = len(build_word_tokenizer(words))  # specials + role names + the demo words
    # a word per id, so every generated id decodes to text that tokenizes back to it (replies are kept)
    tok = build_word_tokenizer(words + [f"w{i}" for i in range(V - n_fixed)])
    assert len(tok) == V
    cfg = Qwen3Config(vocab_size=V, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    d = tmp / "real-lm"
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    import numpy as np

    rng = np.random.default_rng(0)
    recs = []
    for i in range(samples):
        n = int(rng.integers(prompt_tokens // 2, prompt_tokens + 1))
        text = " ".join(words[j] for j in rng.integers(0, len(words), n))
        recs.append(json.dumps({"id": f"r{i}", "conversations": [{"from": "User", "value": text},
                                                                 {"from": "Assistant", "value": "one ."}]}))
    data = tmp / "in.jsonl"
    data.write_text("\n".join(recs) + "\n")
    return str(d), data


def _smollm2_inputs(tmp: Path, samples: int, target_dir: str | None):
    """The cached real SmolLM2 (``python -m tapdraft.demo.real build`` builds it) and ``samples`` one-turn prompts."""
    from tapdraft.demo.bpe import corpus_text

    if target_dir is None:
        found = sorted((Path.home() / ".cache" / "tapdraft" / "models").glob("smollm2-135m-instruct-*/config.json"))
        if not found:
            raise FileNotFoundError("no SmolLM2 under ~/.cache/tapdraft/models: run `python -m tapdraft.demo.real build` first, "
                                    "or give --target-dir")
        target_dir = str(found[-1].parent)
    words = " ".join(corpus_text()).split()
    recs = []
    for i in range(samples):
        at = (i * 997) % max(1, len(words) - 48)
        passage = " ".join(words[at:at + 24 + i % 24])
        recs.append(json.dumps({"id": f"s{i}", "conversations": [
            {"from": "user", "value": f"Explain this passage from the Python documentation:\n{passage}"},
            {"from": "assistant", "value": "."}]}))
    data = tmp / "in.jsonl"
    data.write_text("\n".join(recs) + "\n")
    return target_dir, data


def _sides(args, target_dir: str, data: Path, target, replies, tmp: Path, save, sides: dict[str, dict[str, Any]],
           figure: str) -> dict[str, Any]:
    """Interleaved pairs of two regenerations of the same prompts at the same threads, ``sides`` naming each one's
    RegenerateConfig fields (the first is A); the ratio is A's decoding tokens/s over B's (each run's own
    ``run_stats``: vLLM's start, a fixed cost per run, is reported beside, not in the rate). ``save(doc)`` after
    each pair (a slow machine keeps the pairs it finished)."""
    from tapdraft.capture.engines import DEFAULT_ENGINE, ENGINES
    from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate

    (na, _), (nb, _) = sides.items()
    pairs: list[dict[str, Any]] = []
    for k in range(args.pairs):
        runs = {}
        for name, fields in sides.items():
            out = tmp / f"{name}-{k}.jsonl"
            engine = fields.get("engine", DEFAULT_ENGINE)
            t0 = time.perf_counter()
            doc = regenerate(RegenerateConfig(target=target_dir, data=str(data), out=str(out), replies=replies,
                                              max_batch_size=args.batch, window=args.window, progress=False,
                                              **fields),
                             target=target if ENGINES[engine].loads_decoder else None)  # vLLM's: head only
            rs = doc["run_stats"]
            runs[name] = {"wall_s": time.perf_counter() - t0, "decode_s": rs["seconds"], "tokens": rs["tokens"],
                          "replies": rs["replies"], "tokens_per_s": rs["tokens"] / rs["seconds"],
                          "load_avg": os.getloadavg()[0], **({"engine": rs["engine"]} if "engine" in rs else {})}
        a, b = runs[na], runs[nb]
        ra, rb = ((tmp / f"{n}-{k}.jsonl").read_text().splitlines() for n in (na, nb))
        same = sum(x == y for x, y in zip(ra, rb))
        pairs.append({**runs, "ratio": a["tokens_per_s"] / b["tokens_per_s"], "identical_outputs": ra == rb,
                      "conversations_equal": same, "conversations": len(ra)})
        start = f" (+{a['engine']['startup_s']:.0f}s start)" if "engine" in a else ""
        print(f"pair {k}: {na} {a['tokens_per_s']:.0f} tok/s{start}  {nb} {b['tokens_per_s']:.0f} tok/s  ratio "
              f"{pairs[-1]['ratio']:.2f}  conversations equal: {same} of {len(ra)}  "
              f"load {a['load_avg']:.1f}/{b['load_avg']:.1f}", flush=True)
        doc = {"pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs), "figure": figure}
        save(doc)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["demo", "real", "smollm2"], default="demo")
    ap.add_argument("--target-dir", default=None, help="smollm2: its directory (default: the cached build)")
    ap.add_argument("--engines", action="store_true", help="compare regenerate --engine vllm with in-process only")
    ap.add_argument("--prefix-caching", action="store_true", help="compare regenerate --engine vllm with and without "
                    "--prefix-caching only, on the multi-turn conversations of --data")
    ap.add_argument("--data", default=None, help="--prefix-caching: the conversations (JSONL) to regenerate")
    ap.add_argument("--max-conversation-tokens", type=int, default=None,
                    help="--prefix-caching: regenerate's --max-conversation-tokens")
    ap.add_argument("--name", default=None, help="--prefix-caching: the results file's name")
    ap.add_argument("--vllm-python", default=None, help="--engines, --prefix-caching: the vLLM venv's python")
    ap.add_argument("--window", type=int, default=32, help="--engines, --prefix-caching: regenerate's --window")
    ap.add_argument("--threads", type=int, default=1, help="threads of each side")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tapdraft-demo"),
                    help="demo directory (built by the demo if missing)")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16, help="conversations per generation batch, both sides")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=384, help="real: longest prompt in words")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--skip-fused", action="store_true")
    args = ap.parse_args()

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.inputs import Conversation, read_jsonl
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.generation import GenerationConfig, ReplyConfig
    from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
    from tapdraft.capture.targets.load import load_target

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    if args.prefix_caching and (args.target != "smollm2" or args.data is None):
        ap.error("--prefix-caching regenerates multi-turn conversations: give --target smollm2 and --data FILE.jsonl")
    if args.target == "smollm2":
        target_dir, data = _smollm2_inputs(tmp, args.samples, args.target_dir)
        data = Path(args.data) if args.prefix_caching else data
    else:
        target_dir, data = (_demo_inputs(Path(args.workdir), args.samples, tmp) if args.target == "demo"
                            else _real_inputs(tmp, args.samples, args.prompt_tokens))
    target = load_target(target_dir)
    if args.engines:
        replies = ReplyConfig(generation=GenerationConfig(max_new_tokens=args.max_new_tokens), keep_truncated=True)
        head = {"target": args.target, "target_dir": target_dir, "samples": args.samples, "batch": args.batch,
                "window": args.window, "max_new_tokens": args.max_new_tokens}

        def save(engines: dict[str, Any]) -> None:
            write_result(f"regenerate_engines_{args.target}.json",
                         {**head, "engines": engines, "machine_extra": {"threads": args.threads, "device": "cpu"}})

        doc = _sides(args, target_dir, data, target, replies, tmp, save,
                     {"vllm": {"engine": "vllm", "vllm_python": args.vllm_python}, "transformers": {}},
                     "decoding tokens/s of regenerate --engine vllm over in-process, same prompts and threads")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"engines: vLLM / in-process decoding tokens/s = {doc['median_ratio']:.2f} (median)")
        return
    if args.prefix_caching:
        replies = ReplyConfig(generation=GenerationConfig(max_new_tokens=args.max_new_tokens), keep_truncated=True,
                              max_conversation_tokens=args.max_conversation_tokens)
        head = {"target": args.target, "target_dir": target_dir, "data": str(data), "samples": args.samples,
                "batch": args.batch, "window": args.window, "max_new_tokens": args.max_new_tokens,
                "max_conversation_tokens": args.max_conversation_tokens}

        def save(doc: dict[str, Any]) -> None:
            write_result(args.name or f"regenerate_prefix_caching_{args.target}.json",
                         {**head, "prefix_caching": doc, "machine_extra": {"threads": args.threads, "device": "cpu"}})

        vllm = {"engine": "vllm", "vllm_python": args.vllm_python, "max_samples": args.samples}
        doc = _sides(args, target_dir, data, target, replies, tmp, save,
                     {"cached": {**vllm, "prefix_caching": True}, "plain": vllm},
                     "decoding tokens/s of regenerate --engine vllm --prefix-caching over the same without it")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"prefix caching: with / without decoding tokens/s = {doc['median_ratio']:.2f} (median)")
        return
    placeholder = target.placeholder or "<|audioplaceholder|>"
    convs = [c for c in read_jsonl(data, placeholder=placeholder) if isinstance(c, Conversation)]
    prompts = [Conversation(c.sample_id, c.source, c.messages[:-1], c.audios, c.line) for c in convs]
    replies = ReplyConfig(generation=GenerationConfig(max_new_tokens=args.max_new_tokens), keep_truncated=True)
    big = 1 << 30  # batches bounded by --batch alone, as the baseline's

    def run_regen(out: Path) -> tuple[float, int]:
        t0 = time.perf_counter()
        doc = regenerate(RegenerateConfig(target=target_dir, data=str(data), out=str(out), replies=replies,
                                          batch_tokens=big, max_batch_size=args.batch, progress=False), target=target)
        return time.perf_counter() - t0, doc["counts"]["conversations"]

    def run_plain() -> tuple[float, int]:
        t0 = time.perf_counter()
        n = _plain_generate(target, prompts, args.batch, args.max_new_tokens)
        return time.perf_counter() - t0, n

    from tapdraft.capture.provenance import target_fingerprint

    t0 = time.perf_counter()
    target_fingerprint(target)  # once per loaded target (kept on it): reported, not in the pairs
    fingerprint_s = time.perf_counter() - t0
    gen_pairs: list[dict[str, float]] = []
    run_plain()  # warm-up (allocator, kernels)
    for k in range(args.pairs):
        a_s, a_n = run_regen(tmp / f"gen-{k}.jsonl")
        b_s, b_n = run_plain()
        gen_pairs.append({"regenerate_s": a_s, "plain_s": b_s, "ratio": (a_n / a_s) / (b_n / b_s),
                          "load_avg": os.getloadavg()[0]})
        print(f"pair {k}: regenerate {a_n / a_s:.2f} replies/s  plain generate {b_n / b_s:.2f} replies/s  "
              f"ratio {gen_pairs[-1]['ratio']:.3f}")
    doc: dict[str, Any] = {
        "target": args.target, "samples": len(convs), "fingerprint_seconds_once": round(fingerprint_s, 2),
        "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "generate": {"pairs": gen_pairs, "median_ratio": statistics.median(p["ratio"] for p in gen_pairs),
                     "goal": ">= 1.0 (replies/s of regenerate over a plain model.generate loop)"},
    }
    if not args.skip_fused:
        fused_pairs: list[dict[str, float]] = []

        def run_capture(out: Path, fused: bool) -> float:
            t0 = time.perf_counter()
            cfg = CaptureConfig(target=target_dir, out=str(out), data=(("train", str(data)),), draft_layers=2,
                                top_k=32, progress=False, on_error="skip", batch_tokens=big,
                                max_batch_size=args.batch, replies=replies, fused=fused)
            capture(cfg, target=target)
            return time.perf_counter() - t0

        for k in range(args.pairs):
            a = run_capture(tmp / f"fused-{k}", True)
            b = run_capture(tmp / f"two-{k}", False)
            fused_pairs.append({"fused_s": a, "two_pass_s": b, "ratio": a / b, "load_avg": os.getloadavg()[0]})
            print(f"pair {k}: fused {a:.2f}s  two-pass {b:.2f}s  ratio {a / b:.3f}")
        doc["fused"] = {"pairs": fused_pairs, "median_ratio": statistics.median(p["ratio"] for p in fused_pairs),
                        "goal": "<= 0.65 (wall time of capture --regenerate over regenerate + capture)"}
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"generate: regenerate / plain model.generate replies/s = {doc['generate']['median_ratio']:.3f} (median)")
    if "fused" in doc:
        print(f"fused: capture --regenerate / (regenerate + capture) wall time = {doc['fused']['median_ratio']:.3f}")
    write_result(f"regenerate_{args.target}.json", {**doc, "machine_extra": {"threads": args.threads, "device": "cpu"}})


if __name__ == "__main__":
    main()
