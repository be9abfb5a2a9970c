"""DSpark: DFlash's backbone with next-token slots and a sequential low-rank Markov head (vLLM's Qwen3DSparkModel)."""
