"""Batched generation with a KV cache on any :class:`capture.targets.base.Target`: the target's own replies.

One call decodes a batch of prompts (each a :class:`Prepared` rendered with the chat template's
generation prompt, audio already expanded by the adapter):

    prefill  left-padded prompt embeddings [B, P, H], position ids = cumsum(attention mask) - 1,
             through the base decoder with a DynamicCache; logits of the last row only
    step     next ids [B] at the next position of every row; finished rows keep feeding their stop
             id (their outputs are ignored), so the batch stays rectangular
    choose   greedy argmax, or temperature + top-p sampling with one torch.Generator per row, seeded
             from (seed, sample id, turn) by :func:`row_seed`: a row's draws never depend on its batch

Logits are ``Target.head.logits`` of the last layer's pre-norm output (the one head function, proven on
the model's own forward, that capture's teacher rows use), so a greedy reply is the argmax of the
stored teacher at every supervised row. Only the base decoder runs, and only the last row of a
prefill meets the lm_head (no [B, P, vocab] buffer).

With ``tap_ids`` the same pass keeps the taps (and the last layer's pre-norm output) of every
position: the prompt's from the prefill, each reply token's from the step that feeds it. The step
that feeds the last generated token is one forward more than plain generation needs (the fused
capture path pays it once per batch). Shapes: B batch, P padded prompt length, S steps, n taps, H width.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from tapdraft.capture.generation import Generation, GenerationConfig
from tapdraft.capture.hooks import LayerTaps
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.shards.order import epoch_rng


def row_seed(seed: int, sample_id: str, turn: int) -> int:
    """The seed of one reply's sampler: a pure function of (base seed, sample id, assistant turn)."""
    sid = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little")
    return int(epoch_rng(seed, turn, sid).integers(1 << 62))


def _choose(logits_BV: torch.Tensor, cfg: GenerationConfig, gens: list[torch.Generator] | None) -> torch.Tensor:
    if cfg.greedy:
        return logits_BV.argmax(-1)
    probs = torch.softmax(logits_BV.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        p_sorted, order = probs.sort(dim=-1, descending=True)
        drop = p_sorted.cumsum(-1) - p_sorted >= cfg.top_p  # the tokens after the nucleus is full
        p_sorted = p_sorted.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, p_sorted)
    assert gens is not None
    return torch.stack([torch.multinomial(probs[b], 1, generator=g)[0] for b, g in enumerate(gens)])


@torch.no_grad()
def generate(
    target: Target,
    batch: Sequence[Prepared],
    cfg: GenerationConfig,
    *,
    seeds: Sequence[int] | None = None,
    tap_ids: Sequence[int] | None = None,
) -> list[Generation]:
    """Decode one reply per prompt in ``batch``; ``seeds`` (one per row) are required when sampling."""
    from transformers import DynamicCache

    if not cfg.greedy and (seeds is None or len(seeds) != len(batch)):
        raise ValueError("sampling needs one seed per prompt (see row_seed)")
    exps = target.embed(batch)
    dev, B = target.device, len(exps)
    P = max(int(e.input_ids.shape[0]) for e in exps)
    H = exps[0].inputs_embeds.shape[-1]
    emb = torch.zeros(B, P, H, dtype=exps[0].inputs_embeds.dtype, device=dev)
    attn = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, e in enumerate(exps):
        T = int(e.input_ids.shape[0])
        emb[b, P - T:], attn[b, P - T:] = e.inputs_embeds, 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    gens = None if cfg.greedy else [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds or []]
    end_ids = target.end_token_ids()
    if not end_ids:
        raise ValueError("the target declares no end-of-turn token (eos_token_id in its config, generation config "
                         "or tokenizer); set one so replies can end")
    stops = torch.tensor(end_ids, device=dev)
    head, decoder = target.head, target.decoder
    L = target.num_layers
    keep = [L - 1] if tap_ids is None else sorted(set(tap_ids) | {L - 1})  # the last layer gives the logits
    prefill_taps: dict[int, torch.Tensor] = {}
    step_taps: list[dict[int, torch.Tensor]] = []
    cache = DynamicCache(config=target.lm_config)
    new = torch.empty(B, cfg.max_new_tokens, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    n_new = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated per row, stop id included
    bad = torch.zeros(B, dtype=torch.bool, device=dev)
    with LayerTaps(target.layers, keep) as hooks:
        decoder(inputs_embeds=emb, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        prefill_taps = dict(hooks.out)
        last_pos = pos[:, -1]
        steps = 0
        for s in range(cfg.max_new_tokens):
            logits = head.logits(hooks.out[L - 1][:, -1])  # the teacher's head: greedy = the stored top-1
            bad |= ~done & ~torch.isfinite(logits).all(-1)
            logits = torch.nan_to_num(logits, nan=0.0)
            nxt = torch.where(done, stops[0], _choose(logits, cfg, gens))
            new[:, s] = nxt
            n_new += (~done).long()
            done |= torch.isin(nxt, stops)
            steps = s + 1
            if steps == cfg.max_new_tokens or bool(done.all()):
                break
            _step(decoder, nxt, attn, last_pos, cache)
            attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            if tap_ids is not None:
                step_taps.append(dict(hooks.out))
        if tap_ids is not None:  # the last generated token has not been fed yet: one more step gives its states
            _step(decoder, new[:, steps - 1], attn, last_pos, cache)
            step_taps.append(dict(hooks.out))
    ids, lens, errors = new[:, :steps].tolist(), n_new.tolist(), bad.tolist()
    stop_set = set(stops.tolist())
    results = []
    for b, e in enumerate(exps):
        row = ids[b][: lens[b]]
        stop = row[-1] if row and row[-1] in stop_set else None
        g = Generation(row[:-1] if stop is not None else row, stop, e, error=errors[b],
                       audio_seconds=batch[b].audio_seconds)
        if tap_ids is not None:
            T, n = int(e.input_ids.shape[0]), len(g.ids)
            per = {i: torch.cat([prefill_taps[i][b, P - T:], *[st[i][b] for st in step_taps[:n]]]) for i in keep}
            g.taps = torch.stack([per[i] for i in tap_ids], dim=1)
            g.last = per[L - 1]
        results.append(g)
    return results


def _step(decoder, ids_B: torch.Tensor, attn_BT: torch.Tensor, last_pos_B: torch.Tensor, cache):
    """Feed one token per row at the next position (the attention mask grows by one)."""
    B = ids_B.shape[0]
    attn = torch.cat([attn_BT, torch.ones(B, 1, dtype=attn_BT.dtype, device=attn_BT.device)], dim=1)
    return decoder(input_ids=ids_B[:, None], attention_mask=attn, position_ids=(last_pos_B + 1)[:, None],
                   cache=cache, use_cache=True)
