"""``capture --engine vllm``: tapdraft's half (engine) and what runs inside vLLM's own venv (side)."""
