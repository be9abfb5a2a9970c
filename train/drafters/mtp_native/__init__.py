"""A target's own MTP module fine-tuned in place (Qwen3.5), exported as a copy of the target."""
