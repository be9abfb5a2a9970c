"""DFlash2 and LiLiCorr drafts in vLLM's V1 model runner (the one vLLM runs on a CPU): DFlash's proposer with a
candidate head's walk where DFlash takes each slot's argmax.

vLLM 0.32 drafts these candidate-head drafts only in its V2 runner (``v1/worker/gpu/spec_decode/dflash2/
speculator.py``, and ``lilicorr/speculator.py`` on top of it), which needs Triton; a CPU build has no Triton
backend, so ``VllmConfig`` picks V1 there and refuses them (``_get_v1_model_runner_unsupported_features``: "DFlash
candidate-head drafts", because V1's ``DFlashProposer`` would draft the backbone's argmax and silently serve them
as DFlash). Everything else they need, V1 already runs: it builds the draft from the export's ``architectures``
(``DFlash2Qwen3ForCausalLM``, ``LiLiCorrForCausalLM``), whose decoder layers apply DFlash2's grouped convolutions
themselves (``qwen3_dflash2.py``: a torch path when the tensors are not CUDA), over the query rows V1 lays out as
V2 does (per request the anchor then the mask tokens, ``1 + K`` rows end to end: the convolution's
``row % block_size`` is each row's slot); the context K/V, the attention and the verification (one path of drafts a
round) are DFlash's. What V1 lacks is the sampling step only, which this module supplies, as V2's speculators do:

    candidates, unary = compute_candidates(h)          top-k ids and logits (LiLiCorr: log-probs) a slot  [R, K, k]
    scores = DFlash2:  candidate_selector(candidates, unary, h, anchor ids)                        [R, K, k, k]
             LiLiCorr: lilicorr(Emb(candidates), unary, h, anchor state, anchor valid)
    tokens = walk(candidates, scores)                  slot 0 from predecessor index 0 (its rows all read the
                                                       anchor), then each slot's argmax on the row of the index
                                                       chosen before it (``_selector_walk_kernel`` at T = 0)

with the model's own ``compute_candidates``, ``candidate_selector`` / ``lilicorr`` (vLLM's code) and the walk
restated in torch (it indexes, it computes nothing; ``torch.argmax`` takes the first of equal maxima as the
kernel's ``tl.max`` does). The anchor ids are the query rows' first ids, where V1's input kernel writes each
request's bonus token. LiLiCorr's anchor state is ``LiLiCorrSpeculator.prepare_context_anchor``'s: the draft's
``hidden_norm`` of the combined target state at each request's last accepted context row (none: zeros, invalid);
its candidate embeddings are the target's (V1 shares the target's ``embed_tokens`` into a draft that has none).

Sampled requests: V2 samples the walk with Gumbel noise and caches the candidates' scores as the draft
distribution; here the walk is always greedy and no draft probabilities are returned, so V1's rejection sampler
treats the drafts as deterministic (its ``NO_DRAFT_PROBS`` path, as for n-gram drafts): still exact sampling from
the target, with a different acceptance than V2's. ``draft_sample_method: probabilistic`` is ignored with a warning.

Shapes: R requests, K drafted slots a round, N = R*K drafted rows, k candidates a slot, H hidden, T context rows.
"""

from __future__ import annotations

import torch

ARCHITECTURES = ("DFlash2DraftModel", "LiLiCorrDraftModel")
"""The architectures vLLM keys candidate-head drafts on (its V2 speculator's switch, ``_is_dflash_candidate_draft``)."""
V1_REFUSAL = "DFlash candidate-head drafts"
"""The entry of ``_get_v1_model_runner_unsupported_features`` that refuses candidate-head drafts in V1."""


def walk(candidates_RKk: torch.Tensor, scores_RKkk: torch.Tensor) -> torch.Tensor:
    """The selector's greedy walk: tokens [R, K]. ``scores_RKkk[r, l, p, c]`` scores candidate c of slot l after
    candidate p of slot l - 1 (slot 0: every p reads the anchor); the walk starts at p = 0."""
    R, K, _ = candidates_RKk.shape
    rows = torch.arange(R, device=candidates_RKk.device)
    prev = torch.zeros(R, dtype=torch.long, device=candidates_RKk.device)
    tokens = torch.empty(R, K, dtype=candidates_RKk.dtype, device=candidates_RKk.device)
    for slot in range(K):
        prev = scores_RKkk[rows, slot, prev].argmax(dim=-1)
        tokens[:, slot] = candidates_RKk[rows, slot, prev]
    return tokens


def head(model) -> str | None:
    """Which candidate head a V1 proposer's draft model has: ``dflash2`` (vLLM's ``CandidateSelector``),
    ``lilicorr`` (its ``LiLiCorrHead``) or None (a DFlash draft: V1's own sampling)."""
    inner = getattr(model, "model", None)
    if not hasattr(model, "compute_candidates") or inner is None:
        return None
    if hasattr(inner, "candidate_selector"):
        return "dflash2"
    if hasattr(inner, "lilicorr"):
        return "lilicorr"
    return None


def anchor_state(model, context_TH: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int,
                 num_rejected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """LiLiCorr's anchor: per request ``hidden_norm`` of the combined context state at its last accepted row, zero
    where it has none, and whether it has one ([R, H], [R])."""
    starts = query_start_loc[:num_reqs].long()
    ends = query_start_loc[1: num_reqs + 1].long()
    if num_rejected is not None:
        ends = ends - num_rejected[:num_reqs].long()
    valid = ends > starts
    rows = (ends - 1).clamp_min(0)
    return model.model.hidden_norm(context_TH[rows]) * valid[:, None], valid


def draft_tokens(model, hidden_NH: torch.Tensor, anchors_R: torch.Tensor,
                 anchor: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The drafts [R*K] from the drafted slots' final hidden states ``hidden_NH`` (N = R*K, request-major, as V1's
    ``token_indices_to_sample`` orders them), each request's anchor id and (LiLiCorr) its :func:`anchor_state`."""
    R = anchors_R.shape[0]
    candidates, unary = model.compute_candidates(hidden_NH)
    candidates = candidates.view(R, -1, candidates.shape[-1])
    unary = unary.view_as(candidates)
    h_RKH = hidden_NH.view(R, -1, hidden_NH.shape[-1])
    if head(model) == "dflash2":
        scores = model.model.candidate_selector(candidates, unary, h_RKH, anchors_R.long())
    else:
        assert anchor is not None, "LiLiCorr needs its anchor state"
        scores = model.model.lilicorr(model.model.embed_tokens(candidates), unary, h_RKH, *anchor)
    return walk(candidates, scores).flatten()


def install() -> bool:
    """Route DFlash2 and LiLiCorr through V1's ``DFlashProposer`` and lift V1's refusal of them; False where vLLM
    lacks a hook (then nothing is changed and vLLM refuses them in V1 as before)."""
    from vllm.config import VllmConfig
    from vllm.v1.spec_decode.dflash import DFlashProposer

    sample = getattr(DFlashProposer, "_sample_draft_tokens", None)
    first_pass = getattr(DFlashProposer, "set_inputs_first_pass", None)
    refusals = getattr(VllmConfig, "_get_v1_model_runner_unsupported_features", None)
    if sample is None or first_pass is None or refusals is None:
        return False
    if getattr(sample, "_tapdraft", False):
        return True

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        if head(self.model) == "lilicorr":
            self._tapdraft_anchor = anchor_state(self.model, target_hidden_states, cad.query_start_loc,
                                                 cad.batch_size(), num_rejected_tokens_gpu)
        return first_pass(self, target_token_ids=target_token_ids, next_token_ids=next_token_ids,
                          target_positions=target_positions, target_hidden_states=target_hidden_states,
                          token_indices_to_sample=token_indices_to_sample, cad=cad,
                          num_rejected_tokens_gpu=num_rejected_tokens_gpu)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if head(self.model) is None:
            return sample(self, hidden_states, sampling_metadata)
        if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
            from vllm.logger import init_logger

            init_logger(__name__).warning_once(
                "tapdraft-vllm: a candidate-head draft in the V1 runner drafts its greedy walk; "
                "draft_sample_method='probabilistic' is ignored (the drafts are verified as deterministic ones)")
        R = hidden_states.shape[0] // self.num_speculative_tokens
        q = 1 + self.num_speculative_tokens  # query rows per request: the anchor, then the mask tokens
        anchors = self.input_ids[: R * q: q]
        return draft_tokens(self.model, hidden_states, anchors, getattr(self, "_tapdraft_anchor", None)), None

    def _get_v1_model_runner_unsupported_features(self):
        out = refusals(self)
        archs = set(getattr(getattr(self.speculative_config, "draft_model_config", None), "architectures", None)
                    or [])
        if archs.intersection(ARCHITECTURES):
            out = [u for u in out if u != V1_REFUSAL]
        return out

    _sample_draft_tokens._tapdraft = True
    DFlashProposer.set_inputs_first_pass = set_inputs_first_pass
    DFlashProposer._sample_draft_tokens = _sample_draft_tokens
    VllmConfig._get_v1_model_runner_unsupported_features = _get_v1_model_runner_unsupported_features
    return True
