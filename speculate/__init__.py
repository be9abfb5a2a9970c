"""Speculative decoding with the live target: checks the offline acceptance estimate against the truth."""
