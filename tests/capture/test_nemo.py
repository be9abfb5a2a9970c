"""NeMo speechlm2 SALM import: logits against a re-implementation of NeMo's forward, frame counts, detection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from capture.inputs import AudioRef, Conversation
from capture.load import load_target
from capture.nemo import NeMoSALMTarget, is_nemo_salm
from capture.nemo_audio import build_conformer
from tests.capture.nemo_ckpt import ADAPTER, ENCODER, LORA, TAG, write_nemo_salm


@pytest.fixture(scope="session")
def nemo_dirs(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("nemo")
    return write_nemo_salm(d / "ckpt", d / "llm")


@pytest.fixture()
def target(nemo_dirs) -> NeMoSALMTarget:
    t = load_target(nemo_dirs[0], llm_config=nemo_dirs[1])
    assert isinstance(t, NeMoSALMTarget)
    return t


def _conv(n_samples: int, seed: int = 0, reply: str = "you said one two .") -> Conversation:
    wave = np.random.default_rng(seed).normal(0, 0.1, n_samples).astype(np.float32)
    return Conversation(f"c{seed}", "mem", [{"role": "user", "content": f"{TAG} what did i say ?"},
                                           {"role": "assistant", "content": reply}],
                        [AudioRef(array=wave, sample_rate=16000)])


# ------------------------------------------------------------------ the reference: NeMo's forward, re-written
def _nemo_mel(wave: np.ndarray, fb: torch.Tensor, window: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """FilterbankFeatures at eval: preemphasis, centred zero-padded STFT by explicit framing, power, mel,
    log(x + 2^-24), per-feature normalisation over the n // hop valid frames -> [F, M]."""
    n_fft, hop, win = 512, 160, 400
    x = torch.as_tensor(wave).to(dtype)
    x = torch.cat([x[:1], x[1:] - 0.97 * x[:-1]])
    x = torch.nn.functional.pad(x, (n_fft // 2, n_fft // 2))
    w = torch.zeros(n_fft, dtype=dtype)
    w[(n_fft - win) // 2 : (n_fft - win) // 2 + win] = window.to(dtype)
    n_valid = len(wave) // hop
    frames = torch.stack([x[k * hop : k * hop + n_fft] * w for k in range(n_valid)])  # [F, n_fft]
    power = torch.fft.rfft(frames).abs().pow(2)  # [F, n_fft/2+1]
    mel = torch.log(power @ fb[0].to(dtype).T + 2.0**-24)  # [F, M]
    mean = mel.mean(0)
    std = ((mel - mean).pow(2).sum(0) / (n_valid - 1)).sqrt() + 1e-5
    return (mel - mean) / std


class _LoRALinear(nn.Module):
    """PEFT's unmerged LoRA forward: base(x) + alpha / r * B(A(x))."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.scale = base, scale
        self.a, self.b = nn.Parameter(a), nn.Parameter(b)

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.a.T) @ self.b.T


def _nemo_reference(ckpt: Path, llm_dir: Path, conv: Conversation) -> tuple[torch.Tensor, list[int], int]:
    """Logits [T, V] of NeMo's SALM forward on one conversation, its text ids, and the audio frame count."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    sub = lambda p: {k[len(p):]: v for k, v in w.items() if k.startswith(p)}  # noqa: E731
    # perception: preprocessor -> encoder -> modality_adapter -> proj
    feats = _nemo_mel(conv.audios[0].array, w["perception.preprocessor.featurizer.fb"],
                      w["perception.preprocessor.featurizer.window"])
    enc = build_conformer(ENCODER, sub("perception.encoder."), what="encoder")
    adapter = build_conformer(ADAPTER, sub("perception.modality_adapter."), what="adapter")
    with torch.no_grad():
        h = enc(feats[None]).last_hidden_state
        h = adapter(h).last_hidden_state
        audio = (h @ w["perception.proj.weight"].T + w["perception.proj.bias"])[0]  # [N, H]
    # LLM: base weights, embedding moved back, LoRA unmerged on q/v, tied head
    lm = Qwen3ForCausalLM(AutoConfig.from_pretrained(llm_dir)).eval()
    prefix = "llm.base_model.model."
    base = {k[len(prefix):].replace(".base_layer.", "."): v for k, v in w.items()
            if k.startswith(prefix) and ".lora_" not in k}
    base["model.embed_tokens.weight"] = w["embed_tokens.weight"]
    missing, unexpected = lm.load_state_dict(base, strict=False)
    assert set(missing) == ({"lm_head.weight"} if lm.config.tie_word_embeddings else set()) and not unexpected
    if lm.config.tie_word_embeddings:
        lm.tie_weights()
    for i, layer in enumerate(lm.model.layers):
        for name in LORA["target_modules"]:
            form = ".default" if i == 0 else ""
            key = f"{prefix}model.layers.{i}.self_attn.{name}.lora_{{}}{form}.weight"
            setattr(layer.self_attn, name, _LoRALinear(getattr(layer.self_attn, name), w[key.format("A")],
                                                         w[key.format("B")], LORA["lora_alpha"] / LORA["r"]))
    # NeMo's qwen prompt format, tokenized per turn; the tag is added as a special token
    tok = AutoTokenizer.from_pretrained(llm_dir)
    tok.add_special_tokens({"additional_special_tokens": [TAG]})
    (user, reply) = conv.messages
    ids = (tok(f"<|im_start|>user\n{user['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
           + tok(f"<|im_start|>assistant\n{reply['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"])
    tag_id = tok.convert_tokens_to_ids(TAG)
    pos = ids.index(tag_id)
    emb = lm.model.embed_tokens(torch.tensor([0 if i == tag_id else i for i in ids]))
    with torch.no_grad():
        x = torch.cat([emb[:pos], audio, emb[pos + 1 :]])
        logits = lm(inputs_embeds=x[None]).logits[0]
    return logits, ids, audio.shape[0]


def _nemo_frames(n_samples: int) -> int:
    """NeMo's rule: get_seq_len (n + 2 * 256 - 512) // 160, then calc_length over 3 dw_striding stages."""
    length = (n_samples + 2 * 256 - 512) // 160
    for _ in range(3):
        length = int(np.floor((length + 2 - 3) / 2 + 1))
    return length


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("n_samples,tied", [(16000, True), (23456, True), (16000, False)])
def test_logits_equal_nemo_forward(nemo_dirs, target, n_samples, tied, tmp_path):
    if not tied:  # a checkpoint whose LLM has its own head (llm.base_model.model.lm_head.weight)
        nemo_dirs = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", seed=1, tied=False)
        target = load_target(nemo_dirs[0], llm_config=nemo_dirs[1])
        assert target.lm.get_output_embeddings().weight.data_ptr() != target.lm.get_input_embeddings().weight.data_ptr()
    conv = _conv(n_samples, seed=n_samples)
    ref, ids, n_audio = _nemo_reference(*nemo_dirs, conv)
    p = target.prepare(conv, 0)
    with torch.no_grad():
        exp = target.embed([p])[0]
        got = target.lm(inputs_embeds=exp.inputs_embeds[None]).logits[0]
    assert p.length == got.shape[0] == ref.shape[0] == len(ids) - 1 + n_audio
    assert exp.input_ids[~exp.is_audio].tolist() == [i for i in ids if i != target.salm.placeholder_id]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the supervised rows are the reply and its <|im_end|>
    sup = exp.input_ids[exp.loss_mask].tolist()
    assert target.tokenizer.decode(sup) == "you said one two . <|im_end|>"


def test_mel_front_end_equals_float64_reference(target):
    """A padded batch of three lengths: each row equals NeMo's features of that clip alone, in float64."""
    fe = target.salm.feature_extractor
    waves = [np.random.default_rng(n).normal(0, 0.1, n).astype(np.float32) for n in (4000, 16000, 9999)]
    out = fe(waves, sampling_rate=16000)
    for b, wave in enumerate(waves):
        ref = _nemo_mel(wave, fe.fb[None].double(), fe.window.double(), dtype=torch.float64)
        n = int(out["attention_mask"][b].sum())
        assert n == ref.shape[0] == len(wave) // 160
        torch.testing.assert_close(out["input_features"][b, :n].double(), ref, atol=5e-5, rtol=0)  # measured 1e-5
        assert not out["input_features"][b, n:].any()


def test_frame_count_follows_nemo_rule(target):
    for n in (1600, 1601, 2559, 2560, 4000, 16000, 16159, 16160, 31999):
        p = target.prepare(_conv(n, seed=n), 0)
        assert p.length - (len(p.token_ids) - 1) == _nemo_frames(n), n
        with torch.no_grad():
            assert int(target.embed([p])[0].is_audio.sum()) == _nemo_frames(n)


def test_batched_embedding_equals_one_by_one(target):
    convs = [_conv(n, seed=n) for n in (9000, 16000, 12345)]
    preps = [target.prepare(c, i) for i, c in enumerate(convs)]
    with torch.no_grad():
        batch = target.embed(preps)
        for p, b in zip(preps, batch):
            torch.testing.assert_close(target.embed([p])[0].inputs_embeds, b.inputs_embeds, atol=2e-6, rtol=0)


def test_detected_from_config_contents(nemo_dirs, tmp_path):
    ckpt, llm = nemo_dirs
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "nemo_speechlm" and is_nemo_salm(cfg)
    assert is_nemo_salm({k: v for k, v in cfg.items() if k != "model_type"})  # older exports: no model_type
    assert not is_nemo_salm({"model_type": "nemo_speechlm", "text_config": {}})  # transformers' own nemo_speechlm
    assert not is_nemo_salm(json.loads((llm / "config.json").read_text()))
    with pytest.raises(FileNotFoundError, match="--llm-config"):
        load_target(ckpt)


def test_llm_config_and_tokenizer_inside_the_checkpoint(nemo_dirs, target, tmp_path):
    ckpt, llm = nemo_dirs
    own = tmp_path / "ckpt"
    shutil.copytree(ckpt, own)
    (own / "llm_backbone").mkdir()
    shutil.copy(llm / "config.json", own / "llm_backbone" / "config.json")
    for f in llm.iterdir():
        if f.name != "config.json":
            shutil.copy(f, own / f.name)
    t = load_target(own)
    assert t.tokenizer_dir == own
    conv = _conv(16000)
    with torch.no_grad():
        a = t.embed([t.prepare(conv, 0)])[0].inputs_embeds
        b = target.embed([target.prepare(conv, 0)])[0].inputs_embeds
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_unsupported_settings_are_refused(nemo_dirs, tmp_path):
    ckpt, llm = nemo_dirs
    own = tmp_path / "ckpt"
    shutil.copytree(ckpt, own)
    cfg = json.loads((ckpt / "config.json").read_text())
    for patch, match in ((("prompt_format", "llama2"), "prompt format"),
                         (("perception", {**cfg["perception"], "encoder": {**ENCODER, "subsampling": "striding"}}),
                          "subsampling")):
        (own / "config.json").write_text(json.dumps({**cfg, patch[0]: patch[1]}))
        with pytest.raises(ValueError, match=match):
            load_target(own, llm_config=llm)


def test_system_turn_is_refused(target):
    conv = _conv(16000)
    conv = Conversation("s", "mem", [{"role": "system", "content": "be brief"}, *conv.messages], conv.audios)
    with pytest.raises(ValueError, match="only user and assistant"):
        target.prepare(conv, 0)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_capture_verify_train_eval_speculate(tied, nemo_dirs, tone_manifest, tmp_path):
    """The whole chain on the tiny checkpoint, through the command line, with --llm-config."""
    from typer.testing import CliRunner

    from cli import app

    ckpt, llm = nemo_dirs if tied else write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", tied=False)
    ds, run = str(tmp_path / "ds"), str(tmp_path / "run")
    cli = CliRunner()
    r = cli.invoke(app, ["capture", "--target", str(ckpt), "--llm-config", str(llm), "--data", str(tone_manifest),
                         "--data", f"validation={tone_manifest}", "--out", ds, "--taps", "0,1", "--top-k", "8"])
    assert r.exit_code == 0, (r.output, r.exception)
    r = cli.invoke(app, ["verify", ds])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    r = cli.invoke(app, ["train", "--data", ds, "--recipe", "dflash_b8", "--out", run, "--set", "max_steps=2",
                         "--set", "progress=false"])
    assert r.exit_code == 0, (r.output, r.exception)
    r = cli.invoke(app, ["eval", "--draft", run, "--data", ds])
    assert r.exit_code == 0 and "tau = " in r.output, (r.output, r.exception)
    r = cli.invoke(app, ["speculate", "--target", str(ckpt), "--llm-config", str(llm), "--draft", run, "--data", ds,
                         "--conversations", str(tone_manifest), "--max-samples", "3", "--max-new-tokens", "8"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "output identical to the target's greedy decoding: 3/3" in r.output
