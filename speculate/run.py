"""``tapdraft speculate``: decode held-out conversations with the live target and a trained drafter.

For each conversation the prompt is everything before its last assistant reply (the positions
before the last supervised run, which is exactly what the chat template's generation prompt
gives), audio expanded by the target as in capture. The target then decodes with the drafter
proposing, and the report gives:

    tau                tokens emitted per verifying target forward (accepted drafts + the bonus token;
                       nothing past eos counts), over all rounds
    alpha@k            P(draft k accepted | drafts 1..k-1 accepted), over rounds that judged draft k
    matches_greedy     greedy only: the output equals the target's own greedy decoding (it must)
    offline_tau        the run's offline estimates (eval.json in the run directory), when present:
                       uniform anchors, and replayed round by round (the one live decoding should match)

Live tau sits below the uniform-anchor offline tau: rounds start right after a rejection, at the
hard tokens, and a round near the end of a reply can accept only what is left of it. The offline
replay (``tau_replayed``) walks the same rounds on the dataset and matches live decoding when the
replies are the target's own (demo, 120 replies: live 2.827, replay 2.827, uniform anchors 4.366).

The live target must be the one the dataset was captured from: its bundle fingerprint is
recomputed from the loaded model and compared with the drafter's.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from capture.inputs import BadInput, read_inputs
from capture.load import load_target
from capture.targets import Target
from shards.bundle import bundle_fingerprint
from shards.head import head_spec
from speculate.decode import TargetSession, acceptance_by_position, speculative_generate, target_greedy
from train.run import load_trained


@dataclass(frozen=True)
class SpeculateConfig:
    """One live speculative-decoding evaluation."""

    target: str
    """The target model directory (a SALM directory, an HF speech LLM or an HF causal LM)."""
    draft: str
    """A training run directory (its latest checkpoint is used)."""
    data: str
    """The dataset the draft was trained on (gives the target bundle and tap layout)."""
    conversations: str
    """JSONL conversations (or an HF dataset spec) to take prompts from."""
    max_samples: int = 32
    """Conversations to decode."""
    max_new_tokens: int = 64
    """Tokens to generate per conversation at most."""
    temperature: float = 0.0
    """0 decodes greedily (exact); > 0 samples with rejection sampling."""
    seed: int = 0
    """Seed of the sampling generator."""
    check_greedy: bool = True
    """Greedy only: also decode with the target alone and check the outputs are identical."""
    device: str = "cpu"
    """Where the target and the drafter run."""

    def __post_init__(self) -> None:
        if self.max_samples < 1 or self.max_new_tokens < 1:
            raise ValueError("max_samples and max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def target_fingerprint(target: Target) -> str:
    """The bundle fingerprint of a live target, computed as capture writes it."""
    return bundle_fingerprint(**target.bundle_parts())


def prompt_length(loss_mask: torch.Tensor) -> int:
    """Start of the last supervised run: everything before it is the generation prompt."""
    idx = torch.nonzero(loss_mask, as_tuple=False).flatten()
    if idx.numel() == 0:
        raise ValueError("the conversation has no assistant reply to take a prompt from")
    start = int(idx[-1])
    while start > 0 and bool(loss_mask[start - 1]):
        start -= 1
    return start


def run_speculate(cfg: SpeculateConfig, *, progress: bool = True) -> dict[str, Any]:
    target = load_target(cfg.target, device=cfg.device)
    loaded = load_trained(cfg.draft, cfg.data, device=cfg.device)
    model, src, run_dir = loaded.model, loaded.src, cfg.draft
    live_fp = target_fingerprint(target)
    if live_fp != src.fingerprint:
        raise ValueError(
            f"the target in {cfg.target} (fingerprint {live_fp[:12]}) is not the one {cfg.data} was captured "
            f"from ({src.fingerprint[:12]}); speculate with the dataset's own target"
        )
    proposer = model.propose
    head = head_spec(src.bundle)
    eos = target.bundle_config().get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    gen = torch.Generator().manual_seed(cfg.seed)
    results = []
    K = 0
    n = matches = tokens = 0
    spec_s = plain_s = 0.0
    items = read_inputs(cfg.conversations, placeholder=target.placeholder or "")
    bar = _bar(progress, cfg.max_samples)
    for conv in items:
        if n >= cfg.max_samples:
            break
        if isinstance(conv, BadInput):
            continue
        exp = target.embed([target.prepare(conv, n)])[0]
        P = prompt_length(exp.loss_mask)
        emb, ids = exp.inputs_embeds[:P].float(), exp.input_ids[:P]
        t0 = time.perf_counter()
        out = speculative_generate(
            TargetSession(target.lm, src.layout.tap_ids, head=head), emb, ids, proposer,
            max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, temperature=cfg.temperature, generator=gen,
        )
        spec_s += time.perf_counter() - t0
        results.append(out)
        K = max(K, out.proposed)
        tokens += len(out.tokens)
        if cfg.temperature == 0 and cfg.check_greedy:
            t0 = time.perf_counter()
            ref = target_greedy(target.lm, emb, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos,
                                head=head)
            plain_s += time.perf_counter() - t0
            matches += ref == out.tokens
        n += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if n == 0:
        raise ValueError(f"no usable conversation in {cfg.conversations}")
    rounds = sum(r.target_forwards for r in results)
    emitted = sum(sum(r.emitted) for r in results)
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "samples": n,
        "tokens": tokens,
        "rounds": rounds,
        "drafts_per_round": K,
        "tau": emitted / rounds if rounds else float("nan"),
        "alpha": acceptance_by_position(results, K),
        "seconds_speculative": round(spec_s, 3),
    }
    if cfg.temperature == 0 and cfg.check_greedy:
        result["matches_greedy"] = f"{matches}/{n}"
        result["seconds_target_alone"] = round(plain_s, 3)
    offline = sorted(Path(run_dir).glob("eval-*/eval.json"))
    if offline:
        doc = json.loads(offline[0].read_text())
        result["offline_tau"] = doc.get("tau")
        result["offline_tau_replayed"] = doc.get("tau_replayed")
    return result


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="speculate", unit="conv")


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"live speculative decoding: {r['samples']} conversations, {r['tokens']} tokens, {r['rounds']} target "
        f"verifications, {r['drafts_per_round']} drafts per round",
        f"tau (tokens per target forward) = {r['tau']:.3f}",
        "alpha by draft position: " + " ".join(f"{x:.3f}" for x in r["alpha"]),
    ]
    if "matches_greedy" in r:
        lines.append(f"output identical to the target's greedy decoding: {r['matches_greedy']}")
    if r.get("offline_tau") is not None:
        lines.append(f"offline estimate from the dataset: tau = {r['offline_tau']:.3f} (uniform anchors)")
    if r.get("offline_tau_replayed") is not None:
        lines.append(f"offline replay of the same decoding rounds: tau = {r['offline_tau_replayed']:.3f}")
    return "\n".join(lines)
