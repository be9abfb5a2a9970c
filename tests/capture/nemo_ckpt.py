"""A tiny NeMo speechlm2 SALM checkpoint in exactly the layout NeMo's hub mixin saves (no NeMo needed).

Names are written from NeMo's own module structure (github.com/NVIDIA/NeMo 2025-09:
asr/modules/conformer_encoder.py, asr/parts/submodules/{conformer_modules,multi_head_attention,
subsampling}.py, speechlm2/modules/perception.py, speechlm2/models/salm.py with PEFT LoRA), NOT from
the importer's mapping, so a wrong mapping fails to load. Tensors are bf16, as NeMo's to_hf export
writes them. The LLM's config and tokenizer go to a separate directory, standing in for a local copy
of ``pretrained_llm``.

Layouts (``layout``): "export" (the to_hf.py export: ``save_file`` of the state dict, a tied head left out);
"hub" (``SALM.save_pretrained`` in nemo-toolkit 3.0.0: ``parts/hf_hub.py`` sets model_type and
architectures, then huggingface_hub's ``PyTorchModelHubMixin`` writes config.json and the weights with
``safetensors.torch.save_model``, which drops the tied ``lm_head`` and names ``embed_tokens.weight`` in
the metadata; written here through that same mixin); "automodel" (``SALMAutomodel.save_pretrained``:
the embedding inside the LLM at ``llm.model.embed_tokens.weight``, Automodel's LoRA
``..._proj.weight`` + ``..._proj.lora_{A,B}.weight`` with ``dim``/``alpha``, same mixin).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tapdraft.demo.target import build_word_tokenizer

TAG = "<|audioplaceholder|>"
WORDS = ["what", "did", "i", "say", "?", "you", "said", "one", "two", "three", "four", "."]
LORA = {"task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
AUTOMODEL_LORA = {"dim": 4, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
"""Automodel's PeftConfig names (scale alpha / dim = 4; read as PEFT fields it would be 8 / 8 = 1)."""
LAYOUTS = ("export", "hub", "automodel")
PREPROCESSOR = {
    "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor", "sample_rate": 16000,
    "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01, "window": "hann", "features": 16,
    "n_fft": 512, "log": True, "frame_splicing": 1, "dither": 1e-05, "pad_to": 0, "pad_value": 0.0,
}
ENCODER = {
    "_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": 16, "feat_out": -1, "n_layers": 2,
    "d_model": 32, "subsampling": "dw_striding", "subsampling_factor": 8, "subsampling_conv_channels": 8,
    "causal_downsampling": False, "ff_expansion_factor": 2, "self_attention_model": "rel_pos", "n_heads": 4,
    "att_context_size": [-1, -1], "xscaling": True, "untie_biases": True, "pos_emb_max_len": 5000,
    "conv_kernel_size": 9, "conv_norm_type": "batch_norm", "conv_context_size": None, "dropout": 0.1,
    "dropout_pre_encoder": 0.1, "dropout_emb": 0.0, "dropout_att": 0.1,
}
ADAPTER = {**ENCODER, "feat_in": 32, "n_layers": 1, "d_model": 24, "subsampling_factor": 1, "n_heads": 2,
           "subsampling_conv_channels": 256, "dropout": 0.0}
LLM_HIDDEN = 32


def _conformer(prefix: str, c: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under NeMo ConformerEncoder names."""
    out: dict[str, torch.Tensor] = {}

    def t(name: str, *shape: int, scale: float | None = None) -> None:
        s = scale if scale is not None else (shape[-1] if len(shape) > 1 else 1) ** -0.5
        out[prefix + name] = torch.randn(*shape, generator=g) * s

    d, f, k, h = c["d_model"], c["d_model"] * c["ff_expansion_factor"], c["conv_kernel_size"], c["n_heads"]
    if c["subsampling_factor"] > 1:  # dw_striding: conv.0, ReLU, then (depthwise, pointwise, ReLU) per stage
        ch, stages = c["subsampling_conv_channels"], int(np.log2(c["subsampling_factor"]))
        t("pre_encode.conv.0.weight", ch, 1, 3, 3, scale=1 / 3)
        t("pre_encode.conv.0.bias", ch, scale=0.1)
        for s in range(stages - 1):
            t(f"pre_encode.conv.{2 + 3 * s}.weight", ch, 1, 3, 3, scale=1 / 3)
            t(f"pre_encode.conv.{2 + 3 * s}.bias", ch, scale=0.1)
            t(f"pre_encode.conv.{3 + 3 * s}.weight", ch, ch, 1, 1, scale=ch**-0.5)
            t(f"pre_encode.conv.{3 + 3 * s}.bias", ch, scale=0.1)
        t("pre_encode.out.weight", d, ch * (c["feat_in"] >> stages))
        t("pre_encode.out.bias", d, scale=0.1)
    else:
        t("pre_encode.weight", d, c["feat_in"])
        t("pre_encode.bias", d, scale=0.1)
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        for norm in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out"):
            out[f"{prefix}{p}{norm}.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
            t(f"{p}{norm}.bias", d, scale=0.1)
        for ff in ("feed_forward1", "feed_forward2"):
            t(f"{p}{ff}.linear1.weight", f, d)
            t(f"{p}{ff}.linear1.bias", f, scale=0.1)
            t(f"{p}{ff}.linear2.weight", d, f)
            t(f"{p}{ff}.linear2.bias", d, scale=0.1)
        for lin in ("linear_q", "linear_k", "linear_v", "linear_out"):
            t(f"{p}self_attn.{lin}.weight", d, d)
            t(f"{p}self_attn.{lin}.bias", d, scale=0.1)
        t(f"{p}self_attn.linear_pos.weight", d, d)
        t(f"{p}self_attn.pos_bias_u", h, d // h, scale=0.1)
        t(f"{p}self_attn.pos_bias_v", h, d // h, scale=0.1)
        t(f"{p}conv.pointwise_conv1.weight", 2 * d, d, 1, scale=d**-0.5)
        t(f"{p}conv.pointwise_conv1.bias", 2 * d, scale=0.1)
        t(f"{p}conv.depthwise_conv.weight", d, 1, k, scale=k**-0.5)
        t(f"{p}conv.depthwise_conv.bias", d, scale=0.1)
        out[f"{prefix}{p}conv.batch_norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        t(f"{p}conv.batch_norm.bias", d, scale=0.1)
        t(f"{p}conv.batch_norm.running_mean", d, scale=0.1)
        out[f"{prefix}{p}conv.batch_norm.running_var"] = 0.5 + torch.rand(d, generator=g)
        out[f"{prefix}{p}conv.batch_norm.num_batches_tracked"] = torch.tensor(1000)
        t(f"{p}conv.pointwise_conv2.weight", d, d, 1, scale=d**-0.5)
        t(f"{p}conv.pointwise_conv2.bias", d, scale=0.1)
    return out


def _mel_buffers() -> dict[str, torch.Tensor]:
    from transformers.audio_utils import mel_filter_bank

    fb = mel_filter_bank(num_frequency_bins=257, num_mel_filters=16, min_frequency=0.0, max_frequency=8000.0,
                         sampling_rate=16000, norm="slaney", mel_scale="slaney")  # librosa's default, as NeMo
    return {"perception.preprocessor.featurizer.fb": torch.tensor(fb.T, dtype=torch.float32)[None],
            "perception.preprocessor.featurizer.window": torch.hann_window(400, periodic=False)}


def _hub_save(root: Path, weights: dict[str, torch.Tensor], cfg: dict) -> None:
    """What NeMo's HFHubMixin.save_pretrained does: the mixin's own save of a module holding ``weights``
    (tensors given under two names are one shared parameter, as a tied head is)."""
    from huggingface_hub import PyTorchModelHubMixin
    from torch import nn

    class Saved(nn.Module, PyTorchModelHubMixin):
        pass

    model, params = Saved(), {}
    for name, t in weights.items():
        *path, leaf = name.split(".")
        mod = model
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if t.is_floating_point():
            params.setdefault(id(t), nn.Parameter(t, requires_grad=False))
            mod.register_parameter(leaf, params[id(t)])
        else:
            mod.register_buffer(leaf, t)
    cfg = {**cfg}
    cfg.setdefault("model_type", "nemo_speechlm")  # parts/hf_hub.py, before the mixin writes config.json
    cfg.setdefault("architectures", ["NeMoSpeechLMForConditionalGeneration"])
    model.save_pretrained(root, config=cfg)


def write_nemo_salm(root: Path, llm_dir: Path, *, seed: int = 0, model_type: bool = True, tied: bool = True,
                    layout: str = "export", prompt_format: str = "qwen",
                    pretrained_llm: str = "Qwen/Qwen3-1.7B") -> tuple[Path, Path]:
    """Checkpoint dir (config.json + model.safetensors) and LLM dir (config.json + tokenizer files).

    ``tied``: the LLM ties its head to the embedding (as Qwen3-1.7B does), so there is no lm_head key
    (the hub layouts: deduplicated into the kept name); otherwise ``...lm_head.weight`` is stored.
    ``pretrained_llm``: what config.json names (``str(llm_dir)`` for a local directory).
    """
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert layout in LAYOUTS, layout
    automodel = layout == "automodel"
    g = torch.Generator().manual_seed(seed)
    tok = build_word_tokenizer(WORDS, placeholder="<|unused|>")  # NeMo adds the locator tag itself
    if prompt_format == "qwen3":
        tok.add_tokens(["<think>", "</think>"])  # as Qwen3's tokenizer has them (added, not special)
    lm_cfg = Qwen3Config(vocab_size=len(tok) + 6, hidden_size=LLM_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    lm = Qwen3ForCausalLM(lm_cfg)
    llm_dir.mkdir(parents=True, exist_ok=True)
    lm_cfg.save_pretrained(llm_dir)
    tok.save_pretrained(llm_dir)

    embed = lm.model.embed_tokens.weight.detach().clone().to(torch.bfloat16)
    llm = "llm." if automodel else "llm.base_model.model."
    w: dict[str, torch.Tensor] = {f"{llm}model.embed_tokens.weight" if automodel else "embed_tokens.weight": embed}
    if tied and layout != "export":  # the module holds the head as the embedding itself
        w[f"{llm}lm_head.weight"] = embed
    r = AUTOMODEL_LORA["dim"] if automodel else LORA["r"]
    for key, value in lm.state_dict().items():
        if key == "model.embed_tokens.weight" or (tied and key == "lm_head.weight"):
            continue  # the embedding was moved out of the LLM (or is above); a tied head has no key of its own
        module, _, leaf = key.rpartition(".")
        if module.endswith(("q_proj", "v_proj")) and leaf == "weight":
            base = f"{llm}{module}"
            # PEFT: base_layer, both key forms; Automodel's LinearLoRA keeps the Linear's own weight
            form = ".default" if ".layers.0." in key and not automodel else ""
            w[f"{base}.weight" if automodel else f"{base}.base_layer.weight"] = value.detach().clone()
            w[f"{base}.lora_A{form}.weight"] = torch.randn(r, value.shape[1], generator=g) * 0.2
            w[f"{base}.lora_B{form}.weight"] = torch.randn(value.shape[0], r, generator=g) * 0.2
        else:
            w[f"{llm}{key}"] = value.detach().clone()
    w.update(_mel_buffers())
    w.update(_conformer("perception.encoder.", ENCODER, g))
    w.update(_conformer("perception.modality_adapter.", ADAPTER, g))
    w["perception.proj.weight"] = torch.randn(LLM_HIDDEN, ADAPTER["d_model"], generator=g) * ADAPTER["d_model"] ** -0.5
    w["perception.proj.bias"] = torch.randn(LLM_HIDDEN, generator=g) * 0.02
    root.mkdir(parents=True, exist_ok=True)
    w = {k: v.to(torch.bfloat16).contiguous() if v.is_floating_point() and v is not embed else v for k, v in w.items()}
    cfg = {
        "pretrained_llm": pretrained_llm, "pretrained_asr": "nvidia/canary-1b-flash", "pretrained_weights": False,
        "freeze_params": ["^llm\\..+$", "^embed_tokens\\..+$"], "prevent_freeze_params": [],
        "prompt_format": prompt_format, "audio_locator_tag": TAG, "lora": AUTOMODEL_LORA if automodel else LORA,
        "perception": {"target": "nemo.collections.speechlm2.modules.perception.AudioPerceptionModule",
                       "preprocessor": PREPROCESSOR, "encoder": ENCODER, "modality_adapter": ADAPTER,
                       "output_dim": LLM_HIDDEN},
        "torch_dtype": "bfloat16",
    }
    if layout != "export":
        _hub_save(root, w, cfg)
        return root, llm_dir
    save_file(w, str(root / "model.safetensors"))
    if model_type:
        cfg["model_type"] = "nemo_speechlm"
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root, llm_dir
