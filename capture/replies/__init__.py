"""The target's own replies: decoding (generate), a window of conversations (windows), the regenerate command
(regenerate) and capture with states kept during generation (fused)."""
