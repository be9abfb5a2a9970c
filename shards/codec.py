"""Field codecs: one logical sample <-> a dict of named byte strings, whatever the container.

Both containers (Arrow IPC and WebDataset tar) store the same encoded fields, so this module is
the one home of the byte layout; the containers only add framing and compression (zstd).

    int32 / float32 fields   little-endian raw bytes
    bool fields              one byte per element (0/1); zstd makes them nearly free
    bf16 fields              lossless, ``bf16_layout``:
                               "planes": all high bytes (sign + 7 exponent bits), then all low bytes
                                         (1 exponent bit + mantissa). zstd finds the redundancy of the
                                         high plane that interleaved storage hides: trained MiniLM
                                         activations take 0.69x of the raw bf16 bytes vs 0.79x as
                                         uint16 words (benchmarks/storage.py), so planes is the default.
                               "raw":    the uint16 words as they are in memory; with uncompressed Arrow
                                         shards (zstd_level 0) the fastest read: a streamed sample's taps
                                         are a view of the bytes read (benchmarks/read.py).
                               "split":  the planes, compressed here rather than by the container: the high
                                         plane as one zstd frame made by ``SPLIT_PARAMS`` (entropy coding
                                         first: a match must be 7 bytes, so almost every byte is a
                                         Huffman-coded literal), then the low plane raw; the frame's
                                         length is the field's minus the element count. On the real
                                         targets' taps 0.704 / 0.698 of the raw bytes (planes + zstd-1:
                                         0.694 / 0.660) at 0.77-0.88 GB a CPU second to encode, 3.1-6.3x
                                         Arrow's zstd-1 and 1.9x python-zstandard's
                                         (benchmarks/storage.py, ``plane_report``): the writer's ceiling
                                         at a GPU's rate (docs/performance.md). With uncompressed Arrow
                                         shards (zstd_level 0) nothing compresses it twice.
                             Per plane (zstd-1, 1 MiB batches, benchmarks/storage.py): the high plane takes
                             0.25 (demo decoder) / 0.37 (the qwen3-shape content) of its bytes and decodes at
                             ~1.2 GB/s a core, which bounds reading compressed shards; the low plane gains 4.6%
                             / 0% and decodes at 20-30 GB/s (zstd keeps incompressible blocks raw), so storing
                             it apart uncompressed would save no read time and lose those bytes.
    taps with codec "fp8"    lossy: float8 e4m3 values [T, n, H] in ``taps`` and one float32 scale
                             per (token, tap) row in ``taps_scale`` [T, n] (scale = row amax / 448);
                             decoded back to bf16, so readers see the same dtype either way.
                             ``fp8_layout`` of the e4m3 values:
                               "packed": ``taps_exponent`` holds each value's sign+exponent field (byte
                                         >> 3, one byte each) and ``taps_mantissa`` its 3-bit mantissas,
                                         8 values into 3 bytes (little-endian, value i at bits 3i..3i+2,
                                         the last group zero-padded); there is no ``taps`` field, so a
                                         reader that predates the layout stops on the missing field
                                         instead of decoding exponents as values. Separate columns, so
                                         zstd compresses the skewed exponents apart from the near-random
                                         mantissas: on the trained demo decoder's taps 0.83x the bytes of
                                         "bytes" after zstd-1, on N(0, 1) 1.005x (benchmarks/storage.py);
                                         new fp8 datasets use it.
                               "bytes":  ``taps`` holds one e4m3 byte per value; what datasets whose
                                         metadata has no ``fp8_layout`` hold (read as such, never rewritten).

Shapes are not stored per field: T comes from ``input_ids``, R from ``topk_rows``, A from
``is_audio``, the rest from the layout (``FieldMeta``).
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from tapdraft.shards.schema import SCALAR_FIELDS, SCHEMA_VERSION, Layout, field_specs

assert sys.byteorder == "little", "tapdraft's byte layout assumes a little-endian host"

BF16_LAYOUTS = ("planes", "raw", "split")
SPLIT_PARAMS = {"strategy": zstandard.STRATEGY_FAST, "min_match": 7, "search_log": 1, "hash_log": 6, "chain_log": 6,
                "window_log": 19, "target_length": 0}
"""zstd parameters of the "split" layout's high-plane frame (the parameters are the encoder's; any zstd decodes it).
The sign + exponent bytes are low-entropy but have few long repeats: zstd-1's match search costs most of its time
and finds little, so the matches are cut to 7+ bytes in a tiny table and Huffman does the work (on SmolLM2's taps
0.408 of the plane at 0.64 GB a CPU second; zstd-1 0.390 at 0.28 in python-zstandard, 0.13 through Arrow's codec:
``benchmarks/storage.py``, storage_real_planes.json)."""
_zstd = threading.local()  # per-thread contexts: zstandard's are not thread-safe, the writer's lanes are threads


def _split_compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_zstd, "c"):
        _zstd.c = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**SPLIT_PARAMS))
    return _zstd.c


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_zstd, "d"):
        _zstd.d = zstandard.ZstdDecompressor()
    return _zstd.d
FP8_LAYOUTS = ("packed", "bytes")
LEGACY_FP8_LAYOUT = "bytes"
FP8_FIELDS = {"packed": ["taps_exponent", "taps_mantissa"], "bytes": ["taps"]}
"""The stored fields that hold fp8 taps' values, per layout (``fp8_to_bytes``' parts, in order)."""
"""The fp8 byte layout of metadata that does not name one (written before the layout was a choice)."""
FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value; a row's amax maps onto it."""

_NP = {torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.uint8}


@dataclass(frozen=True)
class FieldMeta:
    """What a decoder needs beyond the bytes: the layout and the bf16 (and fp8) byte layouts."""

    layout: Layout
    bf16_layout: str
    fp8_layout: str = LEGACY_FP8_LAYOUT
    """Byte layout of fp8 taps (FP8_LAYOUTS); recorded only for fp8 datasets, so bf16 metadata is unchanged."""

    def __post_init__(self) -> None:
        if self.fp8_layout not in FP8_LAYOUTS:
            raise ValueError(f"fp8_layout must be one of {FP8_LAYOUTS}, got {self.fp8_layout!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {"layout": self.layout.to_dict(), "bf16_layout": self.bf16_layout}
        if self.layout.taps_codec == "fp8":
            d["fp8_layout"] = self.fp8_layout
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FieldMeta":
        return cls(Layout.from_dict(d["layout"]), d["bf16_layout"], d.get("fp8_layout", LEGACY_FP8_LAYOUT))


def stored_fields(meta: FieldMeta) -> list[str]:
    """Names of the encoded byte fields, in column order."""
    names = list(field_specs(meta.layout))
    if meta.layout.taps_codec == "fp8":
        i = names.index("taps")
        names[i:i + 1] = FP8_FIELDS[meta.fp8_layout] + ["taps_scale"]
    return names


def shard_metadata(meta: FieldMeta, fingerprint: str | None, lineage: str | None = None) -> dict[str, Any]:
    """The fields' metadata every shard carries (an Arrow schema's ``tapdraft`` JSON; a tar sample's ``field_meta``
    is its ``FieldMeta.to_dict``) and, without ``lineage``, the manifest's ``field_meta``."""
    dtypes = {name: str(dt).replace("torch.", "") for name, (dt, _) in field_specs(meta.layout).items()}
    shapes = {name: list(shape) for name, (_, shape) in field_specs(meta.layout).items()}
    if meta.layout.taps_codec == "fp8":
        dtypes["taps_stored"] = "float8_e4m3fn"
        dtypes["taps_scale"] = "float32"
        shapes["taps_scale"] = ["T", meta.layout.n_taps]
        if meta.fp8_layout == "packed":  # the e4m3 values split into two fields (stored_fields)
            dtypes["taps_exponent"] = "uint8 (e4m3 sign+exponent: byte >> 3)"
            dtypes["taps_mantissa"] = "uint3, 8 per 3 bytes"
            shapes["taps_exponent"] = shapes["taps_mantissa"] = shapes["taps"]
    out = {"schema_version": SCHEMA_VERSION, **meta.to_dict(), "dtypes": dtypes, "shapes": shapes,
           "fingerprint": fingerprint}
    if lineage is not None:
        out["lineage"] = lineage
    return out


def bf16_to_bytes(t: torch.Tensor, bf16_layout: str) -> bytes | memoryview:
    """bf16 tensor -> its stored bytes (for "planes" a view of one buffer written once, for "raw" a view of the
    tensor's memory: no intermediate copies).

    Planes are computed on 16-bit words (high byte = word >> 8, low byte = word & 0xFF) straight into
    one output buffer: 3.8x faster than gathering the bytes with strided copies (benchmarks/read.py).
    """
    words = t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    if bf16_layout == "planes":
        n = words.size
        out = np.empty(2 * n, dtype=np.uint8)
        np.right_shift(words, 8, out=out[:n], casting="unsafe")
        np.bitwise_and(words, 0xFF, out=out[n:], casting="unsafe")
        return memoryview(out)
    if bf16_layout == "raw":
        return memoryview(words.view(np.uint8))  # the tensor's own bytes: the writer copies them once, into its file
    if bf16_layout == "split":
        n = words.size
        high = np.right_shift(words, 8).astype(np.uint8)
        frame = _split_compressor().compress(memoryview(high))
        out = np.empty(len(frame) + n, dtype=np.uint8)
        out[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        np.bitwise_and(words, 0xFF, out=out[len(frame):], casting="unsafe")
        return memoryview(out)
    raise ValueError(f"bf16_layout must be one of {BF16_LAYOUTS}, got {bf16_layout!r}")


def _shareable(arr: np.ndarray, itemsize: int) -> bool:
    """Whether a tensor may view ``arr``'s memory: writable (torch refuses read-only memory) and aligned."""
    return arr.flags.writeable and arr.ctypes.data % itemsize == 0


def bytes_to_bf16(data: bytes | memoryview, shape: tuple[int, ...], bf16_layout: str, *,
                  share: bool = False) -> torch.Tensor:
    """Inverse of ``bf16_to_bytes``; planes are joined with one 16-bit shift-or (no byte gathers).

    ``share``: for "raw", return a view of ``data`` instead of a copy when its memory is writable and
    2-byte aligned (the caller owns ``data`` and hands it over: the reader's freshly read record batch).
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    if bf16_layout == "split":
        return _split_to_bf16(raw, shape)
    n = raw.size // 2
    if raw.size != 2 * math.prod(shape):
        raise ValueError(f"bf16 field has {raw.size} bytes, expected {2 * math.prod(shape)} for shape {shape}")
    if bf16_layout == "planes":
        words = np.left_shift(raw[:n], 8, dtype=np.uint16)
        np.bitwise_or(words, raw[n:], out=words, casting="unsafe")
    elif bf16_layout == "raw":
        words = raw.view(np.uint16) if share and _shareable(raw, 2) else raw.view(np.uint16).copy()
    else:
        raise ValueError(f"bf16_layout must be one of {BF16_LAYOUTS}, got {bf16_layout!r}")
    return torch.from_numpy(words.view(np.int16).reshape(shape)).view(torch.bfloat16)


def _split_to_bf16(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """The "split" layout's field (high-plane zstd frame, then the low plane) -> bf16 [shape]."""
    n = math.prod(shape)
    if raw.size <= n:
        raise ValueError(f"bf16 split field has {raw.size} bytes, too few for its {n:,}-byte low plane and a frame")
    frame = raw[: raw.size - n].tobytes()
    try:  # the header's size first: a crafted frame must not make the decoder allocate what it declares
        declared = zstandard.frame_content_size(frame)
        if declared != n:
            raise ValueError(f"bf16 split field's high-plane frame declares {declared} bytes, expected {n} for shape "
                             f"{shape}: refusing it (the shard is damaged or crafted)")
        high = _decompressor().decompress(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"bf16 split field's high-plane frame does not decode: {e}") from None
    if len(high) != n:
        raise ValueError(f"bf16 split field's high plane has {len(high)} bytes, expected {n} for shape {shape}")
    words = np.left_shift(np.frombuffer(high, dtype=np.uint8), 8, dtype=np.uint16)
    np.bitwise_or(words, raw[raw.size - n:], out=words, casting="unsafe")
    return torch.from_numpy(words.view(np.int16).reshape(shape)).view(torch.bfloat16)


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] float -> (float8_e4m3fn [..., H], float32 scale [...]); scale = amax / 448 (1 for zero rows)."""
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fp8_encode`` up to e4m3 rounding, returned as bf16."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(torch.bfloat16)


def fp8_to_bytes(q: torch.Tensor, fp8_layout: str) -> list[bytes | memoryview]:
    """float8_e4m3fn tensor -> its stored parts: [bytes] for "bytes", [exponent plane, mantissas] for "packed"."""
    b = q.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
    if fp8_layout == "bytes":
        return [b.tobytes()]
    if fp8_layout != "packed":
        raise ValueError(f"fp8_layout must be one of {FP8_LAYOUTS}, got {fp8_layout!r}")
    n = b.size
    groups = -(-n // 8)
    m = np.zeros(8 * groups, dtype=np.uint32)
    np.bitwise_and(b, 7, out=m[:n], casting="unsafe")
    m = m.reshape(groups, 8)
    word = m[:, 0].copy()
    for i in range(1, 8):
        word |= m[:, i] << (3 * i)
    mant = np.ascontiguousarray(word.view(np.uint8).reshape(groups, 4)[:, :3])
    return [memoryview(np.right_shift(b, 3)), memoryview(mant.reshape(-1))]


def mantissa_bytes(n: int) -> int:
    """Bytes of ``n`` packed 3-bit mantissas."""
    return 3 * (-(-n // 8))


def bytes_to_fp8(parts: list[Any], shape: tuple[int, ...], fp8_layout: str) -> torch.Tensor:
    """Inverse of ``fp8_to_bytes``: float8_e4m3fn [shape]."""
    n = math.prod(shape)
    if fp8_layout not in FP8_LAYOUTS:
        raise ValueError(f"fp8_layout must be one of {FP8_LAYOUTS}, got {fp8_layout!r}")
    raw = np.frombuffer(parts[0], dtype=np.uint8)
    want = [n] if fp8_layout == "bytes" else [n, mantissa_bytes(n)]
    got = [raw.size] + [len(p) for p in parts[1:]]
    if got != want:
        raise ValueError(f"fp8 fields have {got} bytes, expected {want} for shape {shape} ({fp8_layout})")
    if fp8_layout == "bytes":
        b = raw.copy()
    else:
        groups = want[1] // 3
        w = np.zeros((groups, 4), dtype=np.uint8)
        w[:, :3] = np.frombuffer(parts[1], dtype=np.uint8).reshape(groups, 3)
        word = w.view(np.uint32).reshape(groups)
        m = np.empty((groups, 8), dtype=np.uint8)
        for i in range(8):
            np.bitwise_and(word >> (3 * i), 7, out=m[:, i], casting="unsafe")
        b = np.left_shift(raw, 3)
        b |= m.reshape(-1)[:n]
    return torch.from_numpy(b.reshape(shape)).view(torch.float8_e4m3fn)


def _plain_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.numpy().tobytes()


def encode_fields(sample: dict[str, Any], meta: FieldMeta) -> dict[str, bytes | memoryview]:
    """Encode the tensor fields of a (validated) sample into named bytes-like values."""
    out: dict[str, bytes] = {}
    for name, (dtype, _shape) in field_specs(meta.layout).items():
        t = sample[name]
        if name == "taps" and meta.layout.taps_codec == "fp8":
            q, scale = fp8_encode(t)
            out.update(zip(FP8_FIELDS[meta.fp8_layout], fp8_to_bytes(q, meta.fp8_layout)))
            out["taps_scale"] = scale.numpy().astype("<f4").tobytes()
        elif dtype == torch.bfloat16:
            out[name] = bf16_to_bytes(t, meta.bf16_layout)
        else:
            out[name] = _plain_bytes(t)
    return out


def _plain(data: Any, dtype: torch.dtype, shape: tuple[int, ...], share: bool = False) -> torch.Tensor:
    arr = np.frombuffer(data, dtype=_NP[dtype])
    if arr.size != math.prod(shape):
        raise ValueError(f"field has {arr.size} elements, expected shape {shape}")
    arr = arr.reshape(shape)
    t = torch.from_numpy(arr if share and _shareable(arr, arr.itemsize) else arr.copy())
    return t.to(torch.bool) if dtype == torch.bool else t


def decode_fields(fields: dict[str, Any], scalars: dict[str, Any], meta: FieldMeta, *,
                  share: bool = False) -> dict[str, Any]:
    """Inverse of ``encode_fields``: byte fields + scalar fields -> a logical sample dict.

    ``share``: tensors may view the fields' memory instead of copying it (where the layout allows:
    plain fields and "raw" bf16), for callers that own the fields' buffers and keep no other reference.
    """
    layout = meta.layout
    sample: dict[str, Any] = {k: scalars[k] for k in SCALAR_FIELDS}
    sample["audio_seconds"] = float(sample["audio_seconds"])
    T = len(fields["input_ids"]) // 4
    dims: dict[str, int] = {"T": T}
    sample["input_ids"] = _plain(fields["input_ids"], torch.int32, (T,), share)
    sample["is_audio"] = _plain(fields["is_audio"], torch.bool, (T,), share)
    dims["A"] = int(sample["is_audio"].sum())
    if "topk_rows" in fields:
        dims["R"] = len(fields["topk_rows"]) // 4
    for name, (dtype, shape) in field_specs(layout).items():
        if name in sample:
            continue
        shp = tuple(dims[s] if isinstance(s, str) else s for s in shape)
        if name == "taps" and layout.taps_codec == "fp8":
            q = bytes_to_fp8([fields[f] for f in FP8_FIELDS[meta.fp8_layout]], shp, meta.fp8_layout)
            scale = torch.from_numpy(np.frombuffer(fields["taps_scale"], dtype="<f4").reshape(shp[:-1]).copy())
            sample["taps"] = fp8_decode(q, scale)
        elif dtype == torch.bfloat16:
            sample[name] = bytes_to_bf16(fields[name], shp, meta.bf16_layout, share=share)
        else:
            sample[name] = _plain(fields[name], dtype, shp, share)
    return sample
