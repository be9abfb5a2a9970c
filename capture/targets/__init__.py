"""Frozen targets: the interface (base), one module or folder per family, and the loader that picks one (load)."""
