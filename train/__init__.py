"""Fit speculative-decoding drafters (DFlash, DFlash2, MTP, EAGLE-3) from a dataset, never the live target.

Entry points (what ``cli.py`` and the demo call):
    run = train.config.load_run_config("dflash_demo", overrides=["max_steps=100"])
    summary = train.loop.train(run, dataset_path, run_dir)
    result = train.evaluate.evaluate(run_dir, dataset_path)        # tau, alpha_k, eval.json + PNG
    info = train.export.export_run(run_dir, export_dir)            # draft-only safetensors + config.json

Homes (each job is written once):
    config.py      TrainConfig, RunConfig, recipes (``base:`` chains) and overrides
    drafter.py     the Drafter protocol (forward, acceptance, propose, export_config), family registry,
                   the loss-normalisation rule
    dflash.py, dflash2.py, mtp.py, eagle3.py   one file per family (model, eval, export; CONFIG and DRAFTER)
    dflash_config.py, dflash_loss.py   DFlash's settings; its training loss and draft vocabulary (a mixin)
    mtp_heads.py, mtp_targets.py, mtp_loss.py   MTP's head modules, per-depth alignment, training loss
    eagle3.py, eagle3_loss.py   EAGLE-3 (vLLM's layout: fc, midlayer, norm, lm_head, d2t) and its training loss
    mtp_layouts.py MTP export layouts;  anchors.py  block anchors (DFlash, DFlash2)
    run.py         a run on disk: data source, checkpoints, build_drafter, load_trained
    acceptance.py  acceptance bookkeeping: counts, replayed rounds, the acc@k / alpha@k metrics, tau
    teacher.py     teacher rows (exact through ``shards.head``, or stored top-k)
    divergences.py KL / TV (values, and analytic gradients for the fused loss) and the LK loss
    losses.py      the fused chunked lm_head + CE (+ KD) over gathered rows
    chunks.py      row chunking with activation checkpoints (spans from ``shards.head.row_spans``)
    loop.py        the training loop;  evaluate.py  offline acceptance;  export.py  serving export
    data.py        the batch pipeline over the shards reader;  layers.py, mask.py, selector.py  model parts
The teacher head (final norm -> lm_head -> logit scaling) lives in ``shards.head`` because capture,
train and speculate all apply it.
"""
