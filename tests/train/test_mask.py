"""The draft visibility rule: mask_mod vs a hand-written reference; Flex vs dense SDPA."""

import pytest
import torch

from tapdraft.train.drafters.common.layers import Attention, RotaryEmbedding
from tapdraft.train.drafters.common.mask import dense_mask, draft_mask_mod, flex_block_mask, flex_tile


def reference_mask(anchors, valid, T, B, window=None):
    """Loop-by-loop statement of the rule (independent of draft_mask_mod): slot s of block j, at position
    anchor + s, sees the context before its anchor and, with a window, only keys fewer than W positions behind it."""
    Bs, N = anchors.shape
    m = torch.zeros(Bs, 1, N * B, T + N * B, dtype=torch.bool)
    for b in range(Bs):
        for j in range(N):
            for s in range(B):
                q = j * B + s
                if valid[b, j]:
                    for kv in range(int(anchors[b, j])):
                        m[b, 0, q, kv] = window is None or int(anchors[b, j]) + s - kv < window
                for s2 in range(B):
                    m[b, 0, q, T + j * B + s2] = True
    return m


def cases():
    T, B = 20, 4
    # overlapping anchors (3 and 4 share slots' positions), anchors near the end, padding blocks
    anchors = torch.tensor([[0, 3, 4, 18], [5, 19, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    return anchors, valid, T, B


def test_dense_mask_matches_reference():
    anchors, valid, T, B = cases()
    got = dense_mask(torch.where(valid, anchors, 0), T, B)
    assert torch.equal(got, reference_mask(anchors, valid, T, B))
    # every query row sees at least its own block: no fully masked (NaN) rows
    assert bool(got.any(-1).all())


@pytest.mark.parametrize("window", [4, 5, 9])
def test_windowed_mask_matches_reference(window):
    anchors, valid, T, B = cases()
    a = torch.where(valid, anchors, 0)
    got = dense_mask(a, T, B, window)
    assert torch.equal(got, reference_mask(anchors, valid, T, B, window))
    assert torch.equal(dense_mask(a, T, B, T + B), dense_mask(a, T, B))  # a window past every key: no window
    # block 3 of row 0 (anchor 18): slot 0 sees 18 - W < kv < 18, the last slot one key fewer
    q0, q3 = 3 * B, 3 * B + 3
    assert got[0, 0, q0, :T].nonzero().flatten().tolist() == list(range(max(0, 19 - window), 18))
    assert got[0, 0, q3, :T].nonzero().flatten().tolist() == list(range(max(0, 22 - window), 18))
    assert got[0, 0, q3, T + 3 * B:T + 4 * B].all()  # the own block, whole


def test_mask_keys_on_anchor_position_not_block_index():
    anchors = torch.tensor([[7, 7, 2]])  # unsorted on purpose: the rule must not assume j order
    m = dense_mask(anchors, 10, 2)
    assert m[0, 0, 0, :7].all() and not m[0, 0, 0, 7:10].any()
    assert m[0, 0, 4, :2].all() and not m[0, 0, 4, 2:10].any()


def test_block_mask_matches_dense():
    anchors, valid, T, B = cases()
    a = torch.where(valid, anchors, 0)
    bm = flex_block_mask(a, T, B, mask_block=16)
    dense_from_block = bm.to_dense()  # [Bs, 1, nQ, nKV] block occupancy
    m = dense_mask(a, T, B)
    # every allowed element must lie in a non-empty block (BlockMask is a superset at block level)
    Bs, _, Q, KV = m.shape
    for b in range(Bs):
        for q in range(Q):
            for kv in torch.nonzero(m[b, 0, q]).flatten().tolist():
                assert dense_from_block[b, 0, q // 16, kv // 16]
    with pytest.raises(ValueError):
        flex_tile(24)


@pytest.mark.parametrize("kv_heads,window", [(1, None), (2, None), (2, 6)])
def test_flex_forward_matches_dense_sdpa_cpu(kv_heads, window):
    torch.manual_seed(0)
    Bs, N, B, T, H = 2, 5, 4, 37, 32
    anchors = torch.sort(torch.randint(0, T, (Bs, N)), dim=1).values
    anchors[1, 3:] = 0
    att = Attention(H, 4, kv_heads, 8).double()
    rot = RotaryEmbedding(8, 1e6)
    x = torch.randn(Bs, N * B, H, dtype=torch.float64)
    ctx = torch.randn(Bs, T, H, dtype=torch.float64)
    pos = (anchors[:, :, None] + torch.arange(B)).view(Bs, N * B)
    with torch.no_grad():
        pre = att.project_kv(ctx, rot(torch.arange(T)[None].expand(Bs, T)))
        dense = att(x, rot(pos), mask=dense_mask(anchors, T, B, window), kv_prefix=pre)
        flex = att(x, rot(pos), mask=flex_block_mask(anchors, T, B, 16, window), kv_prefix=pre)
    assert torch.allclose(dense, flex, atol=1e-10, rtol=0)


@pytest.mark.gpu
def test_flex_backward_matches_dense_gpu():
    torch.manual_seed(0)
    dev = "cuda"
    Bs, N, B, T, H = 2, 8, 16, 300, 64
    anchors = torch.sort(torch.randint(0, T, (Bs, N)), dim=1).values.to(dev)
    att = Attention(H, 4, 2, 16).to(dev)
    rot = RotaryEmbedding(16, 1e6).to(dev)
    x = torch.randn(Bs, N * B, H, device=dev)
    ctx = torch.randn(Bs, T, H, device=dev)
    pos = (anchors[:, :, None] + torch.arange(B, device=dev)).view(Bs, N * B)
    grads = []
    for mask in (dense_mask(anchors, T, B), flex_block_mask(anchors, T, B, 128)):
        att.zero_grad()
        pre = att.project_kv(ctx, rot(torch.arange(T, device=dev)[None].expand(Bs, T)))
        att(x, rot(pos), mask=mask, kv_prefix=pre).square().sum().backward()
        grads.append(att.q_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-3, rtol=1e-3)


def test_mask_mod_is_the_single_rule():
    anchors = torch.tensor([[3]])
    mm = draft_mask_mod(anchors, 5, 2)
    b, h = torch.tensor(0), torch.tensor(0)
    assert bool(mm(b, h, torch.tensor(1), torch.tensor(2)))
    assert not bool(mm(b, h, torch.tensor(1), torch.tensor(3)))
    assert bool(mm(b, h, torch.tensor(0), torch.tensor(6)))
