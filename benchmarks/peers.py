"""tapdraft's DFlash training step beside NVIDIA Model-Optimizer's, on the same samples and drafter shape.

The peer runs in its own venv built from pins (``engines/venv.sh modelopt``: nvidia-modelopt 0.47.0, torch
2.13.0 CPU, the transformers it allows), driven by ``engines/modelopt_runner.py``, which imports only the
peer's packages. This module builds a small tapdraft dataset itself, converts it to ModelOpt's offline
format (``to_modelopt``), then times interleaved pairs: one tapdraft step, one ModelOpt step, ...

Content: a synthetic target bundle at SmolLM2-135M's widths (``llama-576x8`` in benchmarks/shapes.py:
hidden 576, 9/3 heads, MLP 1536, vocab 49,152, 8 layers; random fp32-exact bf16 embedding and lm_head) and
``--samples`` samples of ``--tokens`` tokens (random ids, the second half supervised) whose taps are
DFlash's one-layer rule (layer 4) plus the last layer. Random activations are fine for time: it does not
depend on their values; the losses both sides report start near ln V = 10.8 and say they train the same rows.

The drafter on both sides: 1 draft layer at the target's widths, block 16, slot weights exp(-(k-1)/7),
``--anchors`` anchors per sequence whose block fits (tapdraft ``full_blocks_only``; ModelOpt samples them in
[0, T - 16]), frozen fp32 embedding and lm_head, AdamW (tapdraft's recipe lr, betas, weight decay; no
schedule, no clipping on either side), one micro-batch of every sample, the same batch every step (so both
have seen equal tokens after equal steps), one torch thread each, CE only (no distillation).
One step = forward + backward + optimizer step, timed inside each process.

Reported per side: median s/step, tokens/s (batch tokens / s), loss rows, peak RSS of the whole process
(interpreter, imports and data included; ru_maxrss), the loss per row after the warm-up + ``--pairs``
steps; and the median over pairs of peer s / tapdraft s, with the 1-minute load average at every pair.
Numbers taken beside other work on the machine are noisy: read the ratio (median of interleaved pairs) and
the load, not the absolute times.

    python -m benchmarks.peers [--pairs 5] [--anchors 32] [--samples 2] [--tokens 512] [--workdir DIR]

Not compared (say so in docs/performance.md): EAGLE-3 against ModelOpt's EAGLE-3 (its offline path
wants a different tap set; not built yet), speculators (its Trainer hard-codes CUDA and its FlexAttention
mask builder does not compile on CPU; issue 29 drove it at the model level by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.shapes import shape_facts, synthetic_dataset
from shards.reader import open_dataset
from shards.taps import default_tap_ids

SHAPE = "llama-576x8"
BLOCK = 16
GAMMA = 7.0
DRAFT_LAYERS = 1
ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "engines" / "modelopt_runner.py"


def build_dataset(root: Path, *, samples: int = 2, tokens: int = 512, seed: int = 0) -> Path:
    """The synthetic dataset at SHAPE, ``tokens`` a sample (built once per argument set; later runs reuse ``root``)."""
    return synthetic_dataset(root, SHAPE, samples=samples, tokens=(tokens, tokens), tag="peers", seed=seed,
                             draft_layers=DRAFT_LAYERS)


def to_modelopt(dataset: str | Path, out: Path, *, split: str = "train", draft_layers: int = DRAFT_LAYERS,
                limit: int | None = None) -> dict[str, Any]:
    """Convert a tapdraft dataset to ModelOpt's offline DFlash / EAGLE-3 format; returns the job facts.

    ModelOpt 0.47.0 reads (``modelopt/torch/speculative/eagle/utils.py``, ``OfflineSupervisedDataset``) one
    ``.pt`` file per sample holding a dict: ``input_ids`` [T] (int64), ``hidden_states`` [T, H] (the base
    model's last hidden), ``aux_hidden_states`` [T, n * H] (the captured layers, concatenated), an optional
    ``loss_mask`` [T] (read with ``answer_only_loss=True``) and ``hidden_states_prenorm`` (True: the last
    hidden is taken before the final norm, which ModelOpt re-applies when it needs logits). DFlash uses
    ``aux_hidden_states`` as its context (``plugins/modeling_dflash.py``, ``DFlashBaseModelOutput``) and picks
    the layers by the same rule as tapdraft's ``default_tap_ids`` (``build_target_layer_ids``), so the
    converter writes those taps in that order. Its frozen pieces come from a base checkpoint directory
    (``plugins/modeling_fakebase.py``, ``FakeBaseModel.from_source``: config.json + model.safetensors with
    ``model.embed_tokens.weight``, ``lm_head.weight``, ``model.norm.weight``), written as ``out/base``
    in fp32. Taps are stored as fp32 (exactly the dataset's bf16 values): the peer's draft runs in its base
    model's dtype.

    Layout of ``out``: ``base/`` and ``samples/NNNNNN.pt``; each file is written to a temp name and renamed.
    """
    from safetensors.torch import save_file

    ds = open_dataset(str(dataset))
    layout, bundle = ds.layout, ds.bundle()
    L = layout.num_layers
    aux = default_tap_ids(L, draft_layers)
    missing = [t for t in (*aux, L - 1) if t not in layout.tap_ids]
    if missing:
        raise ValueError(f"{dataset} stores taps {list(layout.tap_ids)}; ModelOpt's offline DFlash needs {aux} "
                         f"(its layer rule for {draft_layers} draft layer(s)) and the last layer {L - 1}: "
                         f"capture with --taps including {missing}")
    col = {t: j for j, t in enumerate(layout.tap_ids)}
    out = Path(out)
    base, samples = out / "base", out / "samples"
    base.mkdir(parents=True, exist_ok=True)
    samples.mkdir(parents=True, exist_ok=True)
    c = bundle.config
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": bundle.hidden_size,
              "num_hidden_layers": L, "vocab_size": bundle.vocab_size,
              "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
              "head_dim": c.get("head_dim", bundle.hidden_size // c["num_attention_heads"]),
              "intermediate_size": c["intermediate_size"], "rms_norm_eps": bundle.head.eps,
              "rope_theta": c.get("rope_theta", 10_000.0), "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "dtype": "float32"}
    _atomic_write(base / "config.json", lambda p: p.write_text(json.dumps(config, indent=2)))
    weights = {"model.embed_tokens.weight": bundle.embed_tokens.float().contiguous(),
               "lm_head.weight": bundle.lm_head.float().contiguous(),
               "model.norm.weight": bundle.norm_weight.float().contiguous()}
    _atomic_write(base / "model.safetensors", lambda p: save_file(weights, str(p)))
    n = ds.num_samples(split) if limit is None else min(limit, ds.num_samples(split))
    files = []
    for i in range(n):
        s = ds.sample(split, i)
        taps = s["taps"].float()  # [T, n_taps, H]
        doc = {"input_ids": s["input_ids"].long(),
               "hidden_states": taps[:, col[L - 1]].contiguous(),
               "aux_hidden_states": torch.cat([taps[:, col[t]] for t in aux], dim=-1).contiguous(),
               "loss_mask": s["loss_mask"].long(),
               "hidden_states_prenorm": True}
        path = samples / f"{i:06d}.pt"
        _atomic_write(path, lambda p, doc=doc: torch.save(doc, p))
        files.append(str(path))
    arch = {k: config[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")}
    return {"base": str(base), "files": files, "target_layer_ids": aux, "num_layers": L,
            "vocab_size": bundle.vocab_size, "hidden_size": bundle.hidden_size, "architecture": arch}


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class TapdraftSide:
    """tapdraft's ``dflash`` recipe at the peer's settings, one fixed micro-batch of every sample."""

    def __init__(self, data: Path, *, anchors: int, samples: int, tokens: int, mask_token_id: int) -> None:
        from train.config import load_run_config
        from train.data import BatchStream
        from train.drafters.base import combine_terms
        from train.loop import head_dtype, make_optimizer
        from train.run import build_drafter
        from train.source import open_source

        self.run = load_run_config("dflash", overrides=[
            f"num_anchors={anchors}", "full_blocks_only=true", f"mask_token_id={mask_token_id}",
            f"max_loss_rows={samples * tokens * BLOCK}", f"max_total_anchors={samples * anchors}",
            "head_dtype=float32", f"max_batch_size={samples}", f"max_tokens={samples * tokens}"])
        src = open_source(str(data))
        self.model = build_drafter(self.run, src)
        self.model.target.to_dtype(head_dtype(torch.device("cpu"), self.run.train.head_dtype))
        self.opt, _ = make_optimizer(self.model, self.run.train)
        for g in self.opt.param_groups:  # the schedule's constructor applied warm-up step 0 (lr / 100): undo it
            g["lr"] = self.run.train.lr
        stream = BatchStream(src.opener(seed=0, rank=0, world_size=1), max_tokens=self.run.train.max_tokens,
                             max_batch_size=self.run.train.max_batch_size)
        self.batch = next(stream)
        if len(self.batch["lengths"]) != samples:
            raise ValueError(f"the micro-batch holds {len(self.batch['lengths'])} of {samples} samples")
        self.tokens = int(self.batch["lengths"].sum())
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.combine = combine_terms

    def step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        lo = self.model(self.batch, torch.Generator().manual_seed(0))
        loss, _ = self.combine(lo.terms)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        s = time.perf_counter() - t0
        rows = int(sum(float(c) for k, (_, c) in lo.metrics.items() if k.startswith("acc@")))
        return {"s": s, "loss": float(loss.detach()), "rows": rows}


class ModelOptSide:
    """engines/modelopt_runner.py in the peer's venv, one step per request (stderr to ``log``)."""

    def __init__(self, python: Path, job: dict[str, Any], work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        job_path = work / "modelopt_job.json"
        job_path.write_text(json.dumps(job))
        self.log = work / "modelopt_runner.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(job.get("threads", 1)), "MKL_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen([str(python), str(RUNNER), str(job_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the ModelOpt runner exited ({self.proc.returncode}); its log "
                               f"{self.log} ends:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def step(self) -> dict[str, Any]:
        return self.ask("step")

    def close(self) -> dict[str, Any]:
        out = self.ask("exit")
        self.proc.wait(timeout=60)
        return out


def peer_python(name: str = "modelopt") -> Path:
    """The peer venv's python (``engines/venv.sh NAME`` builds it from its pins on first use: minutes)."""
    res = subprocess.run(["bash", str(ROOT / "engines" / "venv.sh"), name], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"engines/venv.sh {name} failed:\n{res.stderr[-3000:]}")
    return Path(res.stdout.strip().splitlines()[-1]) / "bin" / "python"


def modelopt_job(conv: dict[str, Any], run: Any, *, anchors: int, tokens: int, mask_token_id: int) -> dict[str, Any]:
    """The runner's job: the converted data and tapdraft's drafter and optimizer settings."""
    d, t = run.drafter, run.train
    return {"base": conv["base"], "files": conv["files"], "block_size": d.block_size, "num_anchors": anchors,
            "gamma": d.gamma, "mask_token_id": mask_token_id, "draft_layers": d.num_layers, "train_len": tokens,
            "lr": t.lr, "betas": [t.beta1, t.beta2], "weight_decay": t.weight_decay, "seed": 0, "threads": 1,
            "architecture": conv["architecture"]}


def _side(runs: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    s = statistics.median(r["s"] for r in runs)
    return {"s_per_step": s, "tokens_per_s": tokens / s, "runs_s": [r["s"] for r in runs],
            "loss_rows": runs[-1]["rows"], "losses": [r["loss"] for r in runs]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5, help="interleaved tapdraft / ModelOpt step pairs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence on both sides")
    ap.add_argument("--samples", type=int, default=2, help="samples in the micro-batch")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sample (a multiple of the block, 16)")
    ap.add_argument("--workdir", default="/tmp/tapdraft-peers", help="where the dataset and its conversion live")
    args = ap.parse_args(argv)
    if args.tokens % BLOCK:
        raise ValueError(f"--tokens must be a multiple of the block size {BLOCK} (ModelOpt refuses others)")
    torch.set_num_threads(1)
    work = Path(args.workdir)
    tag = f"{args.samples}x{args.tokens}"
    data = build_dataset(work / f"dataset-{tag}", samples=args.samples, tokens=args.tokens)
    conv = to_modelopt(data, work / f"modelopt-{tag}")
    mask = conv["vocab_size"] - 1  # the samples' ids stop below it
    tap = TapdraftSide(data, anchors=args.anchors, samples=args.samples, tokens=args.tokens, mask_token_id=mask)
    peer = ModelOptSide(peer_python(), modelopt_job(conv, tap.run, anchors=args.anchors, tokens=args.tokens,
                                                    mask_token_id=mask), work)
    print(f"trainable parameters: tapdraft {tap.trainable:,}  ModelOpt {peer.ready['trainable_params']:,}")
    first = {"tapdraft": [tap.step() for _ in range(args.warmup)], "modelopt": [peer.step() for _ in range(args.warmup)]}
    runs: dict[str, list[dict[str, Any]]] = {"tapdraft": [], "modelopt": []}
    loads = []
    for i in range(args.pairs):
        runs["tapdraft"].append(tap.step())
        runs["modelopt"].append(peer.step())
        loads.append(os.getloadavg()[0])
        print(f"pair {i + 1}/{args.pairs}: tapdraft {runs['tapdraft'][-1]['s']:.2f} s  "
              f"ModelOpt {runs['modelopt'][-1]['s']:.2f} s  load {loads[-1]:.1f}", flush=True)
    peak_peer = peer.close()["peak_rss"]
    peak_tap = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sides = {"tapdraft": {**_side(runs["tapdraft"], tap.tokens), "peak_rss_bytes": peak_tap,
                          "trainable_params": tap.trainable, "first_loss": first["tapdraft"][0]["loss"]},
             "modelopt": {**_side(runs["modelopt"], tap.tokens), "peak_rss_bytes": peak_peer,
                          "trainable_params": peer.ready["trainable_params"],
                          "first_loss": first["modelopt"][0]["loss"]}}
    ratio = statistics.median(m["s"] / t["s"] for m, t in zip(runs["modelopt"], runs["tapdraft"]))
    row = {"family": "dflash", "loss": "ce", "peer": "modelopt", "anchors_per_seq": args.anchors,
           "tokens": tap.tokens, **{k: v for k, v in sides.items()}, "peer_over_tapdraft": ratio,
           "load_avg_1m": loads}
    t, m = sides["tapdraft"], sides["modelopt"]
    print(f"\n| family, loss | tapdraft s/step | ModelOpt s/step | ModelOpt / tapdraft (median of pairs) | "
          f"tokens/s tapdraft / ModelOpt | peak RSS tapdraft / ModelOpt | loss/row after {args.warmup + args.pairs} "
          f"steps tapdraft / ModelOpt | load |")
    print(f"| DFlash CE, {args.anchors} anchors/seq ({t['loss_rows']} / {m['loss_rows']} rows) | "
          f"{t['s_per_step']:.2f} | {m['s_per_step']:.2f} | {ratio:.2f} | {t['tokens_per_s']:.0f} / "
          f"{m['tokens_per_s']:.0f} | {peak_tap / 2**30:.2f} / {peak_peer / 2**30:.2f} GiB | "
          f"{t['losses'][-1]:.3f} / {m['losses'][-1]:.3f} | {min(loads):.1f}-{max(loads):.1f} |")
    doc = {"benchmark": "peers", "shape": SHAPE, **shape_facts(SHAPE), "block_size": BLOCK, "gamma": GAMMA,
           "draft_layers": DRAFT_LAYERS, "samples": args.samples, "tokens_per_sample": args.tokens,
           "warmup": args.warmup, "pairs": args.pairs, "threads": 1, "rows": [row],
           "peer_versions": peer.ready["versions"],
           "not_run": {"eagle3_vs_modelopt": "not built yet (ModelOpt's offline EAGLE-3 wants its own aux layer "
                                             "set and a draft vocabulary mapping)",
                       "speculators": "its Trainer hard-codes CUDA and its FlexAttention mask builder does not "
                                      "compile on CPU"}}
    write_result("peers.json", doc)
    return doc


if __name__ == "__main__":
    main()
