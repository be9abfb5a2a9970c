"""NeMo speechlm2 SALM import: logits against a re-implementation of NeMo's forward, frame counts, detection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tapdraft.capture.inputs import AudioRef, Conversation
from tapdraft.capture.targets.load import load_target
from tapdraft.capture.targets.nemo.audio import build_conformer
from tapdraft.capture.targets.nemo.salm import NeMoSALMTarget, is_nemo_salm
from tests.capture.nemo_ckpt import ADAPTER, AUTOMODEL_LORA, ENCODER, LORA, TAG, write_nemo_salm


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


def _nemo_turns(messages: list[dict], prompt_format: str) -> list[str]:
    """The turn texts NeMo's prompt formatter tokenizes one by one (common/prompts/qwen.py, nemo-toolkit 3.0.0;
    qwen3 without its random /no_think augmentation)."""
    msgs = [dict(m) for m in messages]
    if prompt_format == "qwen3":
        for m in msgs[:-1]:
            if m["role"] == "assistant" and "</think>" in m["content"]:
                m["content"] = m["content"].split("</think>")[1].strip()
        last = msgs[-1]
        if last["role"] == "assistant":
            if "<think>" not in last["content"]:
                last["content"] = "<think>\n\n</think>\n\n" + last["content"]
            else:
                reasoning = last["content"].split("<think>")[1].split("</think>")[0].strip()
                answer = last["content"].split("</think>")[1].lstrip("\n")
                last["content"] = f"<think>\n{reasoning}\n</think>\n\n{answer}"
        if msgs[0]["role"] == "system" and msgs[0]["content"].strip() == "":
            msgs = msgs[1:]
    return [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]


def _nemo_reference(ckpt: Path, llm_dir: Path, conv: Conversation, *, layout: str = "export",
                    prompt_format: str = "qwen") -> tuple[torch.Tensor, list[int], int]:
    """Logits [T, V] of NeMo's SALM forward on one conversation, its text ids, and the audio frame count."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        shared = f.metadata() or {}  # save_model's {dropped name: kept name}: one parameter in NeMo's module
    w.update({dropped: w[kept] for dropped, kept in shared.items() if kept in w})
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
    # LLM: base weights, embedding moved back (SALM) or kept (SALMAutomodel), LoRA unmerged on q/v, tied head
    lm = Qwen3ForCausalLM(AutoConfig.from_pretrained(llm_dir)).eval()
    automodel = layout == "automodel"
    prefix = "llm." if automodel else "llm.base_model.model."
    base = {k[len(prefix):].replace(".base_layer.", "."): v for k, v in w.items()
            if k.startswith(prefix) and ".lora_" not in k}
    if not automodel:
        base["model.embed_tokens.weight"] = w["embed_tokens.weight"]
    missing, unexpected = lm.load_state_dict(base, strict=False)
    tied_missing = {"lm_head.weight"} if lm.config.tie_word_embeddings and layout == "export" else set()
    assert set(missing) == tied_missing and not unexpected, (missing, unexpected)
    if lm.config.tie_word_embeddings:
        lm.tie_weights()
    scale = AUTOMODEL_LORA["alpha"] / AUTOMODEL_LORA["dim"] if automodel else LORA["lora_alpha"] / LORA["r"]
    for i, layer in enumerate(lm.model.layers):
        for name in LORA["target_modules"]:
            form = ".default" if i == 0 and not automodel else ""
            key = f"{prefix}model.layers.{i}.self_attn.{name}.lora_{{}}{form}.weight"
            setattr(layer.self_attn, name, _LoRALinear(getattr(layer.self_attn, name), w[key.format("A")],
                                                         w[key.format("B")], scale))
    # NeMo's prompt format, tokenized per turn; the tag is added as a special token
    tok = AutoTokenizer.from_pretrained(llm_dir)
    tok.add_special_tokens({"additional_special_tokens": [TAG]})
    ids = [i for turn in _nemo_turns(conv.messages, prompt_format)
           for i in tok(turn, add_special_tokens=False)["input_ids"]]
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
@pytest.mark.parametrize("kind", ["tied-head", "own-head", "save-pretrained-qwen3"])
def test_capture_verify_train_eval_speculate(kind, nemo_dirs, tone_manifest, tmp_path):
    """The whole chain on the tiny checkpoint, through the command line, with --llm-config; and a
    save_pretrained checkpoint in the qwen3 format whose pretrained_llm is a local directory, without it."""
    from typer.testing import CliRunner

    from tapdraft.cli import app

    if kind == "tied-head":
        ckpt, llm = nemo_dirs
    elif kind == "own-head":
        ckpt, llm = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", tied=False)
    else:
        ckpt, llm = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", layout="hub", prompt_format="qwen3",
                                    pretrained_llm=str(tmp_path / "llm"))
    llm_args = [] if kind == "save-pretrained-qwen3" else ["--llm-config", str(llm)]
    ds, run = str(tmp_path / "ds"), str(tmp_path / "run")
    cli = CliRunner()
    r = cli.invoke(app, ["capture", "--target", str(ckpt), *llm_args, "--data", str(tone_manifest),
                         "--data", f"validation={tone_manifest}", "--out", ds, "--taps", "0,1", "--top-k", "8"])
    assert r.exit_code == 0, (r.output, r.exception)
    r = cli.invoke(app, ["verify", ds])
    assert r.exit_code == 0 and "OK" in r.output, r.output
    r = cli.invoke(app, ["train", "--data", ds, "--recipe", "dflash_b8", "--out", run, "--set", "max_steps=2",
                         "--set", "progress=false"])
    assert r.exit_code == 0, (r.output, r.exception)
    r = cli.invoke(app, ["eval", "--draft", run, "--data", ds])
    assert r.exit_code == 0 and "tau = " in r.output, (r.output, r.exception)
    r = cli.invoke(app, ["speculate", "--target", str(ckpt), *llm_args, "--draft", run, "--data", ds,
                         "--conversations", str(tone_manifest), "--max-samples", "3", "--max-new-tokens", "8"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "output identical to the target's greedy decoding: 3/3" in r.output


# ------------------------------------------------------- NeMo 3.0.0: qwen3, local LLM, save_pretrained layouts
def _logits_match(target, ckpt: Path, llm: Path, *, layout: str, prompt_format: str = "qwen",
                  reply: str = "you said one two .") -> object:
    conv = _conv(16000, seed=7, reply=reply)
    ref, ids, n_audio = _nemo_reference(ckpt, llm, conv, layout=layout, prompt_format=prompt_format)
    p = target.prepare(conv, 0)
    with torch.no_grad():
        exp = target.embed([p])[0]
        got = target.lm(inputs_embeds=exp.inputs_embeds[None]).logits[0]
    assert p.length == got.shape[0] == ref.shape[0] == len(ids) - 1 + n_audio
    assert exp.input_ids[~exp.is_audio].tolist() == [i for i in ids if i != target.salm.placeholder_id]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    return exp


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_save_pretrained_layout_equals_nemo_forward(tied, tmp_path):
    """SALM.save_pretrained's files: config.json with the HF fields, a tied head deduplicated into
    embed_tokens.weight with the metadata naming it; pretrained_llm a local directory (no --llm-config)."""
    from safetensors import safe_open

    ckpt, llm = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", seed=2, tied=tied, layout="hub",
                                pretrained_llm=str(tmp_path / "llm"))
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "nemo_speechlm" and cfg["architectures"] == ["NeMoSpeechLMForConditionalGeneration"]
    head = "llm.base_model.model.lm_head.weight"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert (head in f.keys()) != tied
        assert (f.metadata() or {}).get(head) == ("embed_tokens.weight" if tied else None)
    target = load_target(ckpt)
    assert target.tokenizer_dir == llm
    _logits_match(target, ckpt, llm, layout="hub")


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_salm_automodel_layout_equals_nemo_forward(tied, tmp_path):
    """SALMAutomodel: the embedding inside the LLM (a tied one deduplicated into llm.lm_head.weight, the
    alphabetically first name), Automodel's LoRA (weight beside lora_A/B, scale alpha / dim)."""
    from safetensors import safe_open

    ckpt, llm = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", seed=3, tied=tied, layout="automodel")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys, meta = set(f.keys()), f.metadata() or {}
    assert "embed_tokens.weight" not in keys and "llm.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    if tied:
        assert "llm.model.embed_tokens.weight" not in keys
        assert meta["llm.model.embed_tokens.weight"] == "llm.lm_head.weight"
    else:
        assert {"llm.model.embed_tokens.weight", "llm.lm_head.weight"} <= keys and not meta
    target = load_target(ckpt, llm_config=llm)
    _logits_match(target, ckpt, llm, layout="automodel")


QWEN3_CASES = [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one ."}],
     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\none .<|im_end|>\n"),
    ([{"role": "system", "content": " "}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "<think> two </think>\n\n\none ."}],
     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\ntwo\n</think>\n\none .<|im_end|>\n"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "<think>x</think> one ."}, {"role": "user", "content": "again"},
      {"role": "assistant", "content": "two ."}],
     "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\none ."
     "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\ntwo .<|im_end|>\n"),
]


def test_qwen3_prompt_format_renders_as_nemo(tmp_path):
    """The qwen3 template's text equals NeMo's per-turn rendering; only the last reply is supervised, its think
    block included; the generation prompt adds the empty block only with enable_thinking=False."""
    ckpt, llm = write_nemo_salm(tmp_path / "ckpt", tmp_path / "llm", seed=4, prompt_format="qwen3")
    target = load_target(ckpt, llm_config=llm)
    tok = target.tokenizer
    for messages, text in QWEN3_CASES:
        assert "".join(_nemo_turns(messages, "qwen3")) == text  # the reference agrees with the literal
        assert tok.apply_chat_template(messages, tokenize=False) == text
    prompt = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    sup = target.template.tokenize(QWEN3_CASES[2][0])
    assert tok.decode(sup.ids[sup.mask].tolist()) == "<think> </think> two . <|im_end|>"
    exp = _logits_match(target, ckpt, llm, layout="export", prompt_format="qwen3")
    assert tok.decode(exp.input_ids[exp.loss_mask].tolist()) == "<think> </think> you said one two . <|im_end|>"
    conv = _conv(16000)
    conv = Conversation("s", "mem", [{"role": "system", "content": "be brief"}, *conv.messages], conv.audios)
    assert target.prepare(conv, 0).length > 0  # qwen3 has system turns
    bad = Conversation("t", "mem", [*conv.messages[:2], {"role": "assistant", "content": "one </think> two"}],
                       conv.audios)
    with pytest.raises(Exception, match="</think> without <think>"):
        target.prepare(bad, 0)


def test_local_pretrained_llm_directory(nemo_dirs, target, tmp_path):
    """pretrained_llm naming a local directory with config.json + tokenizer is used; --llm-config still wins;
    a name that is not a local directory still asks for --llm-config."""
    ckpt, llm = nemo_dirs
    own = tmp_path / "ckpt"
    shutil.copytree(ckpt, own)
    cfg = json.loads((ckpt / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**cfg, "pretrained_llm": str(llm)}))
    t = load_target(own)
    assert t.tokenizer_dir == llm
    conv = _conv(16000)
    with torch.no_grad():
        a = t.embed([t.prepare(conv, 0)])[0].inputs_embeds
        b = target.embed([target.prepare(conv, 0)])[0].inputs_embeds
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    (own / "config.json").write_text(json.dumps({**cfg, "pretrained_llm": str(tmp_path / "nowhere")}))
    with pytest.raises(FileNotFoundError, match="--llm-config"):
        load_target(own)
