"""The Open Spec Config block of a native DFlash export: the shared drafter config vLLM's and SGLang's drafter
trainers (speculators, SpecForge) started, so one file tells either engine how to run the draft.

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
  writes it; tapdraft's blocks attend both ways within the block: ``dflash.speculators`` writes true too) and
  ``sample_from_anchor: false`` (slot 0 is the anchor, the target's token, not a draft).
"""

from __future__ import annotations

from typing import Any

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
