"""Tiny random-init HF speech LLMs saved with save_pretrained (model + processor) in their real layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from demo.target import build_word_tokenizer

WORDS = ["what", "did", "i", "say", "?", "you", "said", "one", "two", "three", "four", "five", "."]

GRANITE_PREPROCESSOR = {
    # the settings of ibm-granite/granite-speech-3.3's preprocessor_config.json (= the extractor's defaults)
    "feature_extractor_type": "GraniteSpeechFeatureExtractor", "processor_class": "GraniteSpeechProcessor",
    "sampling_rate": 16000, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80,
    "projector_window_size": 15, "projector_downsample_rate": 5, "padding_value": 0.0, "feature_size": 80,
}


def save_qwen2_audio(d: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Qwen2AudioForConditionalGeneration + Qwen2AudioProcessor (Whisper features, 128 mels); its state dict."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)

    tok = build_word_tokenizer(WORDS)
    tok.add_tokens(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"], special_tokens=True)
    cfg = Qwen2AudioConfig(
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          num_mel_bins=128),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
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
