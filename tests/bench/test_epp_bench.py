"""bench.epp's in-process part runs the EPP's real exchange and leaves nothing booked."""

from __future__ import annotations

import math

from bench.epp import exchange_cpu_us


def test_the_exchange_figure_is_measured_on_the_real_exchange() -> None:
    figure = exchange_cpu_us(requests=20)
    assert math.isfinite(figure) and figure > 0
