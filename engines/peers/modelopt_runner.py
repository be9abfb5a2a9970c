"""Train NVIDIA Model-Optimizer's offline DFlash, DSpark or EAGLE-3 step by step, INSIDE its venv
(engines/venv.sh modelopt).

    python modelopt_runner.py JOB.json          # then one command a line on stdin, one JSON line back each

JOB: {"mode": "dflash" | "dspark" | "eagle", "base": DIR (config.json + model.safetensors: embed_tokens, lm_head,
      final norm),
      "files": [PT, ...] (ModelOpt's offline samples, benchmarks/peers.py ``to_modelopt``), "train_len": T, "lr",
      "betas", "weight_decay", "seed": 0, "threads": 1, "compile": false,
      "architecture": {"intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"},
      "heldout_files": [PT, ...] (samples never trained on, for ``heldout``), "precision": "bfloat16" | "float32",
      dflash: "block_size": 16, "num_anchors": 32, "gamma": 7.0, "mask_token_id": ID, "draft_layers": 1,
              "self_distillation": false;
      dspark: the dflash fields and "markov_rank": 256, "confidence_head": true, "ce_weight": 0.1,
              "tv_weight": 0.9, "confidence_weight": 0.1;
      eagle:  "ttt_steps": K, "step_decay": 0.8, "aux_layer_ids": [...], "rope_theta"}
Commands: ``step`` -> {"s": SECONDS, "loss": L, "rows": R, "dtypes": {"head", "embedding", "draft"}} (forward +
backward + AdamW step over one batch of the training files; the dtypes each part computed in, from forward hooks);
``heldout`` -> {"loss": L, "rows": R} (the same loss on one batch of the held-out files, no gradient); ``load`` ->
{"samples": [{"input_ids", "base_model_hidden_states", "aux_hidden_states", "loss_mask"} as lists]} (what
ModelOpt's own dataset class reads, for the converter's test); ``exit`` -> {"peak_rss": BYTES} and exit. The
first line out is {"ready": true, "trainable_params", "versions", ...}.

The model is built as ModelOpt's offline recipes build it: ``FakeBaseModel.from_source`` (the frozen
embedding, lm_head and final norm, no decoder layers) converted with ``mtsp.convert(model, [(MODE, cfg)])``;
the batch comes from its ``OfflineSupervisedDataset(answer_only_loss=True)`` and ``EagleOfflineDataCollator``.

DFlash: loss weighting is the paper's static decay (``dflash_loss_objective="decay"``), tapdraft's default;
ModelOpt's own default D-PACE weighting is another loss. The draft layer's widths are passed explicitly: ModelOpt
builds its draft config as a ``Qwen3Config`` whose class defaults (MLP 22,016, 32 heads) win over the base model's
widths, so left alone a "1-layer" draft at hidden 576 has 47.8M trainable parameters instead of 3.9M.

DSpark: DFlash's mode with ``dflash_architecture_config.projector_type="dspark"`` (``HFDSparkModel``,
plugins/hf_dspark.py): the vanilla Markov head (``markov_w1`` V x r, ``markov_w2`` r -> V), the confidence head
(``confidence_proj`` over [h ; markov_w1[prev]]) when asked, next-token slots (slot k predicts anchor + k + 1,
slot 0 included), and its loss ce_alpha x CE + l1_alpha x sum|p - q| + conf_alpha x BCE(c, 1 - TV), every term
over the same slot-weighted count, p the base head on the offline last hidden (final norm re-applied). Its
confidence weight defaults to 0 (tapdraft's recipe: 0.1), so the job passes all three.

EAGLE: its EAGLE-3 default (``eagle3_default_config``: fc over the aux layers, a Llama decoder layer over
[input_layernorm(embedding) ; hidden_norm(hidden)], a trained last norm, the base lm_head frozen, the full
vocabulary: no d2t unless ``draft_vocab_size`` is set) with the widths, the aux layer count, the training-time-test
steps (``eagle_ttt_steps``, its default 3) and the step decay (``eagle_loss_decay_factor``, its default 0.9) of
the job; torch.compile off. Its loss is always the soft cross-entropy -sum p log q against the base logits (the
offline last hidden, final norm re-applied, lm_head), summed over steps each normalised by its own mask count.

Precision: ModelOpt takes its dtype from the base checkpoint and nothing else, on CPU as on GPU:
``FakeBaseModel.from_source`` builds the embedding, lm_head and norm in the config's ``dtype``
(``modelopt/torch/speculative/plugins/modeling_fakebase.py``) and the draft module is moved to the base model's
dtype (``self.dflash_module.to(self._base_model.dtype)`` in ``plugins/hf_dflash.py``, ``self.eagle_module.to(...)``
in ``plugins/hf_eagle.py``). A real checkpoint is bf16, so by default every part, the trainable draft and its AdamW
state included, is bf16 (no fp32 master weights); the converter writes the base in the job's precision, and EAGLE's
``torch_dtype`` follows it.

It imports only the peer venv's packages (torch, transformers, modelopt): it is not part of tapdraft's package.
"""

import json
import sys

from peer_protocol import adamw, channel, dtype_probe, serve


def _rows(model, anchors, keep, loss_mask, seq_len, block):
    """Loss rows of a step as ModelOpt's ``_compute_loss`` weighs them (kept block, in range, slot > 0,
    supervised label)."""
    import torch

    idx = anchors.unsqueeze(-1) + torch.arange(block).view(1, 1, -1)
    ok = keep.unsqueeze(-1) & (idx < seq_len) & (torch.arange(block).view(1, 1, -1) > 0)
    sup = torch.gather(loss_mask.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, idx.clamp(max=seq_len - 1))
    return int((ok & (sup > 0.5)).sum())


def _dspark_rows(anchors, keep, loss_mask, seq_len, block):
    """Loss rows of a DSpark step as ``_compute_dspark_loss`` weighs them: every slot k of a kept block predicts
    anchor + k + 1 (slot 0 included), in range, supervised."""
    import torch

    idx = anchors.unsqueeze(-1) + torch.arange(1, block + 1).view(1, 1, -1)
    ok = keep.unsqueeze(-1) & (idx < seq_len)
    sup = torch.gather(loss_mask.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, idx.clamp(max=seq_len - 1))
    return int((ok & (sup > 0.5)).sum())


def _eagle_rows(loss_mask, steps):
    """Loss rows of a step as ModelOpt's ``_eagle_loss`` counts them: step j reads ``loss_mask[:, 1 + j:]``."""
    return int(sum(float(loss_mask[:, 1 + j:].sum()) for j in range(steps)))


def _dflash_config(job):
    """ModelOpt's DFlash config for the job (DSpark's is this plus its head and loss weights)."""
    return {"dflash_offline": True, "dflash_block_size": job["block_size"], "dflash_num_anchors": job["num_anchors"],
            "dflash_loss_objective": "decay", "dflash_loss_decay_factor": job["gamma"],
            "dflash_mask_token_id": job["mask_token_id"],
            "dflash_self_logit_distillation": bool(job.get("self_distillation", False)),
            "dflash_use_torch_compile": bool(job.get("compile", False)),
            "dflash_architecture_config": {"num_hidden_layers": job.get("draft_layers", 1),
                                           **job.get("architecture", {})}}


def _dflash(mtsp, base, job):
    return mtsp.convert(base, [("dflash", _dflash_config(job))])


def _dspark(mtsp, base, job):
    """DFlash's mode with ``projector_type="dspark"`` (``HFDSparkModel``): the Markov head, the optional
    confidence head and the three loss weights of the job."""
    cfg = _dflash_config(job)
    cfg["dflash_architecture_config"].update({
        "projector_type": "dspark", "markov_rank": int(job["markov_rank"]), "markov_head_type": "vanilla",
        "use_confidence_head": bool(job["confidence_head"])})
    cfg.update({"dflash_ce_loss_alpha": float(job["ce_weight"]), "dflash_l1_loss_alpha": float(job["tv_weight"]),
                "dflash_confidence_head_alpha": float(job["confidence_weight"]) if job["confidence_head"] else 0.0})
    return mtsp.convert(base, [("dflash", cfg)])


def _eagle(mtsp, base, job):
    theta = float(job.get("rope_theta", 10_000.0))
    arch = {"num_hidden_layers": 1, **job.get("architecture", {}),
            "eagle_aux_hidden_state_layer_ids": list(job["aux_layer_ids"]), "rope_theta": theta,
            "rope_scaling": {"rope_type": "default", "rope_theta": theta},
            "torch_dtype": job.get("precision", "bfloat16")}
    cfg = {"eagle_offline": True, "eagle_ttt_steps": int(job["ttt_steps"]),
           "eagle_loss_decay_factor": float(job["step_decay"]), "eagle_mix_hidden_states": False,
           "eagle_use_torch_compile": bool(job.get("compile", False)), "eagle_architecture_config": arch}
    return mtsp.convert(base, [("eagle", cfg)])


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    say = channel()  # ModelOpt prints its own notes: they go to the log
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job.get("seed", 0)))
    import modelopt
    import modelopt.torch.speculative as mtsp
    import transformers
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel

    mode = job.get("mode", "dflash")
    base = FakeBaseModel.from_source(job["base"])
    model = {"dflash": _dflash, "dspark": _dspark, "eagle": _eagle}[mode](mtsp, base, job)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, job)
    data = OfflineSupervisedDataset(job["files"], answer_only_loss=True)
    collate = EagleOfflineDataCollator(train_len=job["train_len"])
    batch = collate([data[i] for i in range(len(data))])
    held = None
    if job.get("heldout_files"):
        hdata = OfflineSupervisedDataset(job["heldout_files"], answer_only_loss=True)
        held = collate([hdata[i] for i in range(len(hdata))])

    seen = {}
    if mode in ("dflash", "dspark"):
        sample = model._sample_anchor_positions

        def record(seq_len, loss_mask, device):
            anchors, keep = sample(seq_len, loss_mask, device)
            if mode == "dspark":
                seen["rows"] = _dspark_rows(anchors, keep, loss_mask, seq_len, job["block_size"])
            else:
                seen["rows"] = _rows(model, anchors, keep, loss_mask, seq_len, job["block_size"])
            return anchors, keep

        model._sample_anchor_positions = record
        draft, layers = model.dflash_module, list(model.target_layer_ids)
    else:
        draft, layers = model.eagle_module, list(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    probe = dtype_probe({"head": [model._base_model_lm_head], "embedding": [model._base_model_embeddings],
                         "draft": [m for m in draft.modules() if isinstance(m, torch.nn.Linear)
                                   and m.weight.requires_grad]})
    say({"ready": True, "trainable_params": sum(p.numel() for p in params),
                      "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
                      "target_layer_ids": layers, "dtype": str(next(draft.parameters()).dtype),
                      "head_dtype": str(model._base_model_lm_head.weight.dtype),
                      "versions": {"modelopt": modelopt.__version__, "torch": torch.__version__,
                                   "transformers": transformers.__version__}})

    def forward(b=batch):
        res = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                    loss_mask=b["loss_mask"], base_model_outputs=b["base_model_outputs"])
        rows = _eagle_rows(b["loss_mask"], int(job["ttt_steps"])) if mode == "eagle" else seen.get("rows")
        return res.loss, {"rows": rows, "dtypes": probe()}

    keys = ("input_ids", "base_model_hidden_states", "aux_hidden_states", "loss_mask")
    serve(say, forward, opt, lambda: [{k: data[i][k].tolist() for k in keys} for i in range(len(data))],
          heldout=None if held is None else lambda: forward(held))

if __name__ == "__main__":
    main(sys.argv[1])
