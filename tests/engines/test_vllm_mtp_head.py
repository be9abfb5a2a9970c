"""vLLM serves tapdraft's bolt-on MTP head (family ``mtp``, head-only) beside a dense target that has no MTP
module of its own, through the project's plugin: greedy output is the target's own, and vLLM's per-round accepted
drafts equal ``tapdraft speculate``'s, round by round.

The head is trained briefly on the BPE target's dataset (a Qwen3 causal LM) as the CPU recipe (``mtp_small``) trains
it, plus a second depth: CE, a draft vocabulary (256 of the target's 1,024; the export carries those lm_head rows and
the plugin scores them only, mapping ids through ``d2t``), two depths of one layer trained with ``chain: rerun``
(vLLM's proposer reruns the layer on its own output for the second draft); exported with ``--layout tapdraft-vllm``
and served with two drafts a round. The speech tests train one depth with the LK loss over the whole vocabulary
(``mtp_lk_demo``). vLLM runs it as
``{"method": "mtp", "model": EXPORT, "num_speculative_tokens": D}``: the plugin's ``TapdraftMTPForCausalLM``
(``engines/vllm_plugin/tapdraft_vllm/mtp.py``) with the target's embedding and lm_head shared by vLLM's proposer.
``per_step_accepted`` is 0, 1 or 2 a round: the check needs both acceptance and rejection to occur.
"""

from __future__ import annotations

import json

import pytest

from tests.engines.conftest import train_and_export
from tapdraft.engines.serving import serve_vllm
from tests.engines.test_vllm_dflash import MAX_TOKENS, prompts, serve_and_check

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def bpe_mtp(bpe_target, tmp_path_factory):
    """(run, export in the ``tapdraft-vllm`` layout) of an MTP head with a draft vocabulary, trained briefly on the BPE
    target's dataset."""
    from typer.testing import CliRunner

    from tapdraft.cli import app

    root = tmp_path_factory.mktemp("mtp_head")
    run, _ = train_and_export(bpe_target.dataset, root, "mtp_demo", "max_steps=200", "drafter.draft_vocab=256",
                              "drafter.num_depths=2", "drafter.use_repeated_layer=true", "drafter.chain=rerun")
    export = root / "export-vllm"
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(export), "--layout", "tapdraft-vllm",
                                   "--data", str(bpe_target.dataset), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return run, export


def test_vllm_serves_a_bolt_on_mtp_head_with_tapdrafts_acceptance(vllm_venv, bpe_target, bpe_mtp, tmp_path):
    _, export = bpe_mtp
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["TapdraftMTPForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["draft_vocab_size"] == 256 < cfg["vocab_size"]
    serve = cfg["tapdraft"]["serve_with"]["vllm"]
    assert (serve["method"], serve["num_speculative_tokens"]) == ("mtp", 2)
    rounds, accepted = serve_and_check(vllm_venv, bpe_target, bpe_mtp, "mtp", 2, tmp_path)
    assert 0 < accepted < 2 * rounds, "both the accept and the reject path should be exercised"


def test_vllm_serves_an_mtp_head_at_fewer_drafts_as_speculate_drafts_them(vllm_venv, bpe_target, bpe_mtp, tmp_path):
    """A head trained for two drafts served at one: vLLM's first draft of the chain is speculate's, round for round."""
    rounds, accepted = serve_and_check(vllm_venv, bpe_target, bpe_mtp, "mtp", 1, tmp_path)
    assert 0 < accepted < rounds


def test_stock_vllm_has_no_class_for_a_bolt_on_mtp_head(vllm_venv, bpe_target, bpe_mtp, tmp_path):
    """Without the plugin vLLM 0.32 refuses the export before decoding: its MTP path knows only model types named
    by a target's own MTP module."""
    from tapdraft.engines.serving import EngineFailed

    _, export = bpe_mtp
    (_, ids), *_ = prompts(bpe_target)
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids}], "max_tokens": MAX_TOKENS,
           "max_model_len": 256, "speculative": {"method": "mtp", "model": str(export), "num_speculative_tokens": 1}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path, plugins=False)
    assert "Unsupported speculative method" in failed.value.log or "TapdraftMTPForCausalLM" in failed.value.log


@pytest.mark.parametrize("audio_embeds", [False, True], ids=["placeholder_embedding", "audio_embeds"])
def test_vllm_serves_an_mtp_head_beside_a_speech_target(vllm_venv, speech_case, audio_embeds, tmp_path):
    """Beside Qwen2-Audio (audio through vLLM's processor): a head trained without the frame embeddings reads the
    placeholder id's embedding at audio rows (vLLM's text-only draft inputs); one trained on them
    (``capture --audio-embeds``) declares multimodal embeddings and reads the target's merged ones. Both: greedy
    identical and acceptance equal to ``tapdraft speculate`` round by round."""
    from typer.testing import CliRunner

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.cli import app
    from tapdraft.speculate.run import SpeculateConfig, run_speculate
    from tapdraft.engines.serving import check_served
    from tests.engines.test_vllm_dflash import speech_requests

    dataset = speech_case["dataset"]
    if audio_embeds:
        dataset = tmp_path / "dataset-audio-embeds"
        capture(CaptureConfig(target=str(speech_case["target"]), out=str(dataset),
                              data=(("train", str(speech_case["conversations"])),), audio_embeds=True,
                              progress=False), target=None)
    run, _ = train_and_export(dataset, tmp_path / "mtp", "mtp_lk_demo", "max_steps=150")
    export = tmp_path / "export-vllm"
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(export), "--layout", "tapdraft-vllm",
                                   "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads((export / "config.json").read_text())["tapdraft"]["audio_embeds"] is audio_embeds
    requests, ids = speech_requests(speech_case)
    n_new = 16
    job = {"target": str(speech_case["target"]), "requests": requests, "max_tokens": n_new, "max_model_len": 512}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": "mtp", "model": str(export),
                                                          "num_speculative_tokens": 1}}, tmp_path)
    assert [o["prompt_token_ids"] for o in alone["outputs"]] == ids
    ours = run_speculate(SpeculateConfig(target=str(speech_case["target"]), draft=str(run), data=str(dataset),
                                         conversations=str(speech_case["conversations"]), max_samples=len(ids),
                                         max_new_tokens=n_new), progress=False)
    rounds, accepted = check_served(alone, spec, ours)
    assert accepted > 0
