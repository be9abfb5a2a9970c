"""Fixtures of the serving-engine tests: the engine's venv, and a small trained target with a trained drafter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tapdraft.engines.serving import engine_venv


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return engine_venv("vllm")



def engine_bpe_size():
    """The quick BPE target (head dim 32, which vLLM's CPU attention serves) with enough conversations for
    the serving checks: 48 to train the drafter on, 32 held out."""
    from tapdraft.demo.bpe import QUICK

    return replace(QUICK, train_samples=64, val_samples=32, max_new_tokens=24)


@pytest.fixture(scope="session")
def bpe_target(tmp_path_factory):
    """A small trained text target with the dataset captured from its own greedy replies."""
    from tapdraft.demo.bpe import prepare_bpe

    return prepare_bpe(tmp_path_factory.mktemp("bpe"), quick=True, progress=False, size=engine_bpe_size())


def train_and_export(data: Path, out: Path, recipe: str, *overrides: str) -> tuple[Path, Path]:
    """`tapdraft train` then `tapdraft export`, through the CLI; returns (run dir, export dir)."""
    from typer.testing import CliRunner

    from tapdraft.cli import app

    run, export = out / "run", out / "export"
    args = ["train", "--data", str(data), "--recipe", recipe, "--out", str(run), "--threads", "1"]
    for o in overrides:
        args += ["--set", o]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(export), "--data", str(data),
                                   "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return run, export


@pytest.fixture(scope="session")
def bpe_dflash(bpe_target, tmp_path_factory):
    """A DFlash drafter (block 8: 7 drafts a round) trained briefly on the BPE target's dataset, exported, with what
    the CPU recipe (``dflash_small``) adds: a draft vocabulary (256 of the target's 1,024; the export carries those
    lm_head rows and vLLM maps its ids through ``d2t``), reach slot weights (now the recipe's own) and more
    context taps than draft layers (``context_taps``: vLLM sizes the context's fc from the export's tap list), and
    a sliding window of 12 positions (the export's ``dflash_config.use_swa``: vLLM must build the same mask). The speech target's DFlash (``speech_case``) keeps the full vocabulary, one tap and full
    attention."""
    return train_and_export(bpe_target.dataset, tmp_path_factory.mktemp("dflash"), "dflash_demo",
                            "drafter.num_layers=1", "max_steps=200", "drafter.draft_vocab=256",
                            "drafter.slot_weighting=reach", "drafter.context_taps=2", "drafter.sliding_window=12")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


SPEECH_TARGETS = ("qwen2_audio",)
"""Speech targets served in the CPU venv. Qwen3-ASR's vLLM module imports transformers' Qwen2-VL image
processor, which needs torchvision, and PyPI has no torchvision for torch 2.13.0+cpu (its builds are CUDA ones
whose ops fail to register on the CPU torch: ``operator torchvision::nms does not exist``); the plugin's fix
applies to it all the same (its config has no ``image_token_index``)."""


@pytest.fixture(scope="session", params=SPEECH_TARGETS)
def speech_case(request, tmp_path_factory):
    """A tiny speech LLM (real on-disk layout, a text model vLLM serves), 24 audio conversations with the
    target's own greedy replies, the dataset captured from them, and a DFlash drafter trained on it."""
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.replies.generate import GenerationConfig
    from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
    from tapdraft.capture.replies.windows import ReplyConfig
    from tests.capture import speech_models
    from tests.capture.util import conv_record, write_manifest, write_wav

    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    target = root / "target"
    getattr(speech_models, f"save_{kind}")(target, text=speech_models.SERVABLE_TEXT)
    records = []
    for i in range(24):
        digits = [(i + j) % 10 for j in range(2 + i % 3)]
        wav = write_wav(root / "audio" / f"{i:03d}.wav", digits, seed=i)
        records.append(conv_record(f"{kind}-{i:03d}", str(wav)))
    src = write_manifest(root / "corpus.jsonl", records)
    convs = root / "train.jsonl"
    regenerate(RegenerateConfig(target=str(target), data=str(src), out=str(convs), progress=False,
                                replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=16),
                                                    keep_truncated=True)))
    dataset = root / "dataset"
    capture(CaptureConfig(target=str(target), out=str(dataset), data=(("train", str(convs)),), progress=False),
            target=None)
    run, export = train_and_export(dataset, root / "dflash", "dflash_demo", "drafter.num_layers=1", "max_steps=150")
    return {"kind": kind, "target": target, "conversations": convs, "dataset": dataset, "run": run,
            "export": export, "root": root}
