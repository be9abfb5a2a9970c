"""DFlash2 exports against vLLM 0.32's own DFlash2 code on a CPU: it takes every tensor, drafts what tapdraft drafts
on live blocks, and stops agreeing when the export is planted with an error; vLLM routes the export to its DFlash2
(candidate-head) path; with the project's plugin vLLM serves it on this CPU, round by round as ``tapdraft speculate``.

Stock vLLM drafts DFlash2 only in its V2 model runner (Triton, GPU only; ``benchmarks/gpu.sh`` serves it there) and
refuses it in V1, the runner it runs on a CPU. The plugin (``engines/vllm_plugin/tapdraft_vllm/candidate_heads.py``)
gives V1's DFlash proposer DFlash2's sampling step (vLLM's candidates and selector, the selector's greedy walk), so
:func:`test_vllm_serves_dflash2_with_tapdrafts_acceptance` serves the export end to end: vLLM's model (its
convolutions included), attention backend, context K/V and rejection sampler, float32. Below that, in the engine
venv (``tests/engines/in_venv/vllm_dflash2_modules.py``, whose docstring says which vLLM functions run and the two
DFlash pieces it restates, the attention kernel and the context K/V, plus the Triton walk): vLLM's
``DFlash2Qwen3ForCausalLM``, built and loaded from the export by vLLM's own registry and loader in float64, runs the
live blocks at the start of validation replies (the anchor at the prompt's end, the prompt's taps as context) as one
batch: its grouped convolutions, decoder layers, candidates, selector scores and walk give the draft logits and
tokens that tapdraft's DFlash2 model gives (float64, its selector's greedy ``walk``) and that ``propose``
(``tapdraft speculate``'s proposer, float32) drafts.

Tolerances: vLLM's float64 model keeps float32 values where its code puts them: RoPE tables computed in float32
(``RotaryEmbeddingBase._compute_cos_sin_cache``), RMSNorm and the fused residual add computed in float32
(vllm/ir/ops/layernorm.py), unary logits returned as float32 (``LogitsProcessor.get_top_k_tokens``). Measured on
this target (12 blocks, 200 steps) the largest |difference| is 1.1e-6 of the block's largest |logit| (1.2e-6 of
its largest |score|): just over 1e-6, vLLM's own float32 floor, so vLLM as it runs is held to :data:`REL` = 1e-5.
The same model with those three spots lifted to float64 (the script's ``lift_float32``) is held to
:data:`REL_LIFTED` = 1e-6: measured 1.2e-7, all of it RoPE, whose inverse frequencies tapdraft computes in float64
and rounds to float32 while vLLM computes them in float32 (one float32 ulp apart in 4 of the 16 at head dim 32);
with tapdraft's frequencies in vLLM's table too, the two agree to the last bit. Every planted error below moves
logits or scores by more than 10% of their scale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.engines.conftest import train_and_export
from tapdraft.engines.serving import EngineFailed, serve_vllm
from tests.engines.test_vllm_dflash import prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODULES = Path(__file__).resolve().parent / "in_venv" / "vllm_dflash2_modules.py"
BLOCKS = 12  # live blocks, one at the start of each of the first validation replies
REL = 1e-5
"""Largest |vLLM - tapdraft| allowed, relative to the block's largest |value| (logits, unary logits, scores)."""
REL_LIFTED = 1e-6
"""The same, for vLLM's model with its float32 spots lifted to float64 (``lifted_blocks``)."""


@pytest.fixture(scope="module")
def dflash2(bpe_target, tmp_path_factory):
    """(run, export) of a DFlash2 drafter (block 8: 7 drafts a round) trained long enough that its convolutions
    left identity and its selector re-ranks the backbone's top candidates (measured: in 30 of the 84 drafted
    slots of the test's blocks)."""
    return train_and_export(bpe_target.dataset, tmp_path_factory.mktemp("dflash2"), "dflash2_demo",
                            "drafter.num_layers=1", "max_steps=200")


def _reverse_taps(w: dict, cfg: dict) -> None:
    """The last layer's attention convolution with its taps reversed: base_kernel [side, tap, H] flipped on tap."""
    key = f"layers.{cfg['num_hidden_layers'] - 1}.attention_conv.base_kernel"
    w[key] = w[key].flip(1).contiguous()


def _transpose_projection(w: dict, cfg: dict) -> None:
    """The last layer's MLP convolution's tap projection with its (side, tap) output axes transposed: the rows
    [2 sides x taps x groups, H] read as [taps x 2 sides x groups, H], as a layout bug would write them."""
    key = f"layers.{cfg['num_hidden_layers'] - 1}.mlp_conv.kernel_projection.weight"
    t, taps = w[key], int(cfg["dflash_config"]["conv_kernel_size"])
    w[key] = t.view(2, taps, -1, t.shape[-1]).transpose(0, 1).reshape(t.shape).contiguous()


def _swap_codebooks(w: dict, cfg: dict) -> None:
    """The selector's predecessor (A) and successor (B) codebooks exchanged."""
    a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
    w[a], w[b] = w[b], w[a]


PLANTS = {"conv_taps_reversed": _reverse_taps, "conv_projection_transposed": _transpose_projection,
          "codebooks_swapped": _swap_codebooks}
"""Planted errors: name -> edit of the export's tensors (and its config, read only)."""


def planted(export: Path, out: Path, edit) -> Path:
    """A copy of ``export`` with ``edit`` applied to its tensors."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copy(export / "config.json", out / "config.json")
    weights = load_file(str(export / "model.safetensors"))
    edit(weights, json.loads((export / "config.json").read_text()))
    save_file(weights, str(out / "model.safetensors"))
    return out


def blocks(bpe_target, run, n: int = BLOCKS) -> tuple[list[dict], list[dict]]:
    """Live blocks at the start of ``n`` validation replies (anchor = the token at the prompt's end P, context = the
    prompt's P taps): vLLM's inputs (``aux`` [P, n_taps*H], the taps of the draft's ``target_layer_ids`` in its
    order, as vLLM concatenates its aux hidden states; ``anchor``) and tapdraft's DFlash2 there in float64 (draft
    logits [K, V] of slots 1..B-1, its selector's greedy walk, each slot's top candidates, their logits and the
    walk's scores S(previous token, candidate)), with ``live``: what ``propose`` drafts in float32."""
    import copy

    from tapdraft.shards.reader import open_dataset
    from tapdraft.speculate.run import prompt_length
    from tapdraft.train.drafters.dflash2.selector import walk
    from tapdraft.train.run import load_trained

    model = load_trained(run, bpe_target.dataset).model.eval()
    m64 = copy.deepcopy(model).double()
    sel = m64.candidate_selector
    jobs, want = [], []
    for i, s in enumerate(open_dataset(str(bpe_target.dataset)).stream("validation", seed=0, shuffle=False)):
        if i == n:
            break
        P = prompt_length(s["loss_mask"])
        ids, taps = s["input_ids"][: P + 1].long(), s["taps"][:P]
        with torch.no_grad():
            live, _ = model.propose(ids, taps.float())
            b, anchors = m64._live_block(ids, taps.double())
            h = m64.block_hidden(b["input_ids"], m64.context(b["taps"]), anchors)[0]  # [1, B, H]
            logits = m64.logits(h)  # [1, B, V]
            tokens, _ = walk(sel, logits, h, ids[P:P + 1])  # [1, B]: slot 0 = the anchor
            cand, unary, scores = [], [], []
            for k in range(1, h.shape[1]):
                c, u = sel.candidates(logits[:, k])
                cand.append(c[0])
                unary.append(u[0])
                scores.append(sel.scores(tokens[:, k - 1], h[:, k], c, u)[0])
            aux = b["taps"][0, :P].index_select(1, m64.tap_index).reshape(P, -1)
        jobs.append({"aux": aux.tolist(), "anchor": int(ids[P])})
        want.append({"live": live.tolist(), "tokens": tokens[0, 1:].tolist(), "logits": logits[0, 1:].tolist(),
                     "candidates": torch.stack(cand).tolist(), "unary": torch.stack(unary).tolist(),
                     "scores": torch.stack(scores).tolist()})
    return jobs, want


def run_modules(vllm_venv, job: dict, tmp_path: Path) -> dict:
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(vllm_venv / "bin" / "python"), str(MODULES), str(tmp_path / "job.json"), str(out)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def drafted(vllm_venv, bpe_target, dflash2, tmp_path_factory):
    """(vLLM's OUT per export name: ``clean`` and each of :data:`PLANTS`; tapdraft's blocks), from one vLLM run."""
    run, export = dflash2
    tmp = tmp_path_factory.mktemp("dflash2_vllm")
    exports = {"clean": str(export)}
    exports.update({name: str(planted(export, tmp / name, edit)) for name, edit in PLANTS.items()})
    jobs, want = blocks(bpe_target, run)
    job = {"target": str(bpe_target.target), "exports": exports, "blocks": jobs, "lifted": ["clean"]}
    return run_modules(vllm_venv, job, tmp), want


def deviation(got: list, want: list) -> float:
    """max |got - want| / max |want| over one block's values."""
    g, w = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return float((g - w).abs().max() / w.abs().max())


def compare(got: list[dict], want: list[dict]) -> dict:
    """How vLLM's blocks compare with tapdraft's: token and candidate agreement, worst deviations."""
    return {"tokens": [g["tokens"] for g in got] == [w["tokens"] for w in want],
            "live": [g["tokens"] for g in got] == [w["live"] for w in want],
            "candidates": [g["candidates"] for g in got] == [w["candidates"] for w in want],
            **{f: max(deviation(g[f], w[f]) for g, w in zip(got, want)) for f in ("logits", "unary", "scores")}}


def agrees(c: dict, rel: float = REL) -> bool:
    return c["tokens"] and c["live"] and c["candidates"] and max(c["logits"], c["unary"], c["scores"]) <= rel


def test_vllms_dflash2_modules_take_every_export_tensor(drafted):
    """vLLM's conv and selector modules take every tensor of theirs with its shape, and its whole model, loaded by
    its own ``load_weights`` with the target's embedding and lm_head, leaves no parameter it reads unset."""
    doc = drafted[0]["clean"]
    assert doc["unset"] == [] and doc["mismatched"] == [] and doc["export_keys_not_in_vllm"] == []
    assert any(k.endswith("attention_conv.base_kernel") for k in doc["loaded"])
    assert "candidate_selector.successor_codebook" in doc["loaded"]
    model = doc["model"]
    assert (model["architecture"], model["model_class"]) == ("DFlash2DraftModel", "DFlash2Qwen3ForCausalLM")
    assert model["model_unset"] == [] and model["model_dtypes"] == ["torch.float64"]


def test_vllms_dflash2_model_drafts_what_tapdraft_drafts(drafted):
    """On every live block vLLM's draft logits, candidates, unary logits and selector scores are tapdraft's within
    :data:`REL` (:data:`REL_LIFTED` with vLLM's float32 spots lifted), and its walk drafts tapdraft's tokens, those
    of ``tapdraft speculate``'s proposer too."""
    doc, want = drafted
    assert len(doc["clean"]["blocks"]) == len(want) == BLOCKS
    assert doc["clean"]["blocks"][0]["dtypes"]["logits"] == "torch.float64"
    c = compare(doc["clean"]["blocks"], want)
    assert agrees(c), c
    lifted = compare(doc["clean"]["lifted_blocks"], want)
    assert doc["clean"]["lifted_blocks"][0]["dtypes"]["unary"] == "torch.float64"
    assert agrees(lifted, REL_LIFTED), lifted
    slots = [(t, cand[0]) for w in want for t, cand in zip(w["tokens"], w["candidates"])]
    assert any(t != top for t, top in slots), "the selector should re-rank some slot, or its walk is not tested"


def test_planted_errors_make_vllm_disagree(drafted):
    """The same comparison fails on each planted copy of the export: a convolution with its taps reversed or its
    projection transposed moves the draft logits; swapped codebooks leave the backbone's logits and candidates
    (the selector reads them, it does not change them) and move the selector's scores and drafts."""
    doc, want = drafted
    found = {name: compare(doc[name]["blocks"], want) for name in PLANTS}
    assert not any(agrees(c) for c in found.values()), found
    for name in ("conv_taps_reversed", "conv_projection_transposed"):
        assert found[name]["logits"] > 0.1, (name, found[name])
    swapped = found["codebooks_swapped"]
    assert swapped["logits"] <= REL and swapped["candidates"], swapped
    assert swapped["scores"] > 0.1 and not swapped["tokens"], swapped


def test_vllm_routes_the_export_to_its_dflash2_path(vllm_venv, bpe_target, dflash2, tmp_path):
    """``architectures: [DFlash2DraftModel]`` is what vLLM keys DFlash2 on; under another name it would serve the
    export as DFlash with the selector ignored. On a CPU stock vLLM (no plugin) then refuses the V1 runner for it, by
    that name."""
    _, export = dflash2
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    k = cfg["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    assert k == cfg["block_size"] - 1
    (_, ids), = prompts(bpe_target)[:1]
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids}], "max_tokens": 4,
           "max_model_len": 256, "speculative": {"method": "dflash", "model": str(export),
                                                  "num_speculative_tokens": k}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path, plugins=False)
    assert "DFlash candidate-head drafts" in failed.value.log


def test_vllm_serves_dflash2_with_tapdrafts_acceptance(vllm_venv, bpe_target, dflash2, tmp_path):
    """With the plugin, vLLM's V1 runner serves the export on this CPU (``method: dflash``, K = block - 1): over the
    32 validation conversations the target's greedy output is unchanged and the drafts vLLM accepts equal
    ``tapdraft speculate``'s, round by round; also with up to 8 requests batched (each request's anchor and block
    found in a shared batch). The selector decides drafts: the same export with its codebooks swapped (the backbone's
    candidates unchanged, ``test_planted_errors_make_vllm_disagree``) is served with other rounds."""
    from tapdraft.engines.serving import check_served
    from tests.engines.test_vllm_dflash import MAX_TOKENS, speculate

    run, export = dflash2
    k = json.loads((export / "config.json").read_text())["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    convs = prompts(bpe_target)
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids} for _, ids in convs],
           "max_tokens": MAX_TOKENS, "max_model_len": 256}
    draft = {"method": "dflash", "model": str(export), "num_speculative_tokens": k}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    served = serve_vllm(vllm_venv, {**job, "speculative": draft}, tmp_path)
    assert "candidate_heads:v1" in served["plugins"]
    ours = speculate(bpe_target, run, bpe_target.val_manifest, len(convs), MAX_TOKENS)
    rounds, accepted = check_served(alone, served, ours, [i for i, _ in convs])
    assert 0 < accepted < k * rounds, "both the accept and the reject path should be exercised"

    batched = serve_vllm(vllm_venv, {**job, "speculative": draft, "max_num_seqs": 8}, tmp_path)
    check_served(alone, batched, ours, [i for i, _ in convs])

    swapped = planted(export, tmp_path / "codebooks_swapped", _swap_codebooks)
    other = serve_vllm(vllm_venv, {**job, "speculative": {**draft, "model": str(swapped)}}, tmp_path)
    assert [o["token_ids"] for o in other["outputs"]] == [o["token_ids"] for o in alone["outputs"]]
    agreed = {c["sample_id"]: c["agreed"] for c in ours["conversations"]}
    assert [o["spec"]["per_step_accepted"] for o in other["outputs"]] != [agreed[i] for i, _ in convs]
