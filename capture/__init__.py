"""Run a frozen speech LLM once and turn its hidden states into dataset rows (via shards/)."""
