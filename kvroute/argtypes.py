"""Argument types for the command lines (``kvroute`` and the benchmarks): clear refusals."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "port_range", "positive_float", "positive_int", "seed_list"]


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


def seed_list(text: str) -> list[int]:
    """Seeds as ``A-B`` (inclusive), ``A,B,C``, or a mix (``0-4,9``): ints >= 0, no repeats."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected seeds like 0-9 or 0,3,5, got {text!r}") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad seed range {part!r} in {text!r}")
        seeds.extend(range(first, last + 1))
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed is named twice in {text!r}")
    return seeds


def port_range(text: str) -> range:
    """Ports as ``LOW-HIGH`` (inclusive), within 1..65535."""
    low, dash, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give ports as LOW-HIGH, got {text!r}") from None
    if not dash or not 0 < first <= last < 65536:
        raise argparse.ArgumentTypeError(f"give ports as LOW-HIGH within 1-65535, got {text!r}")
    return range(first, last + 1)
