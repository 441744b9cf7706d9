"""How fast a worker works: the rates that turn queued and requested work into seconds.

The routing rule prices each candidate by the time to first token it would give
(:mod:`router.routing.scheduler`). The prices come from a worker's :class:`Rates`, per token:

- ``prefill_s``: seconds to prefill one token, apart from attention over its context;
- ``context_s``: seconds one prefilled token adds per token of context before it (attention:
  a prompt of ``n`` new tokens after ``c`` cached ones costs ``context_s * n * (c + n / 2)``,
  which is most of a long prompt's prefill);
- ``decode_s``: seconds a token of a decoding request's context adds to the first token of a
  request queued behind it (the decode steps that share the prefill's iterations);
- ``onboard_s``: seconds to copy one cached token's K/V from the host tier back to the device;
- ``first_s``: the fixed part of a first token (one iteration), the same on every worker of a
  kind; it moves the prediction, never the choice.

Defaults per engine kind (:data:`DEFAULT_RATES`) come from the H200 timing the simulated
engine runs (``workers.engine.timing.H200_LLAMA_1B_MEASURED``): prefill 1.94 µs a token,
attention 0.443 ns a new x cached token pair, decode context 8.94 ns a token an iteration
(priced as two iterations: a queued prefill shares a few with the decodes), host-to-device
copies 32 KiB a token at 50 GB/s, and a first token's fixed 8 ms (one iteration). No engine
has a calibration of its own yet; every one starts from these and :class:`RateScale` learns
each worker's factor from its observed first tokens.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_RATES", "DYNAMO_RATES", "RateScale", "Rates", "parse_rates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rates:
    """Seconds per token of each kind of work (module docstring).

    Raises:
        ValueError: a rate is negative or not a number, or copying a token back from the host
            costs more than prefilling it (a host hit would then be priced above a miss).
    """

    prefill_s: float
    context_s: float = 0.0
    decode_s: float = 0.0
    onboard_s: float = 0.0
    first_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "context_s", "decode_s", "onboard_s", "first_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # NaN fails the comparison
                raise ValueError(f"rate {name} must be a finite number >= 0, got {value}")
        if self.onboard_s > self.prefill_s:
            raise ValueError("onboard_s must not exceed prefill_s (a host hit would cost "
                             "more than recomputing)")

    def per_block(self, block_size: int) -> Rates:
        """The same rates per block of ``block_size`` tokens (``context_s`` per block pair)."""
        b = float(block_size)
        return Rates(prefill_s=self.prefill_s * b, context_s=self.context_s * b * b,
                     decode_s=self.decode_s * b, onboard_s=self.onboard_s * b,
                     first_s=self.first_s)


_H200 = Rates(prefill_s=1.94e-6, context_s=4.43e-10, decode_s=2 * 8.94e-9,
              onboard_s=32768 / 50e9, first_s=0.008)

#: Rates per engine kind (``engine`` of a worker's configuration; module docstring).
DEFAULT_RATES: dict[str, Rates] = {"kvroute": _H200, "vllm": _H200, "sglang": _H200,
                                   "trtllm": _H200}

#: NVIDIA Dynamo's rule as rates per block: ``uncached + queued prefill blocks + decode
#: blocks``, a host block credited 0.75 (Dynamo's overlap weight 1). Not learned.
DYNAMO_RATES = Rates(prefill_s=1.0, decode_s=1.0, onboard_s=0.25)


def parse_rates(text: str) -> Rates:
    """Rates set by hand: ``prefill=S,context=S,decode=S,onboard=S,first=S`` (seconds per
    token; ``context`` per token pair); names left out are 0 except ``prefill``, required.

    Raises:
        ValueError: an unknown name, a malformed number, or no ``prefill``.
    """
    values: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, number = part.partition("=")
        name = name.strip()
        if not sep or name not in ("prefill", "context", "decode", "onboard", "first"):
            raise ValueError(f"rates: {part!r} is not NAME=SECONDS with NAME one of prefill, "
                             "context, decode, onboard, first")
        try:
            values[f"{name}_s"] = float(number)
        except ValueError:
            raise ValueError(f"rates: {number.strip()!r} is not a number") from None
    if "prefill_s" not in values:
        raise ValueError("rates: prefill=SECONDS_PER_TOKEN is required")
    return Rates(**values)


class RateScale:
    """One worker's factor on its rates, learned from the first tokens it delivers.

    Each first token gives a pair: the work the router predicted before it (seconds at the
    unscaled rates, less the fixed ``first_s``) and the seconds it took (less ``first_s``).
    The factor is the least-squares slope through the origin of delivered on predicted,
    over pairs weighted by ``decay`` per pair (so it follows a worker that slows down), and
    kept in ``[1 / limit, limit]``. Until ``warmup`` pairs are in it stays 1. A long
    prefill weighs more than a short one, as it should: the tail is where the wait is long.

    Args:
        decay: the weight kept of past pairs at each new one.
        warmup: pairs before the factor moves.
        limit: how far the factor may move from 1 either way.
    """

    __slots__ = ("_n", "_xx", "_xy", "decay", "factor", "limit", "warmup")

    def __init__(self, decay: float = 0.98, warmup: int = 8, limit: float = 100.0) -> None:
        if not 0 < decay <= 1 or warmup < 0 or not limit >= 1:
            raise ValueError("decay in (0, 1], warmup >= 0, limit >= 1")
        self.decay = decay
        self.warmup = warmup
        self.limit = limit
        self._xx = self._xy = 0.0
        self._n = 0
        #: The factor the worker's rates are multiplied by.
        self.factor = 1.0

    def observed(self, predicted_s: float, delivered_s: float) -> bool:
        """Fold in one first token: ``predicted_s`` of work at the unscaled rates, delivered
        after ``delivered_s``. Returns whether the factor changed."""
        if not (predicted_s > 0 and delivered_s >= 0 and math.isfinite(predicted_s)
                and math.isfinite(delivered_s)):
            return False
        d = self.decay
        self._xx = d * self._xx + predicted_s * predicted_s
        self._xy = d * self._xy + predicted_s * delivered_s
        self._n += 1
        if self._n < self.warmup or self._xx <= 0:
            return False
        factor = min(max(self._xy / self._xx, 1.0 / self.limit), self.limit)
        if factor == self.factor:
            return False
        self.factor = factor
        return True
