"""Load an export with speculators' own classes and report what they took: run INSIDE the engine venv.

    python speculators_load.py EXPORT_DIR OUT.json

speculators' ``DFlashDraftModel`` / ``DFlash2DraftModel`` (picked by the config's ``speculators_model_type``)
are built from the export's ``config.json`` by ``from_pretrained``; OUT lists the missing and unexpected keys
(the target's embedding and lm_head are filled from the verifier at serving time, so they may be missing),
the largest difference between a loaded parameter and the export's tensor, and the config as speculators
parsed it (``sliding_window_non_causal``, aux layer ids, block size).
"""

import json
import os
import sys

VERIFIER_FILLED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                   "t2d", "d2t"}


def main(export: str, out_path: str) -> None:
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel

    cfg = json.load(open(os.path.join(export, "config.json")))
    cls = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel}[cfg["speculators_model_type"]]
    model, info = cls.from_pretrained(export, output_loading_info=True)
    weights = load_file(os.path.join(export, "model.safetensors"))
    state = model.state_dict()
    diff = max((float((state[k].float() - v.float()).abs().max()) for k, v in weights.items() if k in state),
               default=float("nan"))
    c = model.config
    doc = {"class": type(model).__name__, "missing": sorted(set(info["missing_keys"]) - VERIFIER_FILLED),
           "unexpected": sorted(info["unexpected_keys"]), "max_abs_diff": diff,
           "sliding_window_non_causal": c.sliding_window_non_causal, "aux_hidden_state_layer_ids":
           list(c.aux_hidden_state_layer_ids), "block_size": c.block_size, "mask_token_id": c.mask_token_id}
    with open(out_path, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
