"""DFlash2 drafts in vLLM's V1 model runner (the one vLLM runs on a CPU): DFlash's proposer with the candidate
selector's walk where DFlash takes each slot's argmax.

vLLM 0.32 drafts DFlash2 only in its V2 runner (``v1/worker/gpu/spec_decode/dflash2/speculator.py``), which needs
Triton; a CPU build has no Triton backend, so ``VllmConfig`` picks V1 there and refuses the draft
(``_get_v1_model_runner_unsupported_features``: "DFlash candidate-head drafts", because V1's ``DFlashProposer``
would draft the backbone's argmax and silently serve DFlash2 as DFlash). Everything else DFlash2 needs, V1 already
runs: it builds the draft from the export's ``architectures`` (``DFlash2Qwen3ForCausalLM``), whose decoder layers
apply the grouped convolutions themselves (``qwen3_dflash2.py``: a torch path when the tensors are not CUDA), over
the query rows V1 lays out as V2 does (per request the anchor then the mask tokens, ``1 + K`` rows end to end:
the convolution's ``row % block_size`` is each row's slot); the context K/V, the attention and the verification
are DFlash's. What V1 lacks is the sampling step only, which this module supplies:

    candidates, unary = compute_candidates(h)            top-k ids and logits per drafted slot    [R, K, k]
    scores = candidate_selector(candidates, unary, h, anchors)   edge scores S(prev, cand)      [R, K, k, k]
    tokens = walk(candidates, scores)                    slot 0 from predecessor index 0 (its rows all read the
                                                         anchor), then each slot's argmax on the row of the index
                                                         chosen before it (``_selector_walk_kernel`` at T = 0)

the model's own ``compute_candidates`` and ``candidate_selector`` (vLLM's code) and the walk restated in torch
(it indexes, it computes nothing; ``torch.argmax`` takes the first of equal maxima as the kernel's ``tl.max``
does). The anchors are the query rows' first ids, where V1's input kernel writes each request's bonus token.

Sampled requests: V2 samples the walk with Gumbel noise and caches the candidates' scores as the draft
distribution; here the walk is always greedy and no draft probabilities are returned, so V1's rejection sampler
treats the drafts as deterministic (its ``NO_DRAFT_PROBS`` path, as for n-gram drafts): still exact sampling from
the target, with a different acceptance than V2's. ``draft_sample_method: probabilistic`` is ignored with a warning.

Shapes: R requests, K drafted slots a round, N = R*K drafted rows, k = ``selector_top_k`` candidates a slot, H hidden.
"""

from __future__ import annotations

import torch

ARCHITECTURE = "DFlash2DraftModel"
"""The architecture vLLM keys DFlash2 on (its V2 speculator's switch and ``_is_dflash_candidate_draft``)."""
V1_REFUSAL = "DFlash candidate-head drafts"
"""The entry of ``_get_v1_model_runner_unsupported_features`` that refuses candidate-head drafts in V1."""
OTHER_CANDIDATE_ARCHITECTURES = ("LiLiCorrDraftModel",)
"""Candidate-head drafts this module does not draft: V1 keeps refusing them."""


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


def draft_tokens(model, hidden_NH: torch.Tensor, anchors_R: torch.Tensor) -> torch.Tensor:
    """DFlash2's drafts [R*K] from the drafted slots' final hidden states ``hidden_NH`` (N = R*K, request-major, as
    V1's ``token_indices_to_sample`` orders them) and each request's anchor id."""
    R = anchors_R.shape[0]
    candidates, unary = model.compute_candidates(hidden_NH)
    candidates = candidates.view(R, -1, candidates.shape[-1])
    scores = model.model.candidate_selector(candidates, unary.view_as(candidates), hidden_NH.view(R, -1,
                                            hidden_NH.shape[-1]), anchors_R.long())
    return walk(candidates, scores).flatten()


def is_dflash2(model) -> bool:
    """Whether a V1 proposer's draft model is DFlash2's (a candidate head with vLLM's ``CandidateSelector``)."""
    return hasattr(model, "compute_candidates") and hasattr(getattr(model, "model", None), "candidate_selector")


def install() -> bool:
    """Route DFlash2 through V1's ``DFlashProposer`` and lift V1's refusal of it; False where vLLM lacks either
    hook (then nothing is changed and vLLM refuses DFlash2 in V1 as before)."""
    from vllm.config import VllmConfig
    from vllm.v1.spec_decode.dflash import DFlashProposer

    sample = getattr(DFlashProposer, "_sample_draft_tokens", None)
    refusals = getattr(VllmConfig, "_get_v1_model_runner_unsupported_features", None)
    if sample is None or refusals is None:
        return False
    if getattr(sample, "_tapdraft", False):
        return True

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not is_dflash2(self.model):
            return sample(self, hidden_states, sampling_metadata)
        if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
            from vllm.logger import init_logger

            init_logger(__name__).warning_once(
                "tapdraft-vllm: DFlash2 in the V1 runner drafts the selector's greedy walk; "
                "draft_sample_method='probabilistic' is ignored (the drafts are verified as deterministic ones)")
        R = hidden_states.shape[0] // self.num_speculative_tokens
        q = 1 + self.num_speculative_tokens  # query rows per request: the anchor, then the mask tokens
        anchors = self.input_ids[: R * q: q]
        return draft_tokens(self.model, hidden_states, anchors), None

    def _get_v1_model_runner_unsupported_features(self):
        out = refusals(self)
        spec = self.speculative_config
        archs = set(getattr(getattr(spec, "draft_model_config", None), "architectures", None) or [])
        if ARCHITECTURE in archs and not archs.intersection(OTHER_CANDIDATE_ARCHITECTURES):
            out = [u for u in out if u != V1_REFUSAL]
        return out

    _sample_draft_tokens._tapdraft = True
    DFlashProposer._sample_draft_tokens = _sample_draft_tokens
    VllmConfig._get_v1_model_runner_unsupported_features = _get_v1_model_runner_unsupported_features
    return True
