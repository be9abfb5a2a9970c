"""Run a frozen speech LLM once and turn its hidden states into dataset rows (via shards/).

Modules, lowest first: inputs, salm, hooks (decoder-layer taps), targets (the Target interface,
run_batch), hf_native, load (load_target picks an adapter), config, pipeline.
"""
