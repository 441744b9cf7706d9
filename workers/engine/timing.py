"""How long the simulated engine takes: a cost model fitted to GPU measurements.

The simulated engine does no arithmetic; it sleeps for what a real forward pass would take, so
that routing decisions show their real effect (a cached prefix makes prefill cheap). The model,
in milliseconds, for one continuous-batching iteration (one forward pass):

    prefill part, per sequence:  b*new + c*new**2 + d*new*cached + e*cached
    decode part, per sequence:   f + g*context
    iteration = base + the parts of every sequence in it

``new`` is the tokens prefilled this iteration (a chunk, under chunked prefill), ``cached`` the
tokens already in the KV cache before them (a cached prefix, or earlier chunks), ``context``
a decoding sequence's length. ``base`` is a forward pass's fixed cost: ``prefill_base_ms`` if
the iteration only prefills, ``decode_base_ms`` if it only decodes, the larger of the two if
it mixes (one pass pays one overhead). The ``d`` term is attention over the cached prefix; the
``e`` and ``g`` terms are reading cached KV.

The coefficients are fitted (:func:`fit_timing`) to ``bench/data/h200_llama1b_random.json``
(a 1.1B Llama-shaped model on one H200) by least squares on relative error, so every point
weighs alike whatever its size, with every coefficient kept non-negative (a negative one is
dropped and the rest refitted: a cost never falls as work grows). The fitted values are
embedded as :data:`H200_LLAMA_1B`, so the model needs no file at run time. The calibration
read cached K/V through kernels a serving engine does not use (concatenated every decode step,
masked non-flash attention for a cached prefix), so :data:`H200_LLAMA_1B_PAGED` replaces ``g``
and :data:`H200_LLAMA_1B_MEASURED` (the default, :data:`DEFAULT_TIMING`) also ``e`` and ``d``
with what the H200 measured kernels that read K/V in place to cost (``docs/gpu.md``).

Fit quality (prediction error against each measurement, in %):

    prefill, no cache (new = 128 ... 16384):  -3  +31  +18  -3  -13  -8  +12
    prefill over a cached prefix      cached 1024:  -22  -43  -19
      (new = 64, 512, 2048):          cached 4096:  -41  +19  -14
                                      cached 8192:   -4  +26  -11
    decode (batch = 1, 8, 32, 64):    ctx 1024:  +2  -22  +9  +17
                                      ctx 4096:  -1   +2  -5  -13

Every decode point and 12 of the 16 prefill points are within 25%; the root-mean-square error
is 21% over the prefill points and 11% over the decode points. The four misses sit where the
measurements contradict each other, which no cost that grows with work can follow: 512 fresh
tokens (3.3 ms) took less than 128 (3.6 ms); 512 new tokens took 8.4 ms over 1024 cached but
5.3 ms over 4096 and 6.6 ms over 8192; 64 new tokens took 7.5 ms over 4096 cached but 5.7 ms
over 8192. That is noise or warm-up in the measurements; a model bent through those points
would be worse everywhere else. The figures routing depends on hold: 8192 fresh tokens
predict 38.1 ms (measured 41.2), 64 new over 8192 cached 5.5 ms (measured 5.7). The decode
fit gave a negative per-sequence cost, so that term is 0 and a decode step costs its base
plus its context.

Host-to-device onboarding of offloaded blocks is bandwidth-bound: bytes = blocks * block_size
* ``kv_bytes_per_token`` (32 KiB for this model: 16 layers * K and V * 8 KV heads * 64 head
dims * 2 bytes), at ``host_to_device_gb_per_s`` (50 GB/s, PCIe 5 / C2C-class pinned copies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TIMING", "H200_LLAMA_1B", "H200_LLAMA_1B_MEASURED", "H200_LLAMA_1B_PAGED",
           "TIMING_MODELS", "TimingModel",
           "fit_timing", "fit_timing_points", "kv_bytes_per_token"]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Return the KV cache bytes one token takes: K and V, for every layer and KV head."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Milliseconds per iteration of a continuous-batching engine (formula in the module doc).

    Notes:
        1. All coefficients are non-negative, so every cost grows with the work.
        2. An empty iteration costs nothing.
    """

    prefill_base_ms: float
    prefill_per_token_ms: float
    prefill_per_token_sq_ms: float
    prefill_per_token_cached_ms: float
    prefill_per_cached_ms: float
    decode_base_ms: float
    decode_per_seq_ms: float
    decode_per_context_ms: float
    kv_bytes_per_token: int = kv_bytes_per_token(16, 8, 64)
    host_to_device_gb_per_s: float = 50.0

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Return the time of an iteration that only prefills ``new_tokens`` of one sequence.

        Raises:
            ValueError: a count is negative.
        """
        return self.iteration_ms([(new_tokens, cached_tokens)], [])

    def decode_ms(self, contexts: list[int]) -> float:
        """Return the time of an iteration that only decodes one token per sequence.

        Raises:
            ValueError: a context length is negative.
        """
        return self.iteration_ms([], contexts)

    def iteration_ms(self, prefill: list[tuple[int, int]], decode: list[int]) -> float:
        """Return the time of one forward pass mixing prefill chunks and decode steps.

        Args:
            prefill: ``(new_tokens, cached_tokens)`` for each sequence prefilling this pass.
            decode: the context length of each sequence decoding one token this pass.

        Returns:
            Milliseconds; 0.0 when both lists are empty.

        Raises:
            ValueError: a count is negative.
        """
        total = 0.0
        for new, cached in prefill:
            if new < 0 or cached < 0:
                raise ValueError(f"prefill counts must be non-negative, got ({new}, {cached})")
            total += (
                self.prefill_per_token_ms * new
                + self.prefill_per_token_sq_ms * new * new
                + self.prefill_per_token_cached_ms * new * cached
                + self.prefill_per_cached_ms * cached
            )
        for context in decode:
            if context < 0:
                raise ValueError(f"decode context must be non-negative, got {context}")
            total += self.decode_per_seq_ms + self.decode_per_context_ms * context
        if prefill and decode:
            total += max(self.prefill_base_ms, self.decode_base_ms)
        elif prefill:
            total += self.prefill_base_ms
        elif decode:
            total += self.decode_base_ms
        return total

    def onboard_ms(self, blocks: int, block_size: int) -> float:
        """Return the time to copy ``blocks`` offloaded blocks from host memory to the device.

        Raises:
            ValueError: a count is negative or ``block_size`` is below 1.
        """
        if blocks < 0 or block_size < 1:
            raise ValueError(f"need blocks >= 0 and block_size >= 1, got {blocks}, {block_size}")
        nbytes = blocks * block_size * self.kv_bytes_per_token
        return nbytes / (self.host_to_device_gb_per_s * 1e9) * 1e3


#: Fitted to ``bench/data/h200_llama1b_random.json`` by :func:`fit_timing`.
H200_LLAMA_1B = TimingModel(
    prefill_base_ms=3.218364991338901,
    prefill_per_token_ms=0.0019411825946605587,
    prefill_per_token_sq_ms=2.826048418144606e-07,
    prefill_per_token_cached_ms=4.889590017561399e-07,
    prefill_per_cached_ms=0.00023747027068513803,
    decode_base_ms=5.193329921259981,
    decode_per_seq_ms=0.0,  # fitted negative, so dropped (module docstring)
    decode_per_context_ms=8.028789094953694e-05,
)


#: :data:`H200_LLAMA_1B` with decode attention priced as a kernel that reads paged K/V in place
#: prices it: 8.94e-6 ms (8.94 ns) per token of context, all 16 layers, where the calibration
#: gives 80.3 ns. The calibration's decode steps concatenated each sequence's K/V anew every
#: step (its README calls its decode figures upper bounds); ``python -m bench.gpu --sections
#: decode_context`` on the H200 measured flash attention over K/V already in place at 8.9 ns a
#: token (batch 8-256, contexts 4-8k: 3.4-3.6 TB/s of the 4.8 HBM peak), a paged kernel (flex
#: attention over 32-token pages) at 7.3 plus ~2 ms a step at small batches, and the torch
#: engine's own gather-then-attend at 31.2-31.8 (``docs/gpu.md``). Every other coefficient is
#: the calibration's.
H200_LLAMA_1B_PAGED = replace(H200_LLAMA_1B, decode_per_context_ms=8.94e-6)

#: :data:`H200_LLAMA_1B_PAGED` with prefill over a cached prefix priced as flash attention over
#: K/V in place prices it too. ``python -m bench.gpu --sections prefill_context`` on the H200
#: (all 16 layers, 64-2,048 new tokens over 2k-32k cached, ``docs/gpu.md``) measured the time
#: a cache adds at 4.43e-7 ms a new x cached token pair, against the calibration's 4.89e-7,
#: and no cost a cached token on its own above the noise (fitted -9.5e-6 ms), against the
#: calibration's 2.37e-4 (1.9 ms for 8k cached tokens; its cached prefills ran a masked
#: attention that was not flash). Here a cached token costs 8.94e-6 ms, one read of its K/V,
#: as a token of decode context does. The default (:data:`DEFAULT_TIMING`).
H200_LLAMA_1B_MEASURED = replace(H200_LLAMA_1B_PAGED, prefill_per_token_cached_ms=4.43e-7,
                                 prefill_per_cached_ms=8.94e-6)

#: Timing models by name, for ``--timing`` flags.
TIMING_MODELS: dict[str, TimingModel] = {"calibrated": H200_LLAMA_1B,
                                         "paged": H200_LLAMA_1B_PAGED,
                                         "measured": H200_LLAMA_1B_MEASURED}

#: The simulated engine's default: ``measured``, because the engines a router fronts (vLLM,
#: TensorRT-LLM, SGLang) attend over cached K/V with paged or flash kernels, which the H200
#: measured at 9x less a token of decode context than the calibration's concatenating decode
#: and at about 1/25 of its price for a cached token of a prefill. ``paged`` (decode priced as
#: measured, cached prefill as calibrated) and ``calibrated`` (the fit as is) stay selectable
#: and reproduce the figures measured with them.
DEFAULT_TIMING = "measured"


def fit_timing(path: str | Path) -> TimingModel:
    """Fit a timing model to a calibration file (``bench/data/h200_llama1b_random.json``'s format).

    Args:
        path: the calibration JSON.

    Returns:
        The fitted model, with default onboarding parameters.

    Raises:
        ValueError: the file is missing, unreadable or not in the calibration format.
    """
    try:
        calibration = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read calibration file {path}: {e}") from e
    return fit_timing_points(calibration)


def fit_timing_points(calibration: Any) -> TimingModel:
    """Fit a timing model to calibration measurements already read.

    Args:
        calibration: ``{"prefill": [{"new", "ms"}...], "prefill_cached": [{"cached", "new",
            "ms"}...], "decode": [{"batch", "ctx", "ms"}...]}``; ``prefill_cached`` may be
            empty, the other two need at least as many points as coefficients.

    Returns:
        The fitted model, with default onboarding parameters.

    Raises:
        ValueError: the measurements are missing, malformed or too few.
    """
    try:
        prefill = [(p["new"], 0, p["ms"]) for p in calibration["prefill"]]
        prefill += [(p["new"], p["cached"], p["ms"]) for p in calibration.get("prefill_cached", [])]
        decode = [(p["batch"], p["ctx"], p["ms"]) for p in calibration["decode"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"calibration data is malformed: missing or wrong field {exc}") from exc
    a, b, c, d, e = _fit_nonnegative(
        [[1.0, n, n * n, n * k, k] for n, k, _ in prefill], [ms for *_, ms in prefill], "prefill"
    )
    base, per_seq, per_ctx = _fit_nonnegative(
        [[1.0, batch, batch * ctx] for batch, ctx, _ in decode], [ms for *_, ms in decode], "decode"
    )
    return TimingModel(
        prefill_base_ms=a,
        prefill_per_token_ms=b,
        prefill_per_token_sq_ms=c,
        prefill_per_token_cached_ms=d,
        prefill_per_cached_ms=e,
        decode_base_ms=base,
        decode_per_seq_ms=per_seq,
        decode_per_context_ms=per_ctx,
    )


def _fit_nonnegative(rows: list[list[float]], ms: list[float], what: str) -> list[float]:
    """Least squares on relative error, dropping negative coefficients until none is left."""
    import numpy as np  # only fitting needs it: settings read TIMING_MODELS at start-up

    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    if len(y) < x.shape[1] or np.any(y <= 0):
        raise ValueError(f"calibration needs {x.shape[1]} or more positive {what} timings")
    # Dividing each row by its measurement turns absolute error into relative error.
    xw = x / y[:, None]
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], np.ones_like(y), rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return [float(v) for v in coef]
