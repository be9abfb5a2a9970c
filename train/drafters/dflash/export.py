"""DFlash's export layouts: the speculators format (``export --layout speculators``, DFlash and DFlash2) and the
Open Spec Config block every native export carries. Each section below is pinned to the version it was
checked against.

**speculators.** speculators (vllm-project/speculators 0.9.0) stores a draft as ``config.json`` with
``speculators_model_type``, a ``transformer_layer_config`` (the draft's Qwen3 fields), the DFlash fields
at the top level and a ``speculators_config`` naming the proposal (greedy, ``block_size - 1`` tokens) and
the verifier; the weights keep the draft body's names (tapdraft's export names: the same). vLLM reads the
format itself (``transformers_utils/configs/speculators``): ``aux_hidden_state_layer_ids`` are vLLM layer
ids (tap + 1), and ``dflash_config.causal`` becomes ``not sliding_window_non_causal`` FOR EVERY LAYER, so
the flag must be true for a DFlash draft (its blocks attend both ways); ``speculators convert`` writes
false for DFlash, which vLLM then serves as a causal draft (lower acceptance, same greedy output).

speculators' DFlash context is the aux layers alone: it treats the target's last layer as the teacher's
(``verifier_last_hidden_states``), never as a context tap, and its converter drops the last layer from
the ids and slices its columns off ``fc.weight``. A draft that taps the last layer therefore has no
speculators form and is refused; the native layout serves it in vLLM unchanged.

**Open Spec Config.** The block a native DFlash export carries: the shared drafter config vLLM's and SGLang's
drafter trainers (speculators, SpecForge) started, so one file tells either engine how to run the draft.

Pinned to schema version 0.0.0 as published in ``open-spec-config/open-spec-config`` at commit
b237d1ddeb517e76a1eaa6a9fd7fc634a433a0d9, file ``src/open-spec-config/schema/dflash.schema.json`` (with
``src/open-spec-config/examples/dflash.json``). At that version the block is two top-level keys beside the
draft's own Qwen3 fields (which the native export already writes: ``architectures``, ``hidden_size``, ...):
``open_spec_config_version`` and ``speculative_config`` = {method, speculative_tokens, verifier?, target_layer_ids,
target_layer_start_idx, draft_vocab_size?, dflash_config: {sample_from_anchor, sliding_window_non_causal,
mask_token_id}, speculative_library, speculative_library_version}. The format is still moving (the repository's
later tests flatten ``dflash_config`` into ``speculative_config`` and rename the library fields): a new version
is a new, tested function here, never an edit of this one.

Meanings tapdraft fixes where the schema leaves them open:
- ``speculative_tokens`` = drafts per round = ``block_size - 1`` (the schema: "speculative tokens generated per
  decoding turn"; the anchor slot is the target's own token). Each engine's "block size" is stated beside it in
  ``tapdraft.block_size`` (vLLM: num_speculative_tokens + 1; SGLang: its draft-token count, the same block).
- ``target_layer_ids`` in HF numbering (output of decoder layer i) with ``target_layer_start_idx: 0``, the
  export's own ``target_layer_ids`` (vLLM's are i + 1: ``target_layer_ids_vllm``).
- ``sliding_window_non_causal: true`` (vLLM builds the draft causal when it is false, as speculators' converter
  writes it; tapdraft's blocks attend both ways within the block: ``to_speculators`` writes true too) and
  ``sample_from_anchor: false`` (slot 0 is the anchor, the target's token, not a draft).
"""

from __future__ import annotations

from typing import Any

import torch

FORMAT_VERSION = "0.9.0"
"""The speculators release whose classes this layout was checked against (tests/engines)."""

QWEN3_FIELDS = ("attention_bias", "attention_dropout", "head_dim", "hidden_act", "hidden_size", "intermediate_size",
                "layer_types", "max_position_embeddings", "model_type", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters", "sliding_window", "tie_word_embeddings",
                "use_sliding_window", "vocab_size")
"""The draft's transformer fields speculators keeps in ``transformer_layer_config``."""

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def to_speculators(state: dict[str, torch.Tensor], config: dict[str, Any], *, verifier: str | None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, native export config) of a DFlash / DFlash2 draft -> the same draft in speculators' format."""
    family = config.get("tapdraft", {}).get("family")
    if family not in ("dflash", "dflash2"):
        raise ValueError(f"--layout speculators is for DFlash and DFlash2 drafts; a {family!r} draft has its own "
                         "layout")
    if not verifier:
        raise ValueError("the speculators format names the target model (speculators_config.verifier): pass "
                         "--verifier NAME, the hub id or directory name vLLM will serve as the target")
    taps = list(config["target_layer_ids"])
    last = int(config["num_target_layers"]) - 1
    if last in taps:
        raise ValueError(f"this draft taps the target's last layer ({last}), which speculators' DFlash cannot hold "
                         "as a context tap (it drops it and slices fc.weight); export it in the native layout (drop "
                         "--layout), which vLLM serves as it is")
    dc = config["dflash_config"]
    if dc.get("use_swa"):
        raise ValueError("this draft's layers attend a sliding window, which speculators' DFlash config cannot state "
                         "(vLLM would serve it with full attention); export it in the native layout (drop --layout)")
    doc: dict[str, Any] = {
        "speculators_model_type": family,
        "speculators_version": FORMAT_VERSION,
        "architectures": list(config["architectures"]),
        "transformer_layer_config": {k: config[k] for k in QWEN3_FIELDS if k in config},
        "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
        "block_size": int(config["block_size"]),
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in taps],
        "mask_token_id": int(dc["mask_token_id"]),
        "sliding_window_non_causal": True,  # vLLM: causal = not this, for every layer; DFlash blocks are not causal
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": family,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(config["block_size"]) - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        **{k: dc[k] for k in DFLASH2_FIELDS if family == "dflash2"},
        # what the native config says beyond speculators' fields (logits rule, head, provenance) rides along
        **{k: config[k] for k in ("logits", "logits_scaling", "logits_scaling_folded_into",
                                  "logits_scaling_compensated_in", "target_head", "tapdraft") if k in config},
    }
    return dict(state), doc


OPEN_SPEC_CONFIG_VERSION = "0.0.0"
"""The schema version this block was written and tested against (see the module docstring for the pinned file)."""
LIBRARY = "tapdraft"


def open_spec_block(config: dict[str, Any], library_version: str) -> dict[str, Any]:
    """The Open Spec Config keys of a native DFlash export config (``DFlashDrafter.export_config``)."""
    dc = config["dflash_config"]
    spec: dict[str, Any] = {
        "method": "dflash",
        "speculative_tokens": int(config["block_size"]) - 1,
        "target_layer_ids": [int(i) for i in config["target_layer_ids"]],
        "target_layer_start_idx": 0,
        "dflash_config": {"sample_from_anchor": False, "sliding_window_non_causal": True,
                          "mask_token_id": int(dc["mask_token_id"])},
        "speculative_library": LIBRARY,
        "speculative_library_version": library_version,
    }
    if config.get("draft_vocab_size"):
        spec["draft_vocab_size"] = int(config["draft_vocab_size"])
    return {"open_spec_config_version": OPEN_SPEC_CONFIG_VERSION, "speculative_config": spec}
