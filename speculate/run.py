"""``tapdraft speculate``: decode held-out conversations with the live target and a trained drafter.

For each conversation the prompt is everything before its last assistant reply (the positions
before the last supervised run, which is exactly what the chat template's generation prompt
gives), audio expanded by the target as in capture. The target then decodes with the drafter
proposing, and the report gives:

    tau                tokens emitted per verifying target forward (accepted drafts + the bonus token;
                       nothing past eos counts), over all rounds
    alpha@k            P(draft k accepted | drafts 1..k-1 accepted), over rounds that judged draft k
    matches_greedy     greedy only: the output equals the target's own greedy decoding (it must)
    offline_tau        the offline estimates on the SAME conversations, found by sample id in the dataset:
                       uniform anchors, and replayed round by round (the one live decoding should match);
                       when none of them is in the dataset, the run's eval.json figures, labelled with
                       the split and sample count they cover

Live tau sits below the uniform-anchor offline tau: rounds start right after a rejection, at the
hard tokens, and a round near the end of a reply can accept only what is left of it. The offline
replay (``tau_replayed``) walks the same rounds on the dataset and matches live decoding when the
replies are the target's own (demo, 120 replies: live 2.827, replay 2.827, uniform anchors 4.366).
The report leads with live vs replayed and says whether they agree (:data:`AGREE_REL`).

Whether the drafter pays off: a round (draft + verify) costs R plain decode steps and emits tau tokens, so the
expected speedup is tau / R and break-even lies at tau = R. ``speculate`` measures R on its own engine (tapdraft's
in-process transformers decoding, batch 1, NOT vLLM's): the mean round against the mean plain decode step of
the same target on the same prompts (every step of the greedy check, else ``cost_steps`` plain steps per
conversation), and reports ``cost`` and ``breakeven``.

``--json PATH`` writes the report below (``format`` :data:`REPORT_FORMAT`, ``version`` :data:`REPORT_VERSION`),
the dict :func:`run_speculate` returns; docs/speedup.md documents every field. Per conversation (in
``conversations``): ``sample_id``, ``tokens`` (the emitted ids), ``rounds`` and, one entry per round, ``drafted``,
``accepted`` (drafts emitted), ``agreed`` (drafts the verifier accepted before a cut at eos or the token limit, as
vLLM counts), ``emitted`` (accepted + the target's token, except in a cut round), ``cut`` and ``round_seconds``;
``totals`` sums them (a conversation's first token comes from the prefill, outside any round:
totals.emitted = tokens - samples), and ``tau`` = totals.emitted / totals.rounds. Unreached ``alpha`` entries
are null.

The live target must be the one the dataset was captured from, tokenizing with the same chat
template and kwargs: the target is loaded with the template settings given (its own template, or
``chat_template``; ``template_kwargs``), which are compared with the dataset's first (one line naming
what differs), then its bundle fingerprint is recomputed from the loaded model and compared with the
drafter's.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

import fsspec
import torch

from tapdraft.capture.inputs import BadInput, read_inputs
from tapdraft.capture.provenance import target_fingerprint
from tapdraft.capture.stages import resolve_device
from tapdraft.capture.targets.base import Target
from tapdraft.capture.targets.load import load_target
from tapdraft.common.atomic import write_json_atomic
from tapdraft.common.progress import Progress
from tapdraft.common.template import check_template, read_template_file, template_kwargs
from tapdraft.speculate.decode import (DecodeResult, TargetSession, acceptance_by_position, speculative_generate,
                              target_greedy)
from tapdraft.train.acceptance import UNREACHED, alpha_text, breakeven, breakeven_text
from tapdraft.train.evaluate import acceptance_of
from tapdraft.train.run import Trained, load_trained


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
    drafts: int | None = None
    """Drafts a round: None = the number the draft was trained for; fewer as an engine serving its export at
    ``num_speculative_tokens`` = drafts drafts them (``Drafter.draft_count``), the offline replay too."""
    temperature: float = 0.0
    """0 decodes greedily (exact); > 0 samples with rejection sampling."""
    seed: int = 0
    """Seed of the sampling generator."""
    check_greedy: bool = True
    """Greedy only: also decode with the target alone and check the outputs are identical."""
    device: str = "auto"
    """Where the target and the drafter run: 'auto' = cuda when available, else cpu (as capture and train)."""
    llm_config: str | None = None
    """NeMo SALM checkpoints that only name their LLM: a local directory with its config.json and tokenizer."""
    chat_template: str | None = None
    """Jinja file replacing the target's chat template (as served); None: the target's own."""
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    """Chat-template kwargs as served (e.g. enable_thinking=False), as (key, value) pairs or a dict."""
    cost_steps: int = 8
    """Plain decode steps timed per conversation for the round cost when the greedy check (which times all of
    its steps) does not run; 0 measures nothing."""
    json_path: str | None = None
    """Where the report goes as JSON (written atomically); None: nowhere."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_kwargs", tuple(template_kwargs(self.template_kwargs).items()))
        if self.max_samples < 1 or self.max_new_tokens < 1:
            raise ValueError("max_samples and max_new_tokens must be >= 1")
        if self.cost_steps < 0:
            raise ValueError(f"cost_steps must be >= 0, got {self.cost_steps}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.drafts is not None and self.drafts < 1:
            raise ValueError(f"drafts must be >= 1 (or left out: the trained number), got {self.drafts}")


def prompt_length(loss_mask: torch.Tensor) -> int:
    """Start of the last supervised run: everything before it is the generation prompt."""
    idx = torch.nonzero(loss_mask, as_tuple=False).flatten()
    if idx.numel() == 0:
        raise ValueError("the conversation has no assistant reply to take a prompt from")
    start = int(idx[-1])
    while start > 0 and bool(loss_mask[start - 1]):
        start -= 1
    return start


def last_reply(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample with its earlier replies as context only: supervised on its last reply, the one ``speculate``
    decodes (an MT-bench second turn is decoded after the target's first reply, which it does not decode)."""
    mask = sample["loss_mask"].clone()
    mask[:prompt_length(mask)] = False
    return {**sample, "loss_mask": mask}


def run_speculate(cfg: SpeculateConfig, *, progress: bool = True) -> dict[str, Any]:
    """Decode up to ``cfg.max_samples`` conversations with the target and the drafter; returns the report."""
    cfg = replace(cfg, device=str(resolve_device(cfg.device)))
    target, loaded = load_pair(cfg)
    loaded.model.draft_count(cfg.drafts)  # refused here, before any decoding
    decoder = _Decoder(cfg, target, loaded)
    items = read_inputs(cfg.conversations, placeholder=target.input_placeholder)
    usable = sum(1 for c in read_inputs(cfg.conversations, placeholder=target.input_placeholder)
                 if not isinstance(c, BadInput))
    with Progress("speculate", min(cfg.max_samples, usable), enabled=progress) as bar:
        for conv in items:
            if decoder.n >= cfg.max_samples:
                break
            if isinstance(conv, BadInput):
                continue
            decoder.decode(conv)
            bar.update(decoder.n)
    if decoder.n == 0:
        raise ValueError(f"no usable conversation in {cfg.conversations}")
    report = decoder.report()
    report = {**report, **offline_estimates(loaded, decoder.sample_ids, cfg, report["conversations"])}
    if cfg.json_path is not None:
        write_json_atomic(fsspec.filesystem("file"), str(Path(cfg.json_path).absolute()), report, indent=None)
    return report


def load_pair(cfg: SpeculateConfig) -> tuple[Target, Trained]:
    """The live target and the trained drafter; refused when the target or its template settings are not the
    dataset's."""
    template = None if cfg.chat_template is None else read_template_file(cfg.chat_template)
    target = load_target(cfg.target, device=cfg.device, llm_config=cfg.llm_config, template=template,
                         template_kwargs=dict(cfg.template_kwargs))
    loaded = load_trained(cfg.draft, cfg.data, device=cfg.device, any_split=True)  # samples are found by id, any split
    check_template(loaded.src.bundle.template_settings, template=target.template.text, kwargs=target.template.kwargs,
                   where=str(cfg.data), given_by="speculate's target (its own template or --chat-template, and "
                   "--template-kwarg)")
    live_fp = target_fingerprint(target)
    if live_fp != loaded.src.fingerprint:
        raise ValueError(
            f"the target in {cfg.target} (fingerprint {live_fp[:12]}) is not the one {cfg.data} was captured "
            f"from ({loaded.src.fingerprint[:12]}); speculate with the dataset's own target"
        )
    return target, loaded


class _Decoder:
    """Decodes conversations one by one (speculative, plus the target alone when checking greedy) and tallies."""

    def __init__(self, cfg: SpeculateConfig, target: Target, loaded: Trained) -> None:
        self.cfg, self.target = cfg, target
        self.model, self.layout = loaded.model, loaded.src.layout
        # the session taps the dataset's layers, plus the last one when the dataset stored final_hidden apart
        self.tap_ids = list(self.layout.tap_ids)
        self.final_col = None
        if self.layout.has_final_hidden:
            last = self.layout.num_layers - 1
            if last not in self.tap_ids:
                self.tap_ids.append(last)
            self.final_col = self.tap_ids.index(last)
        self.head = target.head  # the live target's; its spec is the bundle's (the fingerprints agree)
        eos = target.bundle_config().get("eos_token_id")
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.results: list[DecodeResult] = []
        self.sample_ids: list[str] = []
        self.K = self.n = self.matches = self.tokens = 0
        self.spec_s = self.plain_s = 0.0
        self.plain_steps: list[float] = []

    @property
    def greedy_check(self) -> bool:
        return self.cfg.temperature == 0 and self.cfg.check_greedy

    def proposer(self, is_audio_P: torch.Tensor, embeds_PH: torch.Tensor):
        """The drafter's ``propose`` fed like the dataset fed it in training: the dataset's taps, the prompt's
        audio rows (and their merged embeddings when the dataset stored ``audio_embeds``) and ``final_hidden``."""
        n = len(self.layout.tap_ids)
        prompt = {"is_audio": is_audio_P.bool()}
        if self.layout.has_audio_embeds:
            prompt["audio_embeds"] = embeds_PH * is_audio_P[:, None].to(embeds_PH.dtype)

        def propose(seq: torch.Tensor, taps: torch.Tensor, *, temperature: float, generator: Any):
            extras = dict(prompt)
            if self.final_col is not None:
                extras["final_hidden"] = taps[:, self.final_col]
            return self.model.propose(seq, taps[:, :n], temperature=temperature, generator=generator, extras=extras,
                                      drafts=self.cfg.drafts)

        return propose

    def decode(self, conv: Any) -> None:
        cfg, target = self.cfg, self.target
        exp = target.embed([target.prepare(conv, self.n)])[0]
        P = prompt_length(exp.loss_mask)
        emb, ids = exp.inputs_embeds[:P].float(), exp.input_ids[:P]
        t0 = time.perf_counter()
        out = speculative_generate(
            TargetSession(target.lm, self.tap_ids, head=self.head), emb, ids,
            self.proposer(exp.is_audio[:P], emb),
            max_new_tokens=cfg.max_new_tokens, eos_token_id=self.eos, temperature=cfg.temperature, generator=self.gen,
        )
        self.spec_s += time.perf_counter() - t0
        self.results.append(out)
        self.sample_ids.append(conv.sample_id)
        self.K = max(self.K, out.proposed)
        self.tokens += len(out.tokens)
        if self.greedy_check:
            t0 = time.perf_counter()
            ref = target_greedy(target.lm, emb, max_new_tokens=cfg.max_new_tokens, eos_token_id=self.eos,
                                head=self.head, step_seconds=self.plain_steps)
            self.plain_s += time.perf_counter() - t0
            self.matches += ref == out.tokens
        elif cfg.cost_steps:
            target_greedy(target.lm, emb, max_new_tokens=min(cfg.cost_steps + 1, cfg.max_new_tokens),
                          eos_token_id=self.eos, head=self.head, step_seconds=self.plain_steps)
        self.n += 1

    def report(self) -> dict[str, Any]:
        rounds = sum(r.target_forwards for r in self.results)
        emitted = sum(sum(r.emitted) for r in self.results)
        tau = emitted / rounds if rounds else float("nan")
        cost = self.cost()
        result: dict[str, Any] = {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "config": {**asdict(self.cfg), "template_kwargs": dict(self.cfg.template_kwargs)},
            "samples": self.n,
            "tokens": self.tokens,
            "rounds": rounds,
            "drafts_per_round": self.K,
            "tau": tau,
            "alpha": [None if a != a else a for a in acceptance_by_position(self.results, self.K)],
            "seconds_speculative": round(self.spec_s, 3),
            "totals": {"rounds": rounds, "drafted": sum(sum(r.drafted) for r in self.results),
                       "accepted": sum(sum(r.accepted) for r in self.results),
                       "agreed": sum(sum(r.agreed) for r in self.results), "emitted": emitted, "tokens": self.tokens},
            "cost": cost,
            "breakeven": (breakeven(tau, cost["round_cost"], "measured")
                          if cost["round_cost"] is not None and rounds else None),
            # per conversation, what an engine's per-request counters hold, round by round
            "conversations": [conversation(i, r) for i, r in zip(self.sample_ids, self.results)],
        }
        if self.greedy_check:
            result["matches_greedy"] = f"{self.matches}/{self.n}"
            result["seconds_target_alone"] = round(self.plain_s, 3)
        return result

    def cost(self) -> dict[str, Any]:
        """The measured cost of a round relative to a plain decode step: mean over mean, so tau / R is the decode
        phase's speedup over the timed steps (on the demo, 3 repeats on shared cores, the ratio of medians moved
        from 1.49 to 2.22 where the means held 2.03-2.17); the medians beside. ``round_cost`` None when either was not
        timed."""
        rounds, plain = [t for r in self.results for t in r.round_seconds], self.plain_steps
        r_s = sum(rounds) / len(rounds) if rounds else None
        p_s = sum(plain) / len(plain) if plain else None
        return {"engine": f"tapdraft's in-process decoding (transformers, batch 1) on {self.cfg.device}, not vLLM",
                "round_seconds": r_s, "plain_step_seconds": p_s, "rounds_timed": len(rounds),
                "plain_steps_timed": len(plain), "round_seconds_median": median(rounds) if rounds else None,
                "plain_step_seconds_median": median(plain) if plain else None,
                "round_cost": r_s / p_s if r_s is not None and p_s else None}


REPORT_FORMAT = "tapdraft-speculate-report"
REPORT_VERSION = 1
"""The version of :func:`run_speculate`'s report (``--json``); a change to a field's meaning raises it."""


def conversation(sample_id: str, r: DecodeResult) -> dict[str, Any]:
    """One conversation of the report: its emitted ids and its rounds, one entry per round in each list."""
    return {"sample_id": sample_id, "tokens": r.tokens, "rounds": r.target_forwards, "drafted": r.drafted,
            "accepted": r.accepted, "agreed": r.agreed, "emitted": r.emitted, "cut": r.cut,
            "round_seconds": [round(t, 6) for t in r.round_seconds]}


def dataset_samples(loaded: Trained, sample_ids: list[str]) -> list[dict[str, Any]]:
    """The dataset's samples with these ids (evaluation split first, then the others), in ``sample_ids`` order."""
    ds, want, found = loaded.src.data, set(sample_ids), {}
    for split in [loaded.split] + [s for s in ds.splits if s != loaded.split]:
        for s in ds.stream(split, seed=0, shuffle=False):
            if s["sample_id"] in want and s["sample_id"] not in found:
                found[s["sample_id"]] = s
        if len(found) == len(want):
            break
    return [found[i] for i in sample_ids if i in found]


def past_capture(samples: list[dict[str, Any]], decoded: list[dict[str, Any]]) -> dict[str, int]:
    """How many decoded conversations ran past the reply their dataset sample holds, and by how many tokens in
    all: the dataset has no target states there, so the replay cannot see those rounds (a drafter trained on
    replies cut at a length also never saw them)."""
    reply = {s["sample_id"]: int(s["loss_mask"].shape[0]) - prompt_length(s["loss_mask"]) for s in samples}
    over = [len(d["tokens"]) - reply[d["sample_id"]] for d in decoded if d["sample_id"] in reply]
    return {"conversations": sum(x > 0 for x in over), "tokens": sum(max(x, 0) for x in over)}


def offline_estimates(loaded: Trained, sample_ids: list[str], cfg: SpeculateConfig,
                      decoded: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Offline tau (uniform anchors, and replayed) over the decoded conversations' own dataset samples, their last
    replies only (what was decoded), and how far live decoding ran past what they cover; without any of them in the dataset, the run's first eval.json,
    labelled with what it covers."""
    samples = dataset_samples(loaded, sample_ids)
    res = acceptance_of(loaded, [last_reply(x) for x in samples], device=cfg.device, drafts=cfg.drafts)
    if res is not None:
        return {"offline_tau": res["tau"], "offline_tau_replayed": res["tau_replayed"],
                "offline_over": f"the same {res['samples']} conversations", "offline_same": True,
                "past_capture": past_capture(samples, decoded or [])}
    offline = sorted(Path(cfg.draft).glob("eval-*/eval.json"))
    if not offline or loaded.model.draft_count(cfg.drafts) != loaded.model.trained_drafts:
        return {}  # eval.json is of the trained number of drafts
    doc = json.loads(offline[0].read_text())
    return {"offline_tau": doc.get("tau"), "offline_tau_replayed": doc.get("tau_replayed"),
            "offline_over": f"{doc.get('samples')} {doc.get('split')} samples of eval.json (the decoded conversations "
                            "are not in the dataset)"}


AGREE_REL = 0.02
"""Live and replayed tau agree when they differ by at most 2% of the live figure (the tolerance the demo and
the draft-vocabulary tests hold them to on the same conversations)."""


def agreement(r: dict[str, Any]) -> str | None:
    """Whether live tau and the offline replay agree, in words (None: nothing to compare)."""
    replayed = r.get("offline_tau_replayed")
    if replayed is None or r["tau"] != r["tau"]:
        return None
    gap = abs(r["tau"] - replayed) / r["tau"]
    if r["config"]["temperature"] > 0:
        return "not comparable: the replay is greedy, this run sampled"
    if gap <= AGREE_REL:
        return f"agree (within {100 * gap:.1f}%)"
    why = ("the dataset's replies are not what the target says live (not regenerated by the target, another "
           "template), or decoding stopped at --max-new-tokens before the replies end")
    if not r.get("offline_same"):
        why = "the replay covers other conversations than were decoded"
    return f"DIFFER by {100 * gap:.1f}% (> {100 * AGREE_REL:g}%): {why}"


def cost_line(r: dict[str, Any]) -> str:
    """The break-even line: measured on this engine, or why it could not be."""
    cost, b = r.get("cost") or {}, r.get("breakeven")
    if not b:
        return ("break-even: not measured (no round, or no plain decode step timed: --cost-steps 0 without the "
                "greedy check); `tapdraft eval --round-cost R` says it for a given engine")
    where = (f"{cost['engine']}: a round {1e3 * cost['round_seconds']:.2f} ms over "
             f"{1e3 * cost['plain_step_seconds']:.2f} ms a plain step")
    return breakeven_text(b, where)


def format_result(r: dict[str, Any]) -> str:
    over = r.get("offline_over", "the dataset")
    lines = [
        f"live speculative decoding: {r['samples']} conversations, {r['tokens']} tokens, {r['rounds']} target "
        f"verifications, {r['drafts_per_round']} drafts per round",
        f"tau (tokens per target forward) = {r['tau']:.3f} live",
    ]
    if r.get("offline_tau_replayed") is not None:
        lines.append(f"tau = {r['offline_tau_replayed']:.3f} replayed offline over {over} (the serving prediction "
                     f"`tapdraft eval` reports): {agreement(r)}")
    lines.append("alpha by draft position (live): " + alpha_text(r["alpha"])
                 + (f"  ({UNREACHED}: never reached)" if any(a is None or a != a for a in r["alpha"]) else ""))
    lines.append(cost_line(r))
    if "matches_greedy" in r:
        lines.append(f"output identical to the target's greedy decoding: {r['matches_greedy']}")
    if r.get("offline_tau") is not None:
        lines.append(f"teacher-forced tau at every anchor over {over} = {r['offline_tau']:.3f} (a training metric, "
                     "not a serving prediction)")
    past = r.get("past_capture") or {}
    if past.get("conversations"):
        lines.append(f"note: {past['conversations']} of {r['samples']} conversations decoded past the reply their "
                     f"dataset sample holds ({past['tokens']} tokens in all): the replay cannot cover those rounds "
                     "and the drafter never trained there; lower --max-new-tokens to the captured length, or "
                     "regenerate and capture with a larger --max-new-tokens")
    if r["config"].get("json_path"):
        lines.append(f"report, round by round: {r['config']['json_path']}")
    return "\n".join(lines)
