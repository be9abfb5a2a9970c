"""Train NVIDIA Model-Optimizer's offline DFlash step by step: run INSIDE its venv (engines/venv.sh modelopt).

    python modelopt_runner.py JOB.json          # then one command a line on stdin, one JSON line back each

JOB: {"base": DIR (config.json + model.safetensors: embed_tokens, lm_head, final norm), "files": [PT, ...]
      (ModelOpt's offline samples, benchmarks/peers.py ``to_modelopt``), "block_size": 16, "num_anchors": 32,
      "gamma": 7.0, "mask_token_id": ID, "draft_layers": 1, "train_len": T, "lr", "betas", "weight_decay",
      "seed": 0, "threads": 1, "compile": false, "self_distillation": false,
      "architecture": {"intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"}}
Commands: ``step`` -> {"s": SECONDS, "loss": L, "rows": R} (forward + backward + AdamW step over one batch of
every file); ``load`` -> {"samples": [{"input_ids", "base_model_hidden_states", "aux_hidden_states",
"loss_mask"} as lists]} (what ModelOpt's own dataset class reads, for the converter's test); ``exit`` ->
{"peak_rss": BYTES} and exit. The first line out is {"ready": true, "trainable_params", "versions", ...}.

The model is built as ModelOpt's offline recipe builds it: ``FakeBaseModel.from_source`` (the frozen
embedding, lm_head and final norm, no decoder layers) converted with ``mtsp.convert(model, [("dflash", cfg)])``;
the batch comes from its ``OfflineSupervisedDataset(answer_only_loss=True)`` and ``EagleOfflineDataCollator``.
Loss weighting is the paper's static decay (``dflash_loss_objective="decay"``), tapdraft's default; ModelOpt's
own default D-PACE weighting is another loss. The draft layer's widths are passed explicitly: ModelOpt builds
its draft config as a ``Qwen3Config`` whose class defaults (MLP 22,016, 32 heads) win over the base model's
widths, so left alone a "1-layer" draft at hidden 576 has 47.8M trainable parameters instead of 3.9M. It imports only the peer venv's packages (torch, transformers,
modelopt): it is not part of tapdraft's package.
"""

import json
import resource
import sys
import time


def _rows(model, anchors, keep, loss_mask, seq_len, block):
    """Loss rows of a step as ModelOpt's ``_compute_loss`` weighs them (kept block, in range, slot > 0,
    supervised label)."""
    import torch

    idx = anchors.unsqueeze(-1) + torch.arange(block).view(1, 1, -1)
    ok = keep.unsqueeze(-1) & (idx < seq_len) & (torch.arange(block).view(1, 1, -1) > 0)
    sup = torch.gather(loss_mask.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, idx.clamp(max=seq_len - 1))
    return int((ok & (sup > 0.5)).sum())


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job.get("seed", 0)))
    import modelopt
    import modelopt.torch.speculative as mtsp
    import transformers
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel

    base = FakeBaseModel.from_source(job["base"])
    cfg = {"dflash_offline": True, "dflash_block_size": job["block_size"], "dflash_num_anchors": job["num_anchors"],
           "dflash_loss_objective": "decay", "dflash_loss_decay_factor": job["gamma"],
           "dflash_mask_token_id": job["mask_token_id"],
           "dflash_self_logit_distillation": bool(job.get("self_distillation", False)),
           "dflash_use_torch_compile": bool(job.get("compile", False)),
           "dflash_architecture_config": {"num_hidden_layers": job.get("draft_layers", 1),
                                          **job.get("architecture", {})}}
    model = mtsp.convert(base, [("dflash", cfg)])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": job["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=job["lr"], betas=tuple(job["betas"]))
    data = OfflineSupervisedDataset(job["files"], answer_only_loss=True)
    collate = EagleOfflineDataCollator(train_len=job["train_len"])
    batch = collate([data[i] for i in range(len(data))])

    seen = {}
    sample = model._sample_anchor_positions

    def record(seq_len, loss_mask, device):
        anchors, keep = sample(seq_len, loss_mask, device)
        seen["rows"] = _rows(model, anchors, keep, loss_mask, seq_len, job["block_size"])
        return anchors, keep

    model._sample_anchor_positions = record
    print(json.dumps({"ready": True, "trainable_params": sum(p.numel() for p in params),
                      "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
                      "target_layer_ids": list(model.target_layer_ids),
                      "dtype": str(next(model.dflash_module.parameters()).dtype),
                      "versions": {"modelopt": modelopt.__version__, "torch": torch.__version__,
                                   "transformers": transformers.__version__}}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"], loss_mask=batch["loss_mask"],
                        base_model_outputs=batch["base_model_outputs"])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s = time.perf_counter() - t0
            print(json.dumps({"s": s, "loss": float(out.loss.detach()), "rows": seen.get("rows")}), flush=True)
        elif cmd == "load":
            keys = ("input_ids", "base_model_hidden_states", "aux_hidden_states", "loss_mask")
            print(json.dumps({"samples": [{k: data[i][k].tolist() for k in keys} for i in range(len(data))]}),
                  flush=True)
        elif cmd == "exit":
            break
        else:
            print(json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
