"""Fit speculative-decoding drafters (DFlash, DFlash2, DSpark, LiLiCorr, EAGLE-3, MTP) from a dataset, not the target.

Entry points (what ``cli.py`` and the demo call):
    run = train.config.load_run_config("dflash_demo", overrides=["max_steps=100"])
    summary = train.loop.train(run, dataset_path, run_dir)
    result = train.evaluate.evaluate(run_dir, dataset_path)        # tau, alpha_k, eval.json + PNG
    info = train.export.export_run(run_dir, export_dir)            # draft-only safetensors + config.json

The run (flat here): config.py (TrainConfig, RunConfig, recipes and overrides), loop.py, data.py (the batch
pipeline over the shards reader), source.py (a run's dataset), run.py (a run on disk), checkpoints.py, curves.py,
evaluate.py (offline acceptance), export.py (serving export), acceptance.py (counts, rounds, acc@k / alpha@k,
tau), recipes/.

The drafters: ``train/drafters/`` (see its ``__init__``), one folder per family, shared parts in
``drafters/common/``, the protocol and the family registry in ``drafters/base.py``.
"""
