"""Argument types for the command lines (``kvroute`` and the benchmarks): clear refusals."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value
