"""DFlash2's path selector: re-rank each slot's top candidates by what the previous slot holds.

A DFlash block predicts all its slots in one non-causal pass, so slot k cannot know which token
slot k-1 will commit to. The selector adds that dependency cheaply. For every slot take the top-K
(K = 16) candidates of the draft's full logits and score candidate b after predecessor a as

    S(a, b) = U(b) + < A[a] * (W_h h), B[b] >

- U(b): the draft backbone's own logit of candidate b at this slot (unnormalised; any per-row
  constant such as the log-sum-exp cancels in the selector's softmax over candidates). It is not
  detached: the selector loss is a listwise CE over the candidates, so it also sharpens the
  backbone's ranking inside its top-K.
- A, B: rank-r (r = 256) token codebooks [V, r] (``predecessor_codebook``, ``successor_codebook``);
  A ~ N(0, 0.02), B = 0, so at initialisation S = U and the selector's path is the backbone's
  argmax (a no-op until it learns).
- W_h: [H -> r] without bias (``hidden_projection``, N(0, 0.02)), applied to the draft's final
  (normed) hidden state h of the slot.

Parameter names, shapes and initialisation are those of the public reference's
``CandidateSelector`` (NVIDIA-NeMo/Automodel,
nemo_automodel/components/speculative/dflash/draft_qwen3_dflash2.py): its codebooks are plain
[V, r] parameters, and its hidden projection gets the Qwen3 models' N(0, initializer_range 0.02).
- a: the predecessor token. Training is teacher-forced (a = the gold token at the previous
  position; slot 1's predecessor is the anchor token in slot 0); drafting walks greedily from
  slot 0, feeding each chosen token to the next slot (``walk``; sampled decoding draws from the
  selector's softmax over the candidates instead, and that is the draft's q).

Loss: CE over the K candidates' scores, target = the gold token's candidate index, each row
weighted by its slot's position decay (the backbone CE's weight; the reference's
``DFlash2TrainerModule`` in dflash2_core.py weights both terms alike). When gold is
not among the top-K the ``gold_miss`` policy decides: ``drop`` (default) leaves the row out of the
selector loss (it counts toward candidate recall only); ``insert`` replaces the lowest-ranked
candidate by gold (with U = its backbone logit), keeping K columns. Metrics: candidate recall,
selector-path accuracy (argmax S on the true top-K, teacher-forced) and backbone argmax accuracy.

Shapes: N rows (block slots flattened), V vocab, H hidden, K candidates, r codebook rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GOLD_MISS_POLICIES = ("drop", "insert")


class PathSelector(nn.Module):
    """Codebooks A, B and the hidden projection W_h of the path score S(a, b)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256, num_candidates: int = 16) -> None:
        super().__init__()
        if rank <= 0 or num_candidates <= 0 or num_candidates > vocab_size:
            raise ValueError(
                f"selector rank must be > 0 and num_candidates in [1, vocab {vocab_size}]; "
                f"got rank={rank}, num_candidates={num_candidates}"
            )
        self.num_candidates = num_candidates
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # A
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # B
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # W_h
        self.reset_codebooks()

    def reset_codebooks(self) -> None:
        """A ~ N(0, 0.02), B = 0 (the pair term starts at exactly zero), W_h ~ N(0, 0.02)."""
        nn.init.normal_(self.predecessor_codebook, mean=0.0, std=0.02)
        nn.init.zeros_(self.successor_codebook)
        nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=0.02)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K of the full logits [N, V] -> (ids int64 [N, K], U = their logits [N, K]), best first."""
        U, ids = logits.topk(self.num_candidates, dim=-1)
        return ids, U

    def scores(self, prev: torch.Tensor, h: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """S(a, b) for predecessor ``prev`` [N], hidden ``h`` [N, H], candidates [N, K] -> [N, K] float32+."""
        dtype = torch.promote_types(unary.dtype, torch.float32)
        u = F.embedding(prev.long(), self.predecessor_codebook).to(dtype) * self.hidden_projection(h).to(dtype)
        pair = torch.einsum("nr,nkr->nk", u, F.embedding(cand_ids.long(), self.successor_codebook).to(dtype))
        return unary.to(dtype) + pair


@dataclass
class SelectorOutput:
    """Un-normalised selector loss and metric counts for one micro-batch (the loop normalises)."""

    loss_sum: torch.Tensor
    """sum of weight x CE over the rows that train the selector (carries the gradient)."""
    count: torch.Tensor
    """sum of the weights of the rows in loss_sum (valid rows; under ``drop`` only those whose gold is a
    candidate); with no weights given, their number."""
    valid: torch.Tensor
    """valid rows seen (the denominator of the three rates below)."""
    gold_in_candidates: torch.Tensor
    """valid rows whose gold token is among the top-K (candidate recall = this / valid)."""
    selector_correct: torch.Tensor
    """valid rows where argmax S over the true top-K (teacher-forced predecessor) is gold."""
    backbone_correct: torch.Tensor
    """valid rows where the backbone's argmax is gold."""
    path: torch.Tensor | None = None
    """per valid row, the selector's teacher-forced choice (argmax S over the true top-K), detached."""

    def metrics(self) -> dict[str, float]:
        v = max(int(self.valid), 1)
        return {
            "selector_candidate_recall": int(self.gold_in_candidates) / v,
            "selector_path_acc": int(self.selector_correct) / v,
            "backbone_argmax_acc": int(self.backbone_correct) / v,
        }


def selector_loss(
    selector: PathSelector,
    logits: torch.Tensor,
    h: torch.Tensor,
    prev: torch.Tensor,
    gold: torch.Tensor,
    valid: torch.Tensor,
    *,
    gold_miss: str = "drop",
    weight: torch.Tensor | None = None,
) -> SelectorOutput:
    """Selector CE on the gold token's candidate index, rows flattened.

    ``logits`` [N, V] the draft's full logits, ``h`` [N, H] its final hidden states, ``prev`` [N]
    the teacher-forced predecessor tokens, ``gold`` [N] the targets, ``valid`` bool [N], ``weight``
    [N] each row's weight (DFlash2: its slot's position decay; None: 1). Only valid rows are scored
    (invalid ones cost nothing).
    """
    if gold_miss not in GOLD_MISS_POLICIES:
        raise ValueError(f"gold_miss must be one of {GOLD_MISS_POLICIES}, got {gold_miss!r}")
    valid = valid.bool()
    idx = valid.nonzero().flatten()
    logits, h, prev, gold = logits[idx], h[idx], prev[idx].long(), gold[idx].long()
    w = torch.ones(idx.numel(), device=logits.device) if weight is None else weight[idx]
    n_valid = torch.tensor(int(idx.numel()), device=logits.device)
    cand, U = selector.candidates(logits)  # [n, K]
    S = selector.scores(prev, h, cand, U)  # [n, K]
    hit_mat = cand == gold[:, None]
    hit = hit_mat.any(-1)
    target = hit_mat.float().argmax(-1)
    path = cand.gather(-1, S.detach().argmax(-1, keepdim=True)).squeeze(-1)
    sel_correct = path == gold
    backbone_correct = cand[:, 0] == gold
    if gold_miss == "drop":
        ce = (w[hit].to(S.dtype) * F.cross_entropy(S[hit], target[hit], reduction="none")).sum()
        count = w[hit].sum().detach()
    else:
        K = S.shape[-1]
        s_gold = selector.scores(prev, h, gold[:, None], logits.gather(-1, gold[:, None]))  # [n, 1]
        last = torch.where(hit, S[:, K - 1], s_gold[:, 0])
        S_ins = torch.cat([S[:, : K - 1], last[:, None]], dim=-1)
        target = torch.where(hit, target, torch.full_like(target, K - 1))
        ce = (w.to(S_ins.dtype) * F.cross_entropy(S_ins, target, reduction="none")).sum()
        count = w.sum().detach()
    return SelectorOutput(
        loss_sum=ce,
        count=count,
        valid=n_valid,
        gold_in_candidates=hit.sum(),
        selector_correct=sel_correct.sum(),
        backbone_correct=backbone_correct.sum(),
        path=path,
    )


@torch.no_grad()
def walk(selector: PathSelector, logits: torch.Tensor, h: torch.Tensor, first: torch.Tensor, *,
         temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft a block by walking the selector from slot 0, greedily or by sampling.

    ``logits`` [N, Bk, V] and ``h`` [N, Bk, H] of N blocks of Bk slots; ``first`` [N] the token in
    slot 0 (the anchor, known). Slot k's choice is among its top-K candidates, scored by
    S(token_{k-1}, b): temperature 0 takes argmax S; temperature t > 0 draws from softmax(S / t) over
    the candidates (the selector's own distribution, the one its CE trains), and that distribution,
    scattered over the vocabulary (zero off the candidates), is slot k's q for rejection sampling.
    Returns tokens int64 [N, Bk] (column 0 = ``first``) and q float32 [N, Bk, V] (row 0 zero) or None.
    """
    N, Bk, V = logits.shape
    out = torch.empty(N, Bk, dtype=torch.long, device=logits.device)
    out[:, 0] = first.long()
    q = None if temperature == 0 else torch.zeros(N, Bk, V, dtype=torch.float32, device=logits.device)
    for k in range(1, Bk):
        cand, U = selector.candidates(logits[:, k])
        S = selector.scores(out[:, k - 1], h[:, k], cand, U)
        if q is None:
            pick = S.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(S.float() / temperature, -1)  # [N, K]
            pick = torch.multinomial(probs.cpu(), 1, generator=generator).to(cand.device)
            q[:, k].scatter_(-1, cand, probs)
        out[:, k] = cand.gather(-1, pick).squeeze(-1)
    return out, q


def greedy_walk(selector: PathSelector, logits: torch.Tensor, h: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Tokens [N, Bk] of the greedy :func:`walk` (column k = argmax_b S(token_{k-1}, b))."""
    return walk(selector, logits, h, first)[0]
