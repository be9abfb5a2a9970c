"""GPU checks and figures in one run (``benchmarks/gpu.sh``); the CPU parts run anywhere.

    parity     capture of a small random-init Qwen3 causal LM on CPU (float32) is the reference;
               with CUDA the same conversations are captured on the GPU in float32 (must agree: taps
               within bf16 rounding, top-k ids and log-probs) and in bfloat16 (recorded, looser)
    capture    bf16 capture overhead on the GPU at the Qwen shape (random-init Qwen3ForCausalLM,
               hidden 1024, 8 layers, vocab 151,936, conversations of 512-2048 tokens, CLI defaults):
               capture to finished shards vs decoder forward + lm_head on the supervised rows over the
               same batches, interleaved pairs, median ratio
    attention  one DFlash training step (forward, backward, AdamW) with FlexAttention vs the dense SDPA
               mask: median step time and peak memory, bf16 autocast as the training loop uses on GPU
    fused_ce   the chunked lm_head + CE (``train.drafters.common.losses.row_losses``) vs dense logits + F.cross_entropy
               at V = 151,936: forward + backward time, peak memory, loss and gradient agreement
    writer     the host's shard writer at hidden 4096 with six taps: 1, 2, 4 writer lanes, zstd 1 and
               uncompressed, against the ~37k tokens/s an H100 prefills an 8B target at (CPU only)

Without CUDA the GPU parts are recorded as skipped; ``--cpu-check`` runs them on the CPU instead (a
code check at ``--tiny`` shapes: Flex then runs forward only, its backward needs a GPU). ``--tiny``
shrinks every shape so the whole script takes seconds. GPU timings synchronize before reading the
clock; memory is ``torch.cuda.max_memory_allocated`` after a reset. Writes benchmarks/results/gpu.json.

    bash benchmarks/gpu.sh                 # on a machine with one GPU (under 8 minutes)
    python -m benchmarks.gpu --tiny        # anywhere: CPU parity part, GPU parts skipped
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import write_result


QWEN, PARITY, TINY = "qwen3-1024x8", "qwen3-256x4", "qwen3-64x2"
"""Shapes of ``benchmarks.shapes`` used here: the real one, the parity check's, and ``--tiny``'s."""


class Clock:
    """Wall time of a block (CUDA synchronized on both ends) and its peak allocated memory."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds, self.peak_bytes = 0.0, None

    def __enter__(self) -> "Clock":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        self.seconds = time.perf_counter() - self.t0


def interleaved(fns: dict[str, Callable[[], Any]], pairs: int, device: torch.device) -> dict[str, dict[str, Any]]:
    """Run each fn once to warm up, then ``pairs`` rounds A B A B...; median seconds and max peak memory."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    peaks: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(pairs):
        for k, fn in fns.items():
            with Clock(device) as c:
                fn()
            times[k].append(c.seconds)
            if c.peak_bytes is not None:
                peaks[k].append(c.peak_bytes)
    return {k: {"seconds_median": round(statistics.median(v), 5), "seconds": [round(x, 5) for x in v],
                "peak_bytes": max(peaks[k]) if peaks[k] else None} for k, v in times.items()}


# ------------------------------------------------------------------------------------------ targets
def build(name: str, root: Path, *, conversations: int, tokens: tuple[int, int], seed: int = 0) -> tuple[Path, Path]:
    """The random-init target ``name`` (``benchmarks.shapes``, bf16 weights, HF layout) and its conversations."""
    from benchmarks.shapes import conversations as write_conversations
    from benchmarks.shapes import synthetic_target

    target = synthetic_target(name, root / name)
    data = write_conversations(root / f"{name}-{conversations}.jsonl", conversations, seed=seed,
                               min_tokens=tokens[0], max_tokens=tokens[1])
    return target, data


def run_capture(target: Path, data: Path, out: Path, *, device: str, dtype: str, **kw: Any) -> dict[str, Any]:
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture

    shutil.rmtree(out, ignore_errors=True)
    cfg = CaptureConfig(target=str(target), out=str(out), data=(("train", str(data)),), device=device, dtype=dtype,
                        progress=False, **kw)
    return capture(cfg)


# ------------------------------------------------------------------------------------------ parts
def compare_datasets(ref: Path, other: Path) -> dict[str, Any]:
    """Taps and top-k of two captures of the same conversations, matched by sample id."""
    from tapdraft.shards.reader import open_dataset

    a, b = open_dataset(str(ref)), open_dataset(str(other))
    bs = {b.sample("train", i)["sample_id"]: i for i in range(b.num_samples("train"))}
    tap_rel, top1, overlap, lp_diff, rows, exact = 0.0, 0, 0.0, 0.0, 0, 0
    n_el = 0
    for i in range(a.num_samples("train")):
        x = a.sample("train", i)
        y = b.sample("train", bs[x["sample_id"]])
        tx, ty = torch.as_tensor(x["taps"]).float(), torch.as_tensor(y["taps"]).float()
        tap_rel = max(tap_rel, float((tx - ty).abs().max() / tx.abs().max().clamp_min(1e-30)))
        exact += int((tx == ty).sum())
        n_el += tx.numel()
        ix, iy = torch.as_tensor(x["topk_ids"]).long(), torch.as_tensor(y["topk_ids"]).long()
        lx, ly = torch.as_tensor(x["topk_logprobs"]).float(), torch.as_tensor(y["topk_logprobs"]).float()
        top1 += int((ix[:, 0] == iy[:, 0]).sum())
        overlap += sum(len(set(r.tolist()) & set(s.tolist())) / ix.shape[1] for r, s in zip(ix, iy))
        lp_diff = max(lp_diff, float((lx - ly).abs().max())) if lx.numel() else lp_diff
        rows += ix.shape[0]
    return {"samples": a.num_samples("train"), "teacher_rows": rows, "taps_max_rel_diff": tap_rel,
            "taps_equal_fraction": round(exact / max(n_el, 1), 6), "top1_agreement": round(top1 / max(rows, 1), 6),
            "topk_set_overlap": round(overlap / max(rows, 1), 6), "topk_logprob_max_abs_diff": lp_diff}


def part_parity(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    from benchmarks.shapes import shape_facts

    shape = TINY if args.tiny else PARITY
    target, data = build(shape, scratch, conversations=8 if args.tiny else 32,
                         tokens=(64, 160) if args.tiny else (512, 1024))
    with Clock(torch.device("cpu")) as c:
        m = run_capture(target, data, scratch / "parity-cpu", device="cpu", dtype="float32")
    split = m["splits"]["train"]
    out: dict[str, Any] = {"shape": shape, **shape_facts(shape), "cpu": {
        "seconds": round(c.seconds, 3), "tokens": split.get("tokens"), "samples": split.get("samples")}}
    if device.type != "cuda":
        out["cuda"] = {"skipped": "no CUDA device"}
        return out
    for dt in ("float32", "bfloat16"):
        run_capture(target, data, scratch / f"parity-{dt}", device=str(device), dtype=dt)
        out[f"cuda_{dt}"] = compare_datasets(scratch / "parity-cpu", scratch / f"parity-{dt}")
    f = out["cuda_float32"]
    # float32 on both: taps may differ by one bf16 rounding step (2^-8 relative), top-k by near-ties only
    out["pass"] = bool(f["taps_max_rel_diff"] <= 1e-2 and f["top1_agreement"] >= 0.99
                       and f["topk_logprob_max_abs_diff"] <= 1e-2)
    return out


def part_capture(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    import dataclasses

    from benchmarks.shapes import shape_facts
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture, plan_window, prepare_window, rank_items, windows
    from tapdraft.capture.targets.load import load_target
    from tapdraft.shards.schema import teacher_rows

    shape = TINY if args.tiny else QWEN
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 8 if args.tiny else args.capture_samples
    target_dir, data = build(shape, scratch, conversations=n, tokens=(64, 160) if args.tiny else (512, 2048), seed=1)
    target = load_target(target_dir, dtype=dtype, device=str(device))
    hidden = shape_facts(shape)["hidden_size"]
    cfg = CaptureConfig(target=str(target_dir), out="", data=(("train", str(data)),), device=str(device),
                        dtype="bfloat16" if dtype == torch.bfloat16 else "float32", progress=False)
    items = list(rank_items(target, str(data), 0, 1, cfg.max_samples))  # the capture's own input stage
    plans = [b for chunk in windows(items, cfg.window)
             for b in plan_window(prepare_window(target, chunk), max_length=cfg.max_length,
                                  batch_tokens=cfg.batch_tokens, max_batch_size=cfg.max_batch_size).batches]
    tokens = sum(p.length for b in plans for p in b)
    lm_head = target.lm.get_output_embeddings()

    def minimal() -> None:  # decoder forward + lm_head on the supervised rows, same batches
        with torch.inference_mode():
            for batch in plans:
                exps = target.embed(batch)
                B, T = len(exps), max(e.input_ids.shape[0] for e in exps)
                emb = torch.zeros(B, T, hidden, dtype=dtype, device=device)
                attn = torch.zeros(B, T, dtype=torch.long, device=device)
                for b, e in enumerate(exps):
                    emb[b, : e.input_ids.shape[0]], attn[b, : e.input_ids.shape[0]] = e.inputs_embeds, 1
                h = target.decoder(inputs_embeds=emb, attention_mask=attn, use_cache=False).last_hidden_state
                for b, e in enumerate(exps):
                    lm_head(h[b, teacher_rows(e.loss_mask.cpu()).long().to(device)])

    runs = {"i": 0}

    def full(lanes: int) -> Callable[[], None]:
        def run() -> None:
            runs["i"] += 1
            out = scratch / f"cap{runs['i']}"
            capture(dataclasses.replace(cfg, out=str(out), shard=dataclasses.replace(cfg.shard, writers=lanes)),
                    target=target)
            shutil.rmtree(out)
        return run

    lanes = [int(w) for w in str(args.capture_writers).split(",")]
    res = interleaved({"minimal": minimal, **{f"capture_w{w}": full(w) for w in lanes}}, args.pairs, device)
    first = res[f"capture_w{lanes[0]}"]
    ratios = [a / b for a, b in zip(first["seconds"], res["minimal"]["seconds"])]
    return {"shape": shape, **shape_facts(shape), "dtype": str(dtype).replace("torch.", ""), "samples": n,
            "tokens": tokens, "batches": len(plans), "overhead_ratio_median": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios], "capture": first, "minimal": res["minimal"],
            "capture_tokens_per_s": round(tokens / first["seconds_median"]),
            "writers": {w: {"seconds_median": res[f"capture_w{w}"]["seconds_median"],
                            "tokens_per_s": round(tokens / res[f"capture_w{w}"]["seconds_median"])} for w in lanes},
            "config": {k: v for k, v in dataclasses.replace(cfg, shard=dataclasses.replace(cfg.shard, writers=lanes[0]))
                       .to_dict().items()
                       if k not in ("out", "target", "data")}}


def _bundle(root: Path, name: str) -> Any:
    from benchmarks.shapes import SHAPES
    from tapdraft.shards.bundle import load_bundle, write_bundle

    shape = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    config = {"model_type": "qwen3", "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
              "vocab_size": shape.vocab, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "head_dim": shape.hidden // shape.heads, "intermediate_size": shape.intermediate,
              "rope_theta": 1e6, "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": None,
              "eos_token_id": 2, "pad_token_id": 0}
    write_bundle(root, config=config, audio={}, chat_template=None,
                 embed_tokens=(0.02 * torch.randn(shape.vocab, shape.hidden, generator=g)).bfloat16(),
                 norm_weight=torch.ones(shape.hidden).bfloat16(),
                 lm_head=(0.02 * torch.randn(shape.vocab, shape.hidden, generator=g)).bfloat16(), tokenizer_dir=None)
    return load_bundle(root, verify=False)


def part_attention(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    from benchmarks.shapes import SHAPES, shape_facts
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.taps import capture_tap_ids
    from tapdraft.train.drafters.dflash.config import DFlashConfig
    from tapdraft.train.drafters.dflash.model import DFlashDrafter
    from tapdraft.train.drafters.base import combine_terms

    name = TINY if args.tiny else QWEN
    shape = SHAPES[name]
    Bs, T, anchors = (2, 256, 16) if args.tiny else (2, 2048, 512)
    bundle = _bundle(scratch / "bundle", name)
    layout = Layout(hidden_size=shape.hidden, num_layers=shape.layers, tap_ids=tuple(capture_tap_ids(shape.layers, 5)),
                    top_k=0, audio_token_id=1)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(8, min(shape.vocab, 8192), (Bs, T), generator=g).to(device),
             "taps": torch.randn(Bs, T, len(layout.tap_ids), shape.hidden, generator=g).bfloat16().to(device),
             "loss_mask": torch.ones(Bs, T, dtype=torch.bool, device=device),
             "is_audio": torch.zeros(Bs, T, dtype=torch.bool, device=device),
             "lengths": torch.full((Bs,), T, device=device)}
    batch["loss_mask"][:, :64] = False
    cuda = device.type == "cuda"
    steps, out = {}, {"shape": name, **shape_facts(name), "sequences": Bs, "seq_len": T, "anchors_per_seq": anchors,
                      "block_size": 16, "draft_layers": 1}
    for attn in ("dense", "flex"):
        cfg = DFlashConfig(num_layers=1, block_size=16, num_anchors=anchors, max_total_anchors=Bs * anchors,
                           max_loss_rows=Bs * anchors * 15, attention=attn, chunk_rows=2048)
        torch.manual_seed(0)
        model = DFlashDrafter.build(cfg, bundle, layout).to(device)
        if cuda:
            model.target.to_dtype(torch.bfloat16)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        backward = cuda or attn == "dense"  # FlexAttention has no CPU backward

        def step(model=model, opt=opt, backward=backward) -> None:
            gen = torch.Generator().manual_seed(1)  # anchors are drawn on the CPU
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
            with ctx, (nullcontext() if backward else torch.no_grad()):
                loss, _ = combine_terms(model(batch, generator=gen).terms)
            if backward:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        with Clock(device) as c:
            step()  # first call compiles Flex on GPU
        out[f"{attn}_first_step_s"] = round(c.seconds, 3)
        out[f"{attn}_backward"] = backward
        steps[attn] = step
    res = interleaved(steps, args.pairs, device)
    out.update(res)
    out["time_ratio_flex_over_dense"] = round(statistics.median(
        [f / d for d, f in zip(res["dense"]["seconds"], res["flex"]["seconds"])]), 4)
    if cuda:
        out["memory_ratio_flex_over_dense"] = round(res["flex"]["peak_bytes"] / res["dense"]["peak_bytes"], 4)
    return out


def part_fused_ce(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    from benchmarks.shapes import SHAPES
    from tapdraft.train.drafters.common.losses import row_losses

    shape = SHAPES[TINY if args.tiny else QWEN]
    V, H, R = shape.vocab, shape.hidden, 512 if args.tiny else args.ce_rows
    g = torch.Generator().manual_seed(0)
    W = (0.02 * torch.randn(V, H, generator=g)).to(device=device, dtype=torch.bfloat16 if device.type == "cuda"
                                                  else torch.float32)
    h0 = torch.randn(R, H, generator=g).to(device)
    y = torch.randint(V, (R,), generator=g).to(device)
    grads: dict[str, torch.Tensor] = {}
    losses: dict[str, float] = {}

    def fused() -> None:
        h = h0.clone().requires_grad_(True)
        ce, _, _ = row_losses(h, y, W, chunk_rows=2048)
        loss = ce.sum()
        loss.backward()
        grads["fused"], losses["fused"] = h.grad, float(loss.detach())

    def dense() -> None:
        h = h0.clone().requires_grad_(True)
        logits = torch.nn.functional.linear(h.to(W.dtype), W).float()
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        loss.backward()
        grads["dense"], losses["dense"] = h.grad, float(loss.detach())

    res = interleaved({"fused": fused, "dense": dense}, args.pairs, device)
    gd = float((grads["fused"] - grads["dense"]).abs().max() / grads["dense"].abs().max())
    out = {"vocab_size": V, "hidden_size": H, "rows": R, "lm_head_dtype": str(W.dtype).replace("torch.", ""),
           "chunk_rows": 2048, **res,
           "time_ratio_fused_over_dense": round(res["fused"]["seconds_median"] / res["dense"]["seconds_median"], 4),
           "loss_rel_diff": abs(losses["fused"] - losses["dense"]) / abs(losses["dense"]), "grad_max_rel_diff": gd}
    if res["dense"]["peak_bytes"]:
        out["memory_ratio_fused_over_dense"] = round(res["fused"]["peak_bytes"] / res["dense"]["peak_bytes"], 4)
    return out


def part_writer(args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    """The GPU host's writer: tokens/s of 1, 2, 4 writer lanes at hidden 4096 with six taps (benchmarks/write.py's
    content), compressed (zstd 1) and uncompressed (zstd 0, raw), against the prefill rate a GPU asks of it."""
    from benchmarks.write import TAPS, make_samples, write_tapdraft
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.shard_file import ShardConfig

    hidden, n, T = (256, 8, 128) if args.tiny else (4096, 16, 1024)
    layout = Layout(hidden_size=hidden, num_layers=36, tap_ids=TAPS, top_k=64, audio_token_id=0)
    samples = make_samples(n, T, hidden)
    rows = []
    for level, lay in ((1, "planes"), (0, "raw")):
        for lanes in (1, 2, 4):
            cfg = ShardConfig(zstd_level=level, bf16_layout=lay, writers=lanes)
            secs = []
            for i in range(2):
                secs.append(write_tapdraft(scratch / f"w{i}", samples, layout, cfg))
                shutil.rmtree(scratch / f"w{i}")
            rows.append({"zstd_level": level, "bf16_layout": lay, "writers": lanes,
                         "tokens_per_s": round(n * T / min(secs))})
    return {"hidden_size": hidden, "num_taps": len(TAPS), "tokens": n * T, "goal_tokens_per_s": 37_000,
            "configs": rows}


PARTS = {"parity": (part_parity, False), "capture": (part_capture, True), "attention": (part_attention, True),
         "fused_ce": (part_fused_ce, True), "writer": (part_writer, False)}
"""name -> (function, needs a GPU)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (seconds; figures meaningless)")
    ap.add_argument("--cpu-check", action="store_true", help="run the GPU parts on the CPU (use with --tiny)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    ap.add_argument("--pairs", type=int, default=5, help="interleaved pairs per timing")
    ap.add_argument("--capture-samples", type=int, default=96, help="conversations in the capture-overhead part")
    ap.add_argument("--capture-writers", default="1",
                    help="writer lanes the capture part times, comma-separated (the first gives the overhead ratio)")
    ap.add_argument("--ce-rows", type=int, default=16384, help="loss rows in the fused-CE part")
    ap.add_argument("--name", default="gpu.json", help="results file (under benchmarks/results unless absolute)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(PARTS)}")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    doc: dict[str, Any] = {"benchmark": "gpu", "what": __doc__.split("\n\n")[0], "command": vars(args),
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "results": {}}
    scratch = Path(tempfile.mkdtemp(prefix="tapdraft-gpu-"))
    failed = []
    try:
        for name in parts:
            fn, needs_gpu = PARTS[name]
            if needs_gpu and not cuda and not args.cpu_check:
                doc["results"][name] = {"skipped": "no CUDA device"}
                continue
            t0 = time.perf_counter()
            try:
                doc["results"][name] = fn(args, device, scratch)
            except Exception as e:  # noqa: BLE001 - one failing part must not lose the others' figures
                failed.append(name)
                doc["results"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            doc["results"][name]["part_seconds"] = round(time.perf_counter() - t0, 2)
            print(f"{name}: {json.dumps({k: v for k, v in doc['results'][name].items() if k != 'traceback'})}",
                  flush=True)
            write_result(args.name, {**doc, "machine_extra": {"device": doc["device"]}})
            if cuda:
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    doc["failed"] = failed
    write_result(args.name, {**doc, "machine_extra": {"device": doc["device"]}})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
