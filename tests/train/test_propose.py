"""A drafter's live proposal (``Drafter.propose``) drafts exactly what the trained drafter computes offline at
the same anchor.

Offline, the drafter sees the whole captured sequence and its visibility rule hides everything at
or after the anchor; online, the later positions do not exist yet. Both must give the same drafts.
"""

import pytest
import torch

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tests.train.dflash_fixtures import away_from_init
from tapdraft.train.data import collate
from tapdraft.train.drafters.base import Drafter
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.drafters.dflash2.model import DFlash2Drafter
from tapdraft.train.drafters.mtp.config import MTPConfig
from tapdraft.train.drafters.mtp.model import MTPDrafter

V, H, L, T = 48, 16, 4, 20


def _bundle():
    g = torch.Generator().manual_seed(0)
    cfg = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L, "vocab_size": V, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    return TargetBundle(config=cfg, audio={}, chat_template=None, embed_tokens=torch.randn(V, H, generator=g),
                        norm_weight=1 + 0.1 * torch.randn(H, generator=g), lm_head=torch.randn(V, H, generator=g))


def _sample(layout):
    g = torch.Generator().manual_seed(1)
    return {"sample_id": "s", "source": "t", "audio_seconds": 0.0,
            "input_ids": torch.randint(4, V, (T,), generator=g).int(), "is_audio": torch.zeros(T, dtype=torch.bool),
            "loss_mask": torch.ones(T, dtype=torch.bool),
            "taps": torch.randn(T, layout.n_taps, H, generator=g).bfloat16()}


def _perturb(model):
    return away_from_init(model, 0.3, seed=2)


LAYOUT = Layout(hidden_size=H, num_layers=L, tap_ids=(1, 2, 3), top_k=0, audio_token_id=3)


@pytest.mark.parametrize("cls,cfg", [(DFlashDrafter, DFlashConfig(num_layers=2, block_size=5, target_layer_ids=(1, 2))),
                                     (DFlash2Drafter, DFlash2Config(num_layers=1, block_size=5, target_layer_ids=(1, 2),
                                                                    chunk_rows=0))])
@pytest.mark.parametrize("anchor", [3, 11, T - 2])
def test_dflash_family_proposals_equal_offline_blocks(cls, cfg, anchor):
    model = _perturb(cls.build(cfg, _bundle(), LAYOUT))
    s = _sample(LAYOUT)
    batch = collate([s])
    anchors = torch.tensor([[anchor]])
    with torch.no_grad():
        if cls is DFlash2Drafter:
            want = model.draft_blocks(batch, anchors)[0, 0, 1:]
        else:
            h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), anchors)
            want = model.logits(h[0, 0, 1:]).argmax(-1)
    propose = model.propose
    got, q = propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float(), temperature=0.0)
    assert got.tolist() == want.tolist() and q is None
    got_s, q_s = propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float(), temperature=1.0,
                         generator=torch.Generator().manual_seed(0))
    assert q_s.shape == (cfg.block_size - 1, V) and torch.allclose(q_s.sum(-1), torch.ones(cfg.block_size - 1))


@pytest.mark.parametrize("anchor", [2, 9, T - 4])
def test_mtp_proposals_chain_the_heads_like_the_offline_pass(anchor):
    layout = Layout(hidden_size=H, num_layers=L, tap_ids=(1, L - 1), top_k=0, audio_token_id=3)
    model = _perturb(MTPDrafter.build(MTPConfig(num_depths=3), _bundle(), layout))
    s = _sample(layout)
    propose = model.propose
    got, _ = propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float(), temperature=0.0)
    # offline: put the drafted tokens into the sequence; each depth at row anchor-1 must then predict them
    ids = s["input_ids"].clone()
    ids[anchor + 1 : anchor + 1 + len(got)] = got.int()
    with torch.no_grad():
        h = model.run_depths(collate([{**s, "input_ids": ids}]))["h"]
        want = [int(model.logits(k + 1, h[k][0, anchor - 1][None]).argmax()) for k in range(3)]
    assert got.tolist() == want


def test_fewer_mtp_drafts_are_the_chains_first_depths():
    layout = Layout(hidden_size=H, num_layers=L, tap_ids=(1, L - 1), top_k=0, audio_token_id=3)
    model = _perturb(MTPDrafter.build(MTPConfig(num_depths=3), _bundle(), layout))
    s = _sample(layout)
    args = (s["input_ids"][:10].long(), s["taps"][:9].float())
    full, _ = model.propose(*args)
    assert [model.propose(*args, drafts=n)[0].tolist() for n in (1, 2, 3)] == [full[:n].tolist() for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="1..3"):
        model.propose(*args, drafts=4)


def test_fewer_dflash_drafts_come_from_a_shorter_block_as_vllm_drafts_them():
    """vLLM's DFlash proposer at num_speculative_tokens=N runs a block of N + 1 (the anchor and N masks), attending
    both ways within it: the drafts of a shorter block, not the first N of the trained one. A draft of block 5
    drafting 2 equals the same weights built at block 3; the trained block's first slots differ from it (so cutting
    the trained block short would fail this)."""
    cfg = DFlashConfig(num_layers=2, block_size=5, target_layer_ids=(1, 2))
    model = _perturb(DFlashDrafter.build(cfg, _bundle(), LAYOUT))
    short = DFlashDrafter.build(DFlashConfig(num_layers=2, block_size=3, target_layer_ids=(1, 2)), _bundle(), LAYOUT)
    short.load_state_dict(model.state_dict())
    s = _sample(LAYOUT)
    b, anchors = collate([s]), torch.tensor([[11]])
    with torch.no_grad():
        ctx = model.context(b["taps"])
        h3 = model.block_hidden(b["input_ids"], ctx, anchors, 3)
        torch.testing.assert_close(h3, short.block_hidden(b["input_ids"], ctx, anchors))
        assert not torch.allclose(h3, model.block_hidden(b["input_ids"], ctx, anchors)[:, :, :3])
    args = (s["input_ids"][:12].long(), s["taps"][:11].float())
    assert model.propose(*args, drafts=2)[0].tolist() == short.propose(*args)[0].tolist()
    assert model.propose(*args, drafts=4)[0].tolist() == model.propose(*args)[0].tolist()


def test_the_replay_at_fewer_drafts_is_the_shorter_blocks_and_the_chains_first_depths():
    """``acceptance(drafts=N)`` (what speculate's offline replay reads) drafts as ``propose(drafts=N)`` does: a
    DFlash block of N + 1 counts as the same weights built at that block size; an MTP chain's first N depths count
    as in the full chain, and its rounds are replayed at N drafts."""
    s = _sample(LAYOUT)
    torch.manual_seed(0)
    cfg = DFlashConfig(num_layers=2, block_size=5, target_layer_ids=(1, 2))
    model = _perturb(DFlashDrafter.build(cfg, _bundle(), LAYOUT))
    short = DFlashDrafter.build(DFlashConfig(num_layers=2, block_size=3, target_layer_ids=(1, 2)), _bundle(), LAYOUT)
    short.load_state_dict(model.state_dict())
    for p in range(2, T - 1):  # the reply is the short block's own first draft at every anchor: its slot 1 all hits
        s["input_ids"][p + 1] = short.propose(s["input_ids"][: p + 1].long(), s["taps"][:p].float())[0][0]
    got, want = model.acceptance(collate([s]), drafts=2), short.acceptance(collate([s]))
    assert got.accepted.tolist() == want.accepted.tolist() and got.reached.tolist() == want.reached.tolist()
    assert (got.round_tokens, got.rounds) == (want.round_tokens, want.rounds)
    assert want.accepted[0] >= T - 4  # not a count of nothing
    # the trained block cut short counts otherwise: the check would catch it
    assert model.acceptance(collate([s])).accepted[:2].tolist() != want.accepted.tolist()
    layout = Layout(hidden_size=H, num_layers=L, tap_ids=(1, L - 1), top_k=0, audio_token_id=3)
    mtp = _perturb(MTPDrafter.build(MTPConfig(num_depths=3), _bundle(), layout))
    s = _sample(layout)
    full, two = mtp.acceptance(collate([s])), mtp.acceptance(collate([s]), drafts=2)
    assert two.accepted.tolist() == full.accepted[:2].tolist() and two.reached.tolist() == full.reached[:2].tolist()
    assert two.rounds >= full.rounds  # no round emits more than three tokens now


def test_a_family_that_walks_its_whole_block_refuses_fewer_drafts():
    cfg = DFlash2Config(num_layers=1, block_size=5, target_layer_ids=(1, 2), chunk_rows=0)
    model = _perturb(DFlash2Drafter.build(cfg, _bundle(), LAYOUT))
    s = _sample(LAYOUT)
    args = (s["input_ids"][:12].long(), s["taps"][:11].float())
    assert model.propose(*args, drafts=4)[0].tolist() == model.propose(*args)[0].tolist()
    with pytest.raises(ValueError, match="dflash2 draft drafts the 4 a round it was trained for"):
        model.propose(*args, drafts=2)


def test_a_family_without_proposals_says_so():
    class Silent(Drafter):
        family = "silent"

    with pytest.raises(NotImplementedError, match="no live proposals"):
        Silent(None, None, None).propose(torch.zeros(3, dtype=torch.long), torch.zeros(2, 1, H))


def _audio_sample(layout, n_audio=5):
    s = _sample(layout)
    g = torch.Generator().manual_seed(5)
    s["is_audio"][:n_audio] = True
    s["input_ids"][:n_audio] = layout.audio_token_id
    if layout.has_audio_embeds:
        s["audio_embeds"] = torch.randn(n_audio, H, generator=g).bfloat16()
    if layout.has_final_hidden:
        s["final_hidden"] = torch.randn(T, H, generator=g).bfloat16()
    return s


def _live_extras(s, anchor):
    """What the live decoder gives: the prompt's audio rows and embeddings, and final_hidden of the prefix."""
    ex = {"is_audio": s["is_audio"][:anchor]}
    if "audio_embeds" in s:
        emb = torch.zeros(anchor, H)
        emb[s["is_audio"][:anchor]] = s["audio_embeds"].float()
        ex["audio_embeds"] = emb
    if "final_hidden" in s:
        ex["final_hidden"] = s["final_hidden"][:anchor].float()
    return ex


@pytest.mark.parametrize("audio_embeds,tap_ids,final_hidden", [(True, (1, L - 1), False), (False, (1, 2), True),
                                                               (True, (1, 2), True)])
def test_live_mtp_reads_audio_frames_and_final_hidden_as_training_did(audio_embeds, tap_ids, final_hidden):
    layout = Layout(hidden_size=H, num_layers=L, tap_ids=tap_ids, top_k=0, audio_token_id=3,
                    has_audio_embeds=audio_embeds, has_final_hidden=final_hidden)
    model = _perturb(MTPDrafter.build(MTPConfig(num_depths=2), _bundle(), layout))
    s = _audio_sample(layout)
    anchor = 9
    got, _ = model.propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float(), temperature=0.0,
                           extras=_live_extras(s, anchor))
    ids = s["input_ids"].clone()
    ids[anchor + 1: anchor + 1 + len(got)] = got.int()
    with torch.no_grad():
        h = model.run_depths(collate([{**s, "input_ids": ids}]))["h"]
        want = [int(model.logits(k + 1, h[k][0, anchor - 1][None]).argmax()) for k in range(2)]
    assert got.tolist() == want
    if audio_embeds:  # the frame embeddings matter: the placeholder's embedding would draft otherwise
        with torch.no_grad():
            plain = {k: v for k, v in s.items() if k != "audio_embeds"}
            h0 = model.run_depths(collate([{**plain, "input_ids": ids}]))["h"]
        assert not torch.allclose(h0[0][0, anchor - 1], h[0][0, anchor - 1])
    if final_hidden and L - 1 not in tap_ids:
        with pytest.raises(ValueError, match="final_hidden"):
            model.propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float())


def test_dflash2_sampled_proposal_samples_through_the_selector():
    cfg = DFlash2Config(num_layers=1, block_size=5, target_layer_ids=(1, 2), chunk_rows=0, selector_candidates=4)
    torch.manual_seed(0)
    model = _perturb(DFlash2Drafter.build(cfg, _bundle(), LAYOUT))
    s = _sample(LAYOUT)
    anchor = 11
    args = (s["input_ids"][: anchor + 1].long(), s["taps"][:anchor].float())
    tok, q = model.propose(*args, temperature=1.0, generator=torch.Generator().manual_seed(0))
    # q of slot k is softmax(S(drafted_{k-1}, .)) over slot k's top-4 candidates, zero elsewhere
    b = collate([s])
    h = model.block_hidden(b["input_ids"], model.context(b["taps"]), torch.tensor([[anchor]]))[0, 0]
    z = model.logits(h)
    prev = torch.cat([s["input_ids"][anchor: anchor + 1].long(), tok[:-1]])
    for k in range(1, 5):
        cand, U = model.candidate_selector.candidates(z[k][None])
        S = model.candidate_selector.scores(prev[k - 1: k], h[k][None], cand, U)[0]
        want = torch.zeros(V).index_put_((cand[0],), torch.softmax(S, -1))
        torch.testing.assert_close(q[k - 1], want)
        assert int(tok[k - 1]) in cand[0].tolist()
    assert ((q > 0).sum(-1) <= 4).all() and torch.allclose(q.sum(-1), torch.ones(4))
    # the offline sampled acceptance reads the same distributions (given the same predecessors)
    torch.testing.assert_close(torch.softmax(model.slot_logits(h[1:], prev, 1.0), -1), q)
    # the backbone's own softmax puts mass on every id; the selector's distribution only on its candidates
    assert bool((torch.softmax(z[1:], -1) > 0).all()) and int((q == 0).sum(-1).min()) >= V - 4
    # a near-zero temperature is the greedy walk
    greedy, _ = model.propose(*args, temperature=0.0)
    cold, _ = model.propose(*args, temperature=1e-4, generator=torch.Generator().manual_seed(0))
    assert cold.tolist() == greedy.tolist()
