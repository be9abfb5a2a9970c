"""DFlash2 path selector: scores and CE under both gold-miss policies vs a float64 per-row reference."""

import math

import pytest
import torch

from tapdraft.train.drafters.dflash2.selector import PathSelector, greedy_walk, selector_loss


def _selector(V=30, H=8, r=5, K=4, seed=0, trained=True):
    torch.manual_seed(seed)
    sel = PathSelector(V, H, rank=r, num_candidates=K).double()
    if trained:  # a learned selector: B no longer zero
        with torch.no_grad():
            sel.successor_codebook.normal_(0, 1.0)
            sel.predecessor_codebook.normal_(0, 1.0)
    return sel


def _ref(sel, logits, h, prev, gold, valid, policy, weight):
    """Per-row float64 loops over explicit formulas; loss and count are weighted by ``weight``."""
    A, B = sel.predecessor_codebook.detach(), sel.successor_codebook.detach()
    W = sel.hidden_projection.weight.detach()
    K = sel.num_candidates
    loss, count, hits, sel_ok, bb_ok, n = 0.0, 0, 0, 0, 0, 0
    for i in range(logits.shape[0]):
        if not valid[i]:
            continue
        n += 1
        row = logits[i].tolist()
        order = sorted(range(len(row)), key=lambda v: -row[v])[:K]
        wh = [sum(W[j, c].item() * h[i, c].item() for c in range(h.shape[1])) for j in range(W.shape[0])]

        def score(b):
            return row[b] + sum(A[prev[i], j].item() * wh[j] * B[b, j].item() for j in range(len(wh)))

        scores = [score(b) for b in order]
        g = int(gold[i])
        bb_ok += order[0] == g
        sel_ok += order[max(range(K), key=lambda j: scores[j])] == g
        if g in order:
            hits += 1
            t = order.index(g)
        elif policy == "drop":
            continue
        else:
            scores[-1] = score(g)
            t = K - 1
        m = max(scores)
        loss += -weight[i].item() * (scores[t] - m - math.log(sum(math.exp(s - m) for s in scores)))
        count += weight[i].item()
    return loss, count, hits, sel_ok, bb_ok, n


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("policy", ["drop", "insert"])
def test_selector_loss_matches_reference(policy, weighted):
    sel = _selector()
    g = torch.Generator().manual_seed(1)
    N, V, H = 40, 30, 8
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    prev = torch.randint(0, V, (N,), generator=g)
    # half the golds from the top-4 so both hits and misses occur
    top = logits.topk(4, dim=-1).indices
    from_top = top[torch.arange(N), torch.randint(0, 4, (N,), generator=g)]
    gold = torch.where(torch.rand(N, generator=g) < 0.5, from_top, torch.randint(0, V, (N,), generator=g))
    valid = torch.rand(N, generator=g) < 0.8
    # position-decay weights exp(-(k-1)/gamma) of a 5-slot block, or none (every row 1)
    w = torch.exp(-(torch.arange(N) % 5).double() / 4.0) if weighted else None
    out = selector_loss(sel, logits, h, prev, gold, valid, gold_miss=policy, weight=w)
    loss, count, hits, sel_ok, bb_ok, n = _ref(sel, logits, h, prev, gold, valid, policy,
                                               torch.ones(N, dtype=torch.float64) if w is None else w)
    assert 0 < hits < n
    assert abs(out.loss_sum.item() - loss) < 1e-9 * max(1.0, loss)
    assert abs(float(out.count) - count) < 1e-9 * max(1.0, count)
    assert (int(out.gold_in_candidates), int(out.selector_correct), int(out.backbone_correct), int(out.valid)) == (
        hits, sel_ok, bb_ok, n)
    if not weighted:
        assert int(out.count) == (hits if policy == "drop" else n)
    m = out.metrics()
    assert m["selector_candidate_recall"] == hits / n


def test_fresh_selector_is_a_noop_and_learns():
    sel = _selector(trained=False).float()
    g = torch.Generator().manual_seed(2)
    N, V, H = 64, 30, 8
    logits = torch.randn(N, V, generator=g)
    h = torch.randn(N, H, generator=g)
    prev = torch.randint(0, V, (N,), generator=g)
    cand, U = sel.candidates(logits)
    torch.testing.assert_close(sel.scores(prev, h, cand, U), U, rtol=0, atol=0)
    blocks = greedy_walk(sel, logits.view(8, 8, V), h.view(8, 8, H), prev[:8])
    torch.testing.assert_close(blocks[:, 1:], logits.view(8, 8, V)[:, 1:].argmax(-1))
    assert torch.equal(blocks[:, 0], prev[:8])
    # gold = the 2nd candidate whenever prev is even: only the pair term can learn that
    gold = torch.where(prev % 2 == 0, cand[:, 1], cand[:, 0])
    logits = logits.clone().requires_grad_(False)
    opt = torch.optim.Adam(sel.parameters(), lr=0.05)
    valid = torch.ones(N, dtype=torch.bool)
    first = selector_loss(sel, logits, h, prev, gold, valid)
    for _ in range(60):
        opt.zero_grad()
        out = selector_loss(sel, logits, h, prev, gold, valid)
        out.loss_sum.backward()
        opt.step()
    assert int(first.selector_correct) == int(first.backbone_correct)
    assert out.loss_sum.item() < 0.5 * first.loss_sum.item()
    assert int(out.selector_correct) > int(out.backbone_correct)


def test_greedy_walk_feeds_each_choice_forward():
    sel = _selector(V=12, H=4, r=3, K=3, seed=3)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    h = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    first = torch.tensor([3, 7])
    got = greedy_walk(sel, logits, h, first)
    for n in range(2):
        prev = int(first[n])
        for k in range(1, 5):
            cand, U = sel.candidates(logits[n, k][None])
            S = sel.scores(torch.tensor([prev]), h[n, k][None], cand, U)
            prev = int(cand[0, int(S.argmax())])
            assert int(got[n, k]) == prev


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="num_candidates"):
        PathSelector(10, 4, num_candidates=11)
    sel = _selector()
    z = torch.zeros(2, 30, dtype=torch.float64)
    with pytest.raises(ValueError, match="gold_miss"):
        selector_loss(sel, z, torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2), torch.zeros(2),
                      torch.ones(2, dtype=torch.bool), gold_miss="skip")
