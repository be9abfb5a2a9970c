"""The target bundle of an HF-layout target at a real shape: what it holds, what opening it costs.

    python -m benchmarks.bundle [--layers 8] [--hidden 1024] [--vocab 151936]

A random-init Qwen3 (tied and untied) saved in bf16 with ``save_pretrained`` beside a tokenizer, i.e.
the directory a user points ``--target`` at. Figures per variant: the model directory's bytes, the
bundle's bytes against its parts (embedding + final norm + lm_head once + tokenizer files), and the
median of 5 interleaved pairs of opening it (``load_bundle``: the fingerprint is read, file sizes
checked) vs verifying it (``load_bundle(verify=True)``: every file re-hashed, as ``tapdraft verify``
does). The files are in the page cache for both sides.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from tapdraft.capture.targets.load import load_target
from tapdraft.shards.bundle import load_bundle, write_bundle


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(tmp: Path, *, tied: bool, layers: int, hidden: int, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tapdraft.demo.target import build_word_tokenizer

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
                      tie_word_embeddings=tied)
    model_dir = tmp / f"model-{'tied' if tied else 'untied'}"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    build_word_tokenizer([f"w{i}" for i in range(100)]).save_pretrained(model_dir)
    target = load_target(model_dir)
    out = tmp / f"bundle-{'tied' if tied else 'untied'}"
    write_s = _timed(lambda: write_bundle(out, **target.bundle_parts()))
    b = load_bundle(out)
    parts = b.embed_tokens.numel() * 2 + b.norm_weight.numel() * 2 + (0 if tied else b.lm_head.numel() * 2)
    parts += sum(len(v) for v in b.tokenizer_files.values())
    opens, verifies = [], []
    for _ in range(5):
        opens.append(_timed(lambda: load_bundle(out)))
        verifies.append(_timed(lambda: load_bundle(out, verify=True)))
    row = {"tied": tied, "model_dir_bytes": _dir_bytes(model_dir), "bundle_bytes": _dir_bytes(out),
           "parts_bytes": parts, "write_s": write_s, "open_s": statistics.median(opens),
           "verify_s": statistics.median(verifies), "dtype": str(b.embed_tokens.dtype)}
    row["bundle_over_parts"] = row["bundle_bytes"] / parts
    row["open_over_verify"] = row["open_s"] / row["verify_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for tied in (True, False):
            rows.append(measure(Path(d), tied=tied, layers=a.layers, hidden=a.hidden, vocab=a.vocab))
    print(f"{'head':7s} {'model dir':>10s} {'bundle':>10s} {'bundle/parts':>12s} {'open s':>8s} {'verify s':>9s} "
          f"{'open/verify':>11s}")
    for r in rows:
        print(f"{'tied' if r['tied'] else 'untied':7s} {r['model_dir_bytes'] / 1e6:9.1f}M "
              f"{r['bundle_bytes'] / 1e6:9.1f}M "
              f"{r['bundle_over_parts']:12.4f} {r['open_s']:8.3f} {r['verify_s']:9.3f} {r['open_over_verify']:11.3f}")
    write_result("bundle.json", {"shape": vars(a), "rows": rows, "machine_extra": {"threads": torch.get_num_threads()}})


if __name__ == "__main__":
    main()
