"""Capture overhead: wall time of a capture to finished shards vs the minimal compute its content needs.

Both sides run the same target over the SAME length-bucketed batches of the same conversations, with
the same torch thread count:

    A  capture   capture.pipeline.capture with the CLI's defaults into a fresh directory: input
                 decoding + tokenisation (prefetch thread), forward with tap hooks, teacher top-k,
                 background compression + shard writing, finalize (manifest, card).
    B  minimal   what the content requires and nothing else: the decoder forward over each batch
                 (inputs already embedded, audio encoder included for a SALM) plus lm_head on the
                 supervised rows only (the rows whose teacher distribution the dataset stores).

Overhead ratio = A / B (1.0 would mean tapping, the top-k and writing were free). Interleaved
A B A B, median of the pairs, absolute seconds and the load average for context. The serial parts
(tapped forward with teacher, write, the target bundle; each timed alone once) say where the overhead
goes. The bundle (embedding, final norm, lm_head, tokenizer: 622 MB at qwen3-1024x8) is written once
per dataset, so a benchmark of a few conversations overstates its share: the steady-state ratio
(A - bundle) / B is what every further conversation costs.

    python -m benchmarks.capture --synthetic-target qwen3-1024x8 [--conversations 8] [--pairs 3]
    python -m benchmarks.capture --target DIR --data FILE.jsonl     # any target the CLI loads
    python -m benchmarks.capture                                    # the demo target

``--engine vllm --vllm-python PY`` compares the two capture engines instead: the in-process capture (A)
against ``capture --engine vllm`` (V) on the same target, conversations, settings and thread count,
interleaved A V A V. V's wall time includes starting vLLM (its import, model load and warm-up, a fixed
cost per run reported as ``startup_s``); ``steady`` ratios take it out, which is what a long capture
sees. Both write the same dataset (tests/engines/test_vllm_capture.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_result


def _minimal(target, plans) -> float:
    """Decoder forward + lm_head on the supervised rows, per batch of the capture's own plan."""
    from tapdraft.shards.schema import teacher_rows

    head = target.lm.get_output_embeddings()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in plans:
            exps = target.embed(batch)
            B, T = len(exps), max(e.input_ids.shape[0] for e in exps)
            H = exps[0].inputs_embeds.shape[-1]
            emb = torch.zeros(B, T, H, dtype=exps[0].inputs_embeds.dtype)
            attn = torch.zeros(B, T, dtype=torch.long)
            for b, e in enumerate(exps):
                emb[b, : e.input_ids.shape[0]] = e.inputs_embeds
                attn[b, : e.input_ids.shape[0]] = 1
            h = target.decoder(inputs_embeds=emb, attention_mask=attn, use_cache=False).last_hidden_state
            for b, e in enumerate(exps):
                rows = teacher_rows(e.loss_mask).long()
                head(h[b, rows])
    return time.perf_counter() - t0


def _resolve_target(args) -> tuple[Path, Path, dict]:
    if args.synthetic_target:
        from benchmarks.shapes import conversations, shape_facts, synthetic_target

        root = Path(args.workdir or Path(tempfile.gettempdir()) / f"tapdraft-{args.synthetic_target}")
        root.mkdir(parents=True, exist_ok=True)
        target = synthetic_target(args.synthetic_target, root / "target")
        data = conversations(root / "conversations.jsonl", args.conversations)
        return target, data, {"shape": args.synthetic_target, **shape_facts(args.synthetic_target)}
    if args.target:
        if not args.data:
            raise SystemExit("--target needs --data FILE.jsonl")
        return Path(args.target), Path(args.data), {"shape": "user target"}
    from tapdraft.demo.data import prepare_demo

    paths = prepare_demo(args.workdir or str(Path(tempfile.gettempdir()) / "tapdraft-demo"), progress=False)
    return paths.target, paths.train_manifest, {"shape": "demo target"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic-target", choices=["qwen3-1024x8"], help="build a random-init target at a real shape")
    ap.add_argument("--target", help="any target directory the CLI loads (with --data)")
    ap.add_argument("--data", help="conversations JSONL for --target")
    ap.add_argument("--workdir", help="where the demo or synthetic target is built and cached")
    ap.add_argument("--conversations", type=int, default=8, help="synthetic conversations (512-2048 tokens each)")
    ap.add_argument("--samples", type=int, default=None, help="capture only the first N conversations")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same on both sides")
    ap.add_argument("--name", default="capture.json")
    ap.add_argument("--engine", choices=["vllm"], help="compare the in-process engine with this one instead")
    ap.add_argument("--vllm-python", help="with --engine vllm: the python of vLLM's environment")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        return engines(args)

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.forward import SampleSpec, run_batch
    from tapdraft.capture.pipeline import capture, make_layout, plan_window, prepare_window, rank_items, windows
    from tapdraft.capture.targets.load import load_target
    from tapdraft.shards.writer import DatasetWriter

    target_dir, data, shape = _resolve_target(args)
    target = load_target(target_dir)
    cfg = CaptureConfig(target=str(target_dir), out="", data=(("train", str(data)),), max_samples=args.samples,
                        progress=False)  # everything else: the CLI's defaults
    items = list(rank_items(target, str(data), 0, 1, cfg.max_samples))  # the capture's own input stage
    plans = [b for chunk in windows(items, cfg.window)
             for b in plan_window(prepare_window(target, chunk), max_length=cfg.max_length,
                                  batch_tokens=cfg.batch_tokens, max_batch_size=cfg.max_batch_size).batches]
    tokens = sum(p.length for b in plans for p in b)
    scratch = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    _minimal(target, plans[:1])  # warm up
    a_times, b_times, loads, bytes_out = [], [], [], 0
    for i in range(args.pairs):
        out = scratch / f"run{i}"
        loads.append(os.getloadavg()[0])
        t0 = time.perf_counter()
        m = capture(dataclasses.replace(cfg, out=str(out)), target=target)
        a_times.append(time.perf_counter() - t0)
        bytes_out = m["splits"]["train"]["bytes"]
        shutil.rmtree(out)
        b_times.append(_minimal(target, plans))
        print(f"pair {i}: capture {a_times[-1]:.2f} s  minimal {b_times[-1]:.2f} s  "
              f"ratio {a_times[-1] / b_times[-1]:.3f}")
    layout = make_layout(cfg, target)
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = [run_batch(target, b, SampleSpec(tap_ids=layout.tap_ids, top_k=layout.top_k, row_chunk=cfg.row_chunk))
                   for b in plans]
    tapped_s = time.perf_counter() - t0
    w = DatasetWriter(str(scratch / "w"), cfg.shard, layout, fingerprint="0" * 64)
    t0 = time.perf_counter()
    for b, r in zip(plans, results):
        for p, s in zip(b, r):
            w.write({"sample_id": p.sample_id, "source": p.source, "audio_seconds": p.audio_seconds, **s}, p.index)
    w.close()
    write_s = time.perf_counter() - t0
    from tapdraft.shards.manifest import write_or_check_bundle

    t0 = time.perf_counter()
    write_or_check_bundle(str(scratch / "bundle"), **target.bundle_parts())
    bundle_s = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    ratios = [a / b for a, b in zip(a_times, b_times)]
    res = {
        "benchmark": "capture",
        "what": "capture to finished shards with CLI defaults (A) vs decoder forward + lm_head on supervised rows (B)",
        "target_shape": shape,
        "overhead_ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "steady_state_ratio_median": round(statistics.median((a - bundle_s) / b for a, b in zip(a_times, b_times)), 3),
        "capture_s_median": round(statistics.median(a_times), 3),
        "minimal_s_median": round(statistics.median(b_times), 3),
        "serial_parts_s": {"tapped_forward_with_teacher": round(tapped_s, 3), "write": round(write_s, 3),
                           "bundle": round(bundle_s, 3)},
        "writer_MB_per_s": round(sum(sum(t.numel() * t.element_size() for t in s.values()) for r in results
                                     for s in r if isinstance(s, dict)) / write_s / 1e6, 1),
        "samples": len(items), "tokens": tokens, "batches": len(plans), "dataset_bytes": bytes_out,
        "load_avg_1m_per_pair": [round(x, 2) for x in loads],
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("out", "target", "data")},
        "command": "python -m benchmarks.capture " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False) and k != "name"),
        "machine_extra": {"threads": args.threads},
    }
    print(f"{'side':<10}{'median s':>10}{'tokens/s':>12}")
    print(f"{'capture':<10}{res['capture_s_median']:>10.3f}{tokens / res['capture_s_median']:>12,.0f}")
    print(f"{'minimal':<10}{res['minimal_s_median']:>10.3f}{tokens / res['minimal_s_median']:>12,.0f}")
    print(f"overhead ratio (median of {args.pairs} interleaved pairs): {res['overhead_ratio_median']:.3f}  "
          f"(goal <= 1.10 at qwen3-1024x8)  pairs: {res['ratios']}  shape: {shape}")
    sp = res["serial_parts_s"]
    print(f"serial parts (one pass, s): tapped forward + teacher {sp['tapped_forward_with_teacher']:.2f}  "
          f"write {sp['write']:.2f} ({res['writer_MB_per_s']} MB/s of tensors)  bundle {sp['bundle']:.2f}")
    print(f"steady-state ratio (capture without its one-time bundle / minimal): {res['steady_state_ratio_median']:.3f}")
    write_result(args.name, res)


def engines(args) -> None:
    """In-process capture (A) vs ``--engine vllm`` (V): same target, data, settings and threads, interleaved."""
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.targets.load import load_target

    target_dir, data, shape = _resolve_target(args)
    target = load_target(target_dir)
    base = CaptureConfig(target=str(target_dir.resolve()), out="", data=(("train", str(data)),),
                         max_samples=args.samples, progress=False)
    scratch = Path(tempfile.mkdtemp(prefix="capture-engines-"))
    a_s, v_s, starts, loads, tokens, version = [], [], [], [], 0, ""
    for i in range(args.pairs):
        loads.append(os.getloadavg()[0])
        for name, cfg in (("A", base), ("V", dataclasses.replace(base, engine="vllm", vllm_python=args.vllm_python))):
            out = scratch / f"{name}{i}"
            t0 = time.perf_counter()
            m = capture(dataclasses.replace(cfg, out=str(out)), target=target if name == "A" else None)
            (a_s if name == "A" else v_s).append(time.perf_counter() - t0)
            tokens = m["splits"]["train"]["tokens"]
            if name == "V":
                starts.append(m["run_stats"]["engine"]["startup_s"])
                version = m["run_stats"]["engine"]["version"]
            shutil.rmtree(out)
        print(f"pair {i}: in-process {a_s[-1]:.2f} s  vllm {v_s[-1]:.2f} s (startup {starts[-1]:.2f} s)  "
              f"ratio {v_s[-1] / a_s[-1]:.3f}  steady {(v_s[-1] - starts[-1]) / a_s[-1]:.3f}")
    shutil.rmtree(scratch, ignore_errors=True)
    med = statistics.median
    steady = [v - s for v, s in zip(v_s, starts)]
    res = {
        "benchmark": "capture_engines",
        "what": "capture to finished shards: in-process engine (A) vs --engine vllm (V), same target/data/threads",
        "target_shape": shape, "vllm": version,
        "vllm_over_in_process_median": round(med(v / a for v, a in zip(v_s, a_s)), 3),
        "steady_vllm_over_in_process_median": round(med(v / a for v, a in zip(steady, a_s)), 3),
        "in_process_s": [round(x, 3) for x in a_s], "vllm_s": [round(x, 3) for x in v_s],
        "vllm_startup_s": [round(x, 3) for x in starts],
        "tokens": tokens,
        "tokens_per_s": {"in_process": round(tokens / med(a_s)), "vllm": round(tokens / med(v_s)),
                         "vllm_steady": round(tokens / med(steady))},
        "load_avg_1m_per_pair": [round(x, 2) for x in loads],
        "config": {k: v for k, v in base.to_dict().items() if k not in ("out", "target", "data")},
        "command": "python -m benchmarks.capture " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v not in (None, False) and k not in ("name", "vllm_python")) + " --vllm-python PY",
        "machine_extra": {"threads": args.threads},
    }
    tps = res["tokens_per_s"]
    print(f"{'engine':<16}{'median s':>10}{'tokens/s':>12}")
    print(f"{'in-process':<16}{med(a_s):>10.3f}{tps['in_process']:>12,}")
    print(f"{'vllm':<16}{med(v_s):>10.3f}{tps['vllm']:>12,}")
    print(f"{'vllm - startup':<16}{med(steady):>10.3f}{tps['vllm_steady']:>12,}")
    print(f"vllm / in-process (median of {args.pairs} pairs): {res['vllm_over_in_process_median']:.3f}; without vLLM's "
          f"start-up: {res['steady_vllm_over_in_process_median']:.3f}  shape: {shape}")
    write_result(args.name if args.name != "capture.json" else "capture_engines.json", res)


if __name__ == "__main__":
    main()
