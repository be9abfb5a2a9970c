"""Drafter parts shared by several families (none of them names a family)."""
