"""Byte codecs: bf16 layouts are bit-exact; fp8 stays within e4m3 rounding of a float64 reference."""

import numpy as np
import pytest
import torch

from tapdraft.shards.codec import FP8_MAX, bf16_to_bytes, bytes_to_bf16, bytes_to_fp8, fp8_decode, fp8_encode, fp8_to_bytes


@pytest.mark.parametrize("layout", ["planes", "raw", "split"])
def test_bf16_bit_exact(layout):
    x = (torch.randn(7, 3, 11) * 100).to(torch.bfloat16)
    x[0, 0, :3] = torch.tensor([0.0, -0.0, 1e-38]).to(torch.bfloat16)
    y = bytes_to_bf16(bf16_to_bytes(x, layout), tuple(x.shape), layout)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_planes_put_high_bytes_first():
    x = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # 0x3F80, 0xC000
    assert bf16_to_bytes(x, "planes") == bytes([0x3F, 0xC0, 0x80, 0x00])
    assert bf16_to_bytes(x, "raw") == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_split_is_a_standard_zstd_frame_of_the_high_plane_then_the_raw_low_plane():
    import zstandard

    x = (torch.randn(64, 9) * 3).to(torch.bfloat16)
    words = x.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    data = bytes(bf16_to_bytes(x, "split"))
    n = x.numel()
    assert data[-n:] == (words & 0xFF).astype(np.uint8).tobytes()
    assert zstandard.ZstdDecompressor().decompress(data[:-n]) == (words >> 8).astype(np.uint8).tobytes()


def test_a_split_frame_declaring_more_than_its_shape_is_refused_before_it_is_decoded():
    import zstandard

    x = torch.randn(16, 4).to(torch.bfloat16)
    n = x.numel()
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 26))  # 64 MiB of zeros in a few KiB
    with pytest.raises(ValueError, match=f"declares {1 << 26} bytes, expected {n}"):
        bytes_to_bf16(bomb + bytes(n), tuple(x.shape), "split")


@pytest.mark.parametrize("cut", ["truncated", "corrupt", "short"])
def test_a_bad_split_field_is_one_clear_error(cut):
    x = torch.randn(32, 8).to(torch.bfloat16)
    data = bytearray(bf16_to_bytes(x, "split"))
    if cut == "truncated":
        data = data[:5] + data[-x.numel():]
    elif cut == "corrupt":
        data[:4] = b"\0\0\0\0"  # not a zstd magic number
    else:
        data = data[-x.numel():]
    with pytest.raises(ValueError, match="bf16 split field"):
        bytes_to_bf16(bytes(data), tuple(x.shape), "split")


def test_fp8_against_float64_reference():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 256, generator=g, dtype=torch.float64)
         * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None, None])
    x[5, 1] = 0.0  # an all-zero row keeps scale 1 and decodes to zeros
    xb = x.to(torch.bfloat16)
    q, scale = fp8_encode(xb)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64, 3)
    y = fp8_decode(q, scale).to(torch.float64)
    ref = xb.to(torch.float64)
    amax = ref.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals (below 2^-6 of 448 units)
    # have absolute spacing 2^-9 scale units; bf16 output rounding adds 2^-8 relative.
    tol = ref.abs() * (2**-4 + 2**-8) + amax / FP8_MAX * 2**-9 + 1e-30
    assert bool(((y - ref).abs() <= tol).all())
    assert torch.equal(y[5, 1], torch.zeros(256, dtype=torch.float64))
    # the row maximum is represented exactly up to bf16 rounding of the decoded value
    np.testing.assert_allclose(y.abs().amax(-1).numpy(), ref.abs().amax(-1).numpy(), rtol=2**-8)


def _packed_reference(b: list[int]) -> tuple[bytes, bytes]:
    """The packed fp8 layout spelled out bit by bit: sign+exponent bytes; 3-bit mantissas, 8 per 3 bytes."""
    mant = []
    for g in range(0, len(b), 8):
        word = sum((v & 7) << (3 * i) for i, v in enumerate(b[g:g + 8]))
        mant += [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    return bytes(v >> 3 for v in b), bytes(mant)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 96 * 3])
def test_fp8_packed_layout_matches_its_definition_and_round_trips(n):
    g = torch.Generator().manual_seed(n)
    b = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    b[b == 0x7F] = 0  # e4m3fn NaN bit patterns never come out of fp8_encode
    b[b == 0xFF] = 0
    q = b.view(torch.float8_e4m3fn)
    se, mant = (bytes(p) for p in fp8_to_bytes(q, "packed"))
    assert (se, mant) == _packed_reference(b.tolist()) and len(mant) == 3 * (-(-n // 8))
    assert [bytes(p) for p in fp8_to_bytes(q, "bytes")] == [bytes(b.tolist())]
    for layout, parts in (("packed", [se, mant]), ("bytes", [bytes(b.tolist())])):
        back = bytes_to_fp8(parts, (n,), layout)
        assert back.dtype == torch.float8_e4m3fn and torch.equal(back.view(torch.uint8), b)
    with pytest.raises(ValueError, match="expected"):
        bytes_to_fp8([se, mant[:-1]], (n,), "packed")
