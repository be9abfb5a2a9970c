"""Fit speculative-decoding drafters (DFlash, DFlash2, MTP) from a dataset, never the live target.

Entry points (what ``cli.py`` and the demo call):
    run = train.config.load_run_config("dflash_demo", overrides=["max_steps=100"])
    summary = train.loop.train(run, dataset_path_or_InMemoryData, run_dir)
    result = train.evaluate.evaluate(run_dir, dataset_path)        # tau, alpha_k, eval.json + PNG
    info = train.export.export_run(run_dir, export_dir)            # draft-only safetensors + config.json
"""
