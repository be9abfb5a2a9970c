"""A reader of CTranslate2's ``model.bin`` and the Whisper encoder it holds, as transformers' tensors.

CTranslate2 (``ctranslate2.specs.model_spec.ModelSpec._serialize``, binary version 6) writes, little-endian:
``u32 version``, ``str name``, ``u32 revision``, ``u32 n``; ``n`` times ``str name, u8 rank, u32 dims[rank],
u8 dtype, u32 nbytes, bytes``; then ``u32 n_aliases`` and that many ``str alias, str target`` pairs.
A ``str`` is ``u16 length`` (including a final NUL), the UTF-8 bytes and the NUL. Reading it here needs
no ctranslate2, which is kept as the reference the conversion is checked against (``build.py``).

Whisper's encoder spec (``WhisperSpec`` revision 3) names its variables ``encoder/conv1/weight``,
``encoder/layer_{i}/self_attention/linear_0/weight`` (q, k, v fused: [3 D, D]; only q and v have a
bias), ``.../linear_1`` (out), ``.../layer_norm``, ``encoder/layer_{i}/ffn/{linear_0,linear_1,layer_norm}``,
``encoder/position_encodings/encodings`` and ``encoder/layer_norm``; ``to_whisper_encoder`` maps them onto
``Qwen2AudioEncoder``'s (a Whisper encoder plus pooling) names.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

BINARY_VERSION = 6
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, None)  # CTranslate2's DataType order; None: bf16


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("H")
        s = self.data[self.pos:self.pos + n - 1].decode("utf-8")
        self.pos += n
        return s

    def raw(self, n: int) -> bytes:
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b


def read_model_bin(path: str | Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """``model.bin`` -> (header: name, revision, aliases; name -> tensor in its stored dtype)."""
    r = _Reader(Path(path).read_bytes())
    version = r.take("I")
    if version != BINARY_VERSION:
        raise ValueError(f"{path}: CTranslate2 binary version {version}, this reader knows {BINARY_VERSION}")
    name, revision, n = r.string(), r.take("I"), r.take("I")
    out: dict[str, torch.Tensor] = {}
    for _ in range(n):
        var = r.string()
        shape = [r.take("I") for _ in range(r.take("B"))]
        type_id, nbytes = r.take("B"), r.take("I")
        buf = r.raw(nbytes)
        if type_id == 5:
            t = torch.frombuffer(bytearray(buf), dtype=torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(buf, dtype=DTYPES[type_id]).copy())
        out[var] = t.reshape(shape)
    aliases = {r.string(): r.string() for _ in range(r.take("I"))}
    if r.pos != len(r.data):
        raise ValueError(f"{path}: {len(r.data) - r.pos} bytes left after the aliases; not a CTranslate2 model.bin")
    return {"name": name, "revision": revision, "aliases": aliases}, out


def to_whisper_encoder(ct2: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """CTranslate2 Whisper encoder variables -> ``Qwen2AudioEncoder`` state dict (float32)."""
    f = {k: v.float() for k, v in ct2.items() if k.startswith("encoder/") and k != "encoder/num_heads"}
    sd: dict[str, torch.Tensor] = {}

    def lin(dst: str, src: str, bias: bool = True) -> None:
        sd[f"{dst}.weight"] = f.pop(f"{src}/weight")
        if bias:
            sd[f"{dst}.bias"] = f.pop(f"{src}/bias")

    def norm(dst: str, src: str) -> None:
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = f.pop(f"{src}/gamma"), f.pop(f"{src}/beta")

    lin("conv1", "encoder/conv1")
    lin("conv2", "encoder/conv2")
    sd["embed_positions.weight"] = f.pop("encoder/position_encodings/encodings")
    norm("layer_norm", "encoder/layer_norm")
    for i in range(n_layers):
        src, dst = f"encoder/layer_{i}", f"layers.{i}"
        w = f.pop(f"{src}/self_attention/linear_0/weight")
        b = f.pop(f"{src}/self_attention/linear_0/bias")
        D = w.shape[1]
        q_w, k_w, v_w = w.split(D)
        q_b, k_b, v_b = b.split(D)
        if k_b.abs().max() != 0:
            raise ValueError(f"{src}: the key bias is not zero; Whisper's k_proj has no bias")
        sd |= {f"{dst}.self_attn.q_proj.weight": q_w, f"{dst}.self_attn.q_proj.bias": q_b,
               f"{dst}.self_attn.k_proj.weight": k_w,
               f"{dst}.self_attn.v_proj.weight": v_w, f"{dst}.self_attn.v_proj.bias": v_b}
        lin(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        lin(f"{dst}.fc1", f"{src}/ffn/linear_0")
        lin(f"{dst}.fc2", f"{src}/ffn/linear_1")
        norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
    if f:
        raise ValueError(f"encoder variables left unmapped: {sorted(f)[:5]}")
    return sd
