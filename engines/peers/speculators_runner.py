"""Train vllm-project/speculators' DFlash, DSpark or EAGLE-3 draft step by step on CPU, INSIDE a venv that has
speculators 0.9.0 (the vLLM engine venv, engines/venv.sh vllm: engines/vllm.txt pins it).

    python speculators_runner.py JOB.json       # then one command a line on stdin, one JSON line back each

JOB: {"verifier": DIR (config.json + model.safetensors: embed_tokens, lm_head, final norm), "data": DIR (its offline
      format, benchmarks/peers.py ``to_speculators``: an Arrow dataset of input_ids / loss_mask / seq_len and
      ``hidden_states/hs_{i}.safetensors``), "max_len": T (the packed row: every sample's tokens), "loss": "ce" |
      "kl_div", "block_size": 16, "gamma": 7.0, "max_anchors": N (blocks per packed row), "mask_token_id": ID,
      "aux_layer_ids": [...] (vLLM ids: tapdraft's taps + 1), "draft_layers": 1, "attn": "sdpa", "lr", "betas",
      "weight_decay", "seed": 0, "threads": 1, "precision": "bfloat16" | "float32", "train_samples": N (the
      data's first N rows train; the rest are held out), "heldout_len": T' (their packed row), "draft": "dflash"
      (default) | "dspark" | "eagle3" (``DRAFTS``); for dspark also "markov_rank", "confidence_head",
      "confidence_weight" and a JSON "loss" of weighted terms; for eagle3 "ttt_steps", "step_decay" (its
      ``ttt_step_loss_decay``) and "loss": "kl_div", no block, gamma, anchors or mask token}
Commands: ``step`` -> {"s": SECONDS, "loss": L, "rows": R, "weight": W, "anchors": A} (forward + backward + AdamW
step over one packed batch of the training samples; L is its own loss, sum(w l) / R; W = sum of the slot weights
over the R rows, so L * R / W is the weighted mean tapdraft reports; A = blocks with a trained row; "dtypes":
{"head", "embedding", "draft"}, what each part computed in, from forward hooks); ``heldout`` -> the same loss and
counts on one packed batch of the held-out rows, no gradient; ``load`` -> {"samples": [{"input_ids", "hidden_states",
"verifier_last_hidden_states", "loss_mask"} as lists]} (what its ``ArrowDataset`` returns, for
the converter's test); ``exit`` -> {"peak_rss": BYTES} and exit. The first line out is {"ready": true,
"trainable_params", "versions", ...}.

Built as its training CLI builds a fresh draft (``speculators.train.cli.create_transformer_layer_config`` from the
verifier's config: qwen3 draft layer, the verifier's widths; ``DFlashDraftModel.from_training_args``, which loads
the frozen embedding, lm_head and final norm from the verifier directory), fed what its ``ArrowDataset`` and
``CollateFn`` make of the offline data (all samples packed into one [1, T] row with ``document_ids``), its loss
from ``DFlashDraftModel.get_trainer_kwargs`` (``loss_fn`` ce or kl_div, ``dflash_decay_gamma``, ``max_anchors``,
the static decay weighting ``fixed-exp-decay``), called as its Trainer calls the model: ``model(**batch, **kwargs)``.

Where it differs from its Trainer, and why: the Trainer hard-codes CUDA (``.to(local_rank)``, FSDP, bf16 autocast);
its default attention, ``simple_flex_attention``, builds its BlockMask on CPU (the compiled ``create_block_mask``
runs under torch 2.13) but torch's FlexAttention refuses a forward whose inputs need gradients on CPU
("FlexAttention does not support backward on CPU"). Its CLI's ``--draft-attn-impl sdpa`` (or ``eager``) is the CPU
path: the same mask_mod materialised by ``create_mask`` as a dense bool [Q, KV] mask (``create_float_mask`` for
eager), and transformers' SDPA (eager gives the same first loss, about 2x slower). Its fused Triton losses need a GPU: ``--loss-implementation eager`` (its
reference losses, the same formulas). fp32 throughout (its base model's dtype here; no autocast), no gradient
clipping (its Trainer clips at 1.0; tapdraft's side does not), plain AdamW with tapdraft's settings, no schedule.

Precision: its Trainer keeps fp32 parameters (``_load_verifier_weights`` in ``speculators/model.py`` copies the
verifier's tensors into the module's own fp32 parameters with ``load_state_dict``) and runs the forward under
``torch.autocast(self.device_type, dtype=self.config.hidden_states_dtype)``, bf16 by default
(``speculators/train/trainer.py``, ``TrainerConfig.hidden_states_dtype``). On a machine with no accelerator it sets
``device_type = "cuda"`` (the same file), an autocast that does nothing to CPU ops, but the Trainer cannot run there
anyway (``.to(local_rank)``): its default on real hardware is bf16 autocast. So ``precision: bfloat16`` runs the
forward under ``torch.autocast("cpu", torch.bfloat16)`` with fp32 trainable parameters, as its Trainer on GPU, and
stores the frozen embedding and both lm_heads (the draft's and the verifier's, the same weights) in bf16: the
checkpoint's own values (autocast casts the heads to bf16 for their matmuls anyway; the embedding rows reach the
draft as the same numbers), so the frozen parts match tapdraft's bf16 head, in memory too (its Trainer would hold
fp32 copies: 3 x 113 MB at this vocabulary rather than 3 x 57). ``float32``: everything fp32, no autocast (the control).

Its loss is normalised by the count of trained rows (``loss_function``: sum(w l) / sum(mask)), tapdraft's by the sum
of their weights: the step reports both. ``ce`` is its hard-label CE against the verifier's argmax on the slot's
teacher row (not the dataset's token); ``kl_div`` is KL(p || q) against the softmax of the same teacher row.

EAGLE-3 (``draft: eagle3``): ``Eagle3DraftModel.from_training_args`` as its CLI calls it for eagle3 (a llama draft
layer at the verifier's widths; embedding, lm_head, ``verifier_lm_head`` and ``verifier_norm`` frozen from the verifier
directory, the final norm trained), on its loader's shifted samples (``shift_batch``: the token after each row's
aux hidden, the teacher one row on), ``ttt_steps`` training-time-test steps, each step's KL(p || q) over its own
trained rows times ``step_decay ** j`` (its ``compute_metrics``, eager losses), summed. Its architecture switches are
set to the draft tapdraft trains and vLLM serves (``norm_before_residual``, ``norm_before_fc``, ``norm_output`` and
``fc_norm`` off; its CLI's eagle3 defaults turn the first three on), so both sides train one model. ``rows`` counts
the trained rows over all steps; no ``weight`` (its per-step normalisation is tapdraft's).

It imports only the peer venv's packages (torch, transformers, datasets, speculators): it is not part of tapdraft.
"""

import json
import sys

from peer_protocol import adamw, channel, dtype_probe, serve


def _blocks(job, torch, layer_cfg, cls, core, build, train, mask_at):
    """A DFlash-family draft (``cls``: its DFlash or DSpark model) as its CLI builds one, its trainer kwargs, no
    per-sample preprocess, and a recorder of the trained rows and their slot weights, patched over its ``core``'s
    ``compute_metrics`` (whose loss mask is argument ``mask_at``, the block size the next)."""
    from speculators.losses import dflash_loss_decay

    block = int(job["block_size"])
    model = cls.from_training_args(
        layer_cfg, draft_vocab_size=layer_cfg.vocab_size, block_size=block, target_layer_ids=list(job["aux_layer_ids"]),
        mask_token_id=int(job["mask_token_id"]), verifier_name_or_path=job["verifier"],
        draft_attn_impl=job.get("attn", "sdpa"), **build)
    kwargs, _ = cls.get_trainer_kwargs(
        loss_fn=job["loss"], loss_implementation="eager", dflash_decay_gamma=float(job["gamma"]),
        max_anchors=int(job["max_anchors"]), per_position_loss_weight="fixed-exp-decay", **train)
    from_anchor = bool(model.config.sample_from_anchor)
    seen = {}
    compute = core.compute_metrics

    def record(*args, **kw):
        """Its own metrics, plus the trained rows and their weights (as ``loss_function`` weighs them)."""
        loss_mask, block_size = args[mask_at], args[mask_at + 1]
        pos = (torch.arange(loss_mask.shape[1]) % block_size).unsqueeze(0).float()
        w = dflash_loss_decay(pos, gamma=kw["gamma"], sample_from_anchor=from_anchor) * loss_mask.float()
        seen.update(rows=int(loss_mask.sum()), weight=float(w.sum()),
                    anchors=int((loss_mask.reshape(-1, block_size).sum(1) > 0).sum()))
        return compute(*args, **kw)

    core.compute_metrics = record
    return model, kwargs, None, seen, [model.verifier_lm_head, model.lm_head]


def dflash(job, torch, layer_cfg):
    """Its DFlash draft (slot 0 the anchor, slots 1.. predicted)."""
    import speculators.models.dflash.core as core
    from speculators.models.dflash import DFlashDraftModel

    return _blocks(job, torch, layer_cfg, DFlashDraftModel, core, {}, {}, mask_at=2)


def dspark(job, torch, layer_cfg):
    """Its DSpark draft: DFlash's backbone predicting from the anchor on (its default ``sample_from_anchor``), the
    vanilla Markov head at ``markov_rank`` and the confidence head over [hidden ; markov_w1[prev]], its loss the
    job's weighted terms plus ``confidence_weight`` x the BCE against 1 - TV."""
    import speculators.models.dspark.core as core
    from speculators.models.dspark import DSparkDraftModel

    build = {"markov_rank": int(job["markov_rank"]), "markov_head_type": "vanilla",
             "enable_confidence_head": bool(job["confidence_head"]), "confidence_head_with_markov": True}
    return _blocks(job, torch, layer_cfg, DSparkDraftModel, core, build,
                   {"confidence_head_alpha": float(job["confidence_weight"])}, mask_at=3)


def eagle3(job, torch, layer_cfg):
    """Its EAGLE-3 draft with tapdraft's architecture (module docstring), its trainer kwargs, its per-sample shift
    (``shift_batch``, what its CLI's loader applies for eagle3) and a recorder of the trained rows over all steps."""
    import speculators.models.eagle3.core as core
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch

    model = Eagle3DraftModel.from_training_args(
        layer_cfg, draft_vocab_size=layer_cfg.vocab_size, norm_before_residual=False, norm_before_fc=False,
        fc_norm=False, norm_output=False, embed_requires_grad=False, ttt_steps=int(job["ttt_steps"]),
        target_layer_ids=list(job["aux_layer_ids"]), verifier_name_or_path=job["verifier"],
        draft_attn_impl=job.get("attn", "sdpa"))
    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=job["loss"], loss_implementation="eager", ttt_steps=int(job["ttt_steps"]),
        ttt_step_loss_decay=float(job["step_decay"]))
    seen = {}
    compute = core.compute_metrics

    def record(logits, targets, loss_mask, prev_correct, ttt_step, *a, **kw):
        """Its own metrics, plus the rows each step trains (its ``align_for_step`` keeps ``loss_mask[:, j:]``)."""
        seen["rows"] = (0 if ttt_step == 0 else seen["rows"]) + int(loss_mask[:, ttt_step:].sum())
        return compute(logits, targets, loss_mask, prev_correct, ttt_step, *a, **kw)

    core.compute_metrics = record
    return model, kwargs, shift_batch, seen, [model.verifier_lm_head, model.lm_head]


DRAFTS = {"dflash": (dflash, "qwen3"), "dspark": (dspark, "qwen3"), "eagle3": (eagle3, "llama")}
"""speculators' draft types this runner trains (its ``speculator_type`` names) -> the builder and the draft layer
its CLI picks for the type (``TrainConfig``: llama for eagle3, qwen3 otherwise)."""


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    say = channel()  # library notes go to the log
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job.get("seed", 0)))
    from importlib.metadata import version

    import transformers
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import ArrowDataset, CollateFn

    build, arch = DRAFTS[job.get("draft", "dflash")]
    layers = int(job.get("draft_layers", 1))
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=job["verifier"], num_layers=layers, draft_arch=arch, hidden_act=None,
        sliding_window=None, full_attention_indices=list(range(layers)))
    model, train_kwargs, preprocess, seen, heads = build(job, torch, layer_cfg)
    model.float().train()
    bf16 = job.get("precision", "bfloat16") == "bfloat16"
    if bf16:  # the frozen parts as the checkpoint holds them; the trainable ones stay fp32 under autocast
        for frozen in (model.embed_tokens, *heads):
            frozen.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, job)
    data = ArrowDataset(max_len=int(job["max_len"]), datapath=job["data"], on_missing="raise",
                        hidden_states_dtype=torch.float32)
    n_aux = len(job["aux_layer_ids"])
    n_train = int(job.get("train_samples", len(data)))

    def packed(lo, hi, max_len):
        c = CollateFn(max_len=max_len, hidden_size=layer_cfg.hidden_size, num_target_layers=n_aux, dtype=torch.float32,
                      preprocess=preprocess)
        return {k: v for k, v in c([data[i] for i in range(lo, hi)]).items() if isinstance(v, torch.Tensor)}

    batch = packed(0, n_train, int(job["max_len"]))
    held = packed(n_train, len(data), int(job["heldout_len"])) if n_train < len(data) else None
    probe = dtype_probe({"head": heads, "embedding": [model.embed_tokens],
                         "draft": [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                                   and m.weight.requires_grad]})
    say({"ready": True, "trainable_params": sum(p.numel() for p in params),
         "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
         "target_layer_ids": list(model.target_layer_ids), "dtype": str(model.fc.weight.dtype),
         "head_dtype": str(model.verifier_lm_head.weight.dtype), "attn": model._attn_impl,
         "tokens": int((batch["document_ids"] >= 0).sum()),
         "versions": {"speculators": version("speculators"), "torch": torch.__version__,
                      "transformers": transformers.__version__}})

    def forward(b=batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss, _ = model(**b, **train_kwargs)
        return loss, {**seen, "dtypes": probe()}

    keys = ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask")
    serve(say, forward, opt, lambda: [{k: data[i][k].float().tolist() if "hidden" in k else data[i][k].tolist()
                                       for k in keys} for i in range(n_train)],
          heldout=None if held is None else lambda: forward(held))


if __name__ == "__main__":
    main(sys.argv[1])
