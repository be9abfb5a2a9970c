"""Row chunking: chunked == one chunk, values and gradients; spans cover every row once."""

import pytest
import torch

from tapdraft.shards.head import row_spans
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import kl_tv_full


def test_row_spans_cover_every_row_once():
    for n in (0, 1, 7, 16):
        for chunk in (-1, 0, 1, 3, 16, 40):
            spans = row_spans(n, chunk)
            assert [i for s, e in spans for i in range(s, e)] == list(range(n))
            assert all(e - s <= (chunk if chunk > 0 else n) for s, e in spans)
    assert row_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_row_chunks_equal_one_chunk_values_and_grads():
    g = torch.Generator().manual_seed(5)
    H, V, N = 6, 30, 11
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    h_t = torch.randn(N, H, generator=g, dtype=torch.float64)

    def run(chunk):
        h_s = torch.randn(N, H, generator=torch.Generator().manual_seed(6), dtype=torch.float64).requires_grad_(True)
        kl, tv = map_row_chunks(lambda a, b: kl_tv_full(a @ head.T, b @ head.T), [h_t, h_s], chunk)
        (kl.sum() + 2 * tv.sum()).backward()
        return kl.detach(), tv.detach(), h_s.grad

    one = run(0)
    for chunk in (1, 4, 11, 50):
        for a, b in zip(one, run(chunk)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="row count"):
        map_row_chunks(lambda a, b: (a,), [h_t, h_t[:3]], 2)
