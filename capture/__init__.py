"""Run a frozen speech LLM once and turn its hidden states into dataset rows (via shards/).

The run's modules sit here; the target families in targets/, the target's own replies in replies/, the
vLLM engine in vllm/ (docs/layout.md).
"""
