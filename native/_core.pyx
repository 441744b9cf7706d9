# cython: language_level=3
"""Placeholder compiled core: replaced by the index core."""

def core_version() -> int:
    return 1
