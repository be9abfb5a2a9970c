"""Tiny random-init HF speech LLMs saved with save_pretrained (model + processor) in their real layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tapdraft.capture.inputs import AudioRef, Conversation
from tapdraft.demo.target import build_word_tokenizer

WORDS = ["what", "did", "i", "say", "?", "you", "said", "one", "two", "three", "four", "five", "."]

def audio_conv(placeholder: str, sid: str, n_samples: int, seed: int,
               reply: str = "you said one two .") -> Conversation:
    """One user turn with an audio of seeded noise (written as the target's ``placeholder``) and one reply."""
    wave = np.random.default_rng(seed).normal(0, 0.1, n_samples).astype(np.float32)
    return Conversation(sid, "mem", [{"role": "user", "content": f"{placeholder} what did i say ?"},
                                     {"role": "assistant", "content": reply}],
                        [AudioRef(array=wave, sample_rate=16000)])


def decoder_inputs_embeds(target, run_model) -> torch.Tensor:
    """The ``inputs_embeds`` the target's decoder receives while ``run_model()`` runs the model's own forward."""
    seen = {}
    h = target.decoder.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["inputs_embeds"]),
                                                 with_kwargs=True)
    try:
        with torch.no_grad():
            run_model()
    finally:
        h.remove()
    return seen["x"]


def layers_and_logits(target, inputs: dict) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The model's own forward on ``inputs`` (its processor's output): every decoder layer's output by index,
    and the logits."""
    out: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, j=j: out.__setitem__(j, o[0] if isinstance(o, tuple) else o))
             for j, layer in enumerate(target.layers)]
    try:
        logits = target.model(**inputs).logits
    finally:
        for h in hooks:
            h.remove()
    return out, logits


GRANITE_PREPROCESSOR = {
    # the settings of ibm-granite/granite-speech-3.3's preprocessor_config.json (= the extractor's defaults)
    "feature_extractor_type": "GraniteSpeechFeatureExtractor", "processor_class": "GraniteSpeechProcessor",
    "sampling_rate": 16000, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80,
    "projector_window_size": 15, "projector_downsample_rate": 5, "padding_value": 0.0, "feature_size": 80,
}


SERVABLE_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
"""Text-model sizes a serving engine runs: vLLM's CPU attention serves head dim 32 (not 8, 16 or 24)."""


def save_qwen2_audio(d: Path, seed: int = 0, text: dict | None = None, audio: dict | None = None
                     ) -> dict[str, torch.Tensor]:
    """Qwen2AudioForConditionalGeneration + Qwen2AudioProcessor (Whisper features, 128 mels); its state dict.
    ``text`` overrides the language model's sizes (e.g. ``SERVABLE_TEXT``), ``audio`` the encoder's."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)

    tok = build_word_tokenizer(WORDS)
    tok.add_tokens(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"], special_tokens=True)
    cfg = Qwen2AudioConfig(
        audio_config={**dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                             num_mel_bins=128), **(audio or {})},
        text_config={**dict(model_type="qwen2", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2), **(text or {})},
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(cfg).eval()
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=tok.chat_template).save_pretrained(d)
    model.save_pretrained(d)
    return model.state_dict()


def save_granite_speech(d: Path, seed: int = 0, logits_scaling: float = 4.0) -> Path:
    """GraniteSpeechForConditionalGeneration + its tokenizer and processor files.

    The processor files are written as JSON (GraniteSpeechFeatureExtractor cannot be built without
    torchaudio); the audio token's id lies outside the LM vocabulary, as in the released checkpoints,
    and the Granite multipliers and logits scaling are not 1 so that dropping any of them shows.
    """
    from transformers import GraniteSpeechConfig, GraniteSpeechForConditionalGeneration

    tok = build_word_tokenizer(WORDS)
    tok.add_tokens(["<|audio|>"], special_tokens=True)
    audio_id = tok.convert_tokens_to_ids("<|audio|>")
    cfg = GraniteSpeechConfig(
        text_config=dict(model_type="granite", vocab_size=audio_id, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         logits_scaling=logits_scaling, embedding_multiplier=2.0, residual_multiplier=0.5,
                         attention_multiplier=0.3, tie_word_embeddings=True),
        encoder_config=dict(input_dim=160, num_layers=2, hidden_dim=16, num_heads=2, output_dim=8, context_size=20,
                            conv_kernel_size=3),
        projector_config=dict(model_type="blip_2_qformer", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, encoder_hidden_size=16, cross_attention_frequency=1),
        audio_token_index=audio_id, has_lora_adapter=False,
    )
    torch.manual_seed(seed)
    GraniteSpeechForConditionalGeneration(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps(GRANITE_PREPROCESSOR, indent=2))
    (d / "processor_config.json").write_text(json.dumps({"audio_token": "<|audio|>",
                                                         "processor_class": "GraniteSpeechProcessor"}, indent=2))
    return d


MISTRAL_SPECIALS = [  # tekken.json's special tokens in rank order (mistral-common's SpecialTokens; [AUDIO] is 24)
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "<SPECIAL_20>", "<SPECIAL_21>",
    "<SPECIAL_22>", "<SPECIAL_23>", "[AUDIO]", "[BEGIN_AUDIO]",
]
MISTRAL_TEMPLATE = (  # Mistral's instruct layout, assistant turns marked for the supervised mask
    "<s>{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% else %}{% generation %}{{ m['content'] }}</s>{% endgeneration %}{% endif %}{% endfor %}"
)


def save_voxtral(d: Path, seed: int = 0, frame_rate: float = 12.5) -> Path:
    """VoxtralForConditionalGeneration + tekken.json (byte-level: 256 byte tokens after the specials) +
    preprocessor_config.json (WhisperFeatureExtractor, 128 mels) + chat_template.jinja.

    The encoder keeps the real 1500 positions (the processor cuts audio into 30 s chunks of 3000 mel
    frames) with a tiny width; 4 encoder frames per projected frame: 375 per chunk.
    """
    import base64

    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

    S = len(MISTRAL_SPECIALS)
    tekken = {
        "config": {"pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                   "num_vocab_tokens": 256, "default_vocab_size": 256 + S, "default_num_special_tokens": S,
                   "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None}
                  for i in range(256)],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(MISTRAL_SPECIALS)],
        "audio": {"sampling_rate": 16000, "frame_rate": frame_rate, "chunk_length_s": 30.0,
                  "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}},
    }
    (d / "tekken.json").write_text(json.dumps(tekken))
    (d / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    cfg = VoxtralConfig(
        audio_config=dict(hidden_size=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_mel_bins=128, max_source_positions=1500),
        text_config=dict(vocab_size=256 + S, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2),
        audio_token_id=MISTRAL_SPECIALS.index("[AUDIO]"),
    )
    torch.manual_seed(seed)
    VoxtralForConditionalGeneration(cfg).eval().save_pretrained(d)
    WhisperFeatureExtractor(feature_size=128, sampling_rate=16000).save_pretrained(d)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**pre, "processor_class": "VoxtralProcessor"}, indent=2))
    return d


def own_inputs(target, messages: list[dict], waves: list, *, add_generation_prompt: bool = False) -> dict:
    """What the model's own forward/generate takes for these messages and audio (its processor's output;
    Voxtral's expansion lives in mistral-common, so there the ids are the adapter's and the features the
    processor's: the model's own merge checks that their counts agree)."""
    text = target.tokenizer.apply_chat_template(target._wrap(messages), tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    if target.model_type == "voxtral":
        ids, _, feats, _ = target._process(text, waves)
        return {"input_ids": ids[None], "input_features": torch.cat(feats)}
    extra = {"sampling_rate": 16000} if target.model_type == "qwen2_audio" else {}
    return dict(target.processor(text=text, audio=waves, return_tensors="pt", **extra))


def save_qwen3_asr(d: Path, seed: int = 0, text: dict | None = None) -> dict[str, torch.Tensor]:
    """Qwen3ASRForConditionalGeneration + Qwen3ASRProcessor (128 mels, 1 s encoder chunks); its state dict.
    ``text`` overrides the language model's sizes (e.g. ``SERVABLE_TEXT``)."""
    from transformers import (Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration,
                              Qwen3ASRProcessor)

    tok = build_word_tokenizer(WORDS)
    tok.add_tokens(["<|audio_pad|>", "<|audio_start|>", "<|audio_end|>"], special_tokens=True)
    tok.save_pretrained(d)
    cfg_path = d / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["extra_special_tokens"] = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                                       "audio_eos_token": "<|audio_end|>"}
    cfg_path.write_text(json.dumps(tok_cfg))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    cfg = Qwen3ASRConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                          output_dim=(text or {}).get("hidden_size", 32), downsample_hidden_size=8, n_window=50, n_window_infer=200),
        text_config={**dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
                     **(text or {})},
        audio_token_id=tok.convert_tokens_to_ids("<|audio_pad|>"), pad_token_id=tok.pad_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(cfg).eval()
    Qwen3ASRProcessor(feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=tok,
                      chat_template=tok.chat_template).save_pretrained(d)
    model.save_pretrained(d)
    return model.state_dict()
