"""The real targets built from PyPI packages, and a speech LLM taught to listen (see build.py, listen.py)."""
