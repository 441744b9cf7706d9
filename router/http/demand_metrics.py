"""The autoscaling signal on ``/metrics``: uncached prompt tokens routed per second against the
fleet's prefill capacity (:mod:`router.routing.demand`).

Each decided request (:meth:`router.http.metrics.RouterMetrics.decided`) adds the prompt
tokens its chosen worker does not hold (the prompt's tokens less the matched blocks'; under
``--tokenize match`` the unmatched rest is the estimate from its bytes) and the ones it does.
At scrape time the capacity is read from the routing core's rates for each healthy candidate
(per block, with its learned factor: :meth:`router.routing.core.RoutingCore.rates`), turned
per token. Three gauges:

- ``kvroute_uncached_prompt_tokens_per_second``: the demand;
- ``kvroute_prefill_capacity_tokens_per_second``: what the healthy workers prefill a second
  at the traffic's mean context;
- ``kvroute_prefill_demand_ratio``: the first over the second, the share of the fleet's
  prefill time this router's traffic needs (router replicas' ratios add up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric

from router.routing.demand import PrefillDemand
from router.routing.rates import Rates

if TYPE_CHECKING:
    from router.service import Route, RouterService

__all__ = ["DemandCollector"]


class DemandCollector:
    """Counts the routed prefill demand and exports it with the capacity (module docstring).

    Args:
        service: the router's service (its settings, core and registry).
        clock: monotonic seconds.
    """

    def __init__(self, service: RouterService, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._service = service
        self._clock = clock
        self._block = service.settings.block_size
        self.demand = PrefillDemand(service.settings.demand_window, clock())

    def routed(self, route: Route) -> None:
        """Count ``route``'s prefill on the worker it was sent to."""
        cached = route.decision.chosen.matched_blocks * self._block
        total = route.prompt.total_tokens
        self.demand.routed(max(total - cached, 0), min(cached, total), self._clock())

    def _rates(self) -> list[Rates]:
        core, block = self._service.core, float(self._block)
        out = []
        for entry in self._service.candidates():
            r = core.rates(entry.id)  # per block
            out.append(Rates(prefill_s=r.prefill_s / block, context_s=r.context_s / block**2))
        return out

    def collect(self) -> Iterator[Metric]:
        """Yield the three gauges, read now."""
        now = self._clock()
        rates = self._rates()
        demand = self.demand.tokens_per_second(now)
        capacity = self.demand.capacity(rates, now)
        yield GaugeMetricFamily("kvroute_uncached_prompt_tokens_per_second",
                                "Prompt tokens routed per second that their worker did not "
                                "hold (decaying over --demand-window)", value=demand)
        yield GaugeMetricFamily("kvroute_prefill_capacity_tokens_per_second",
                                "Tokens per second the healthy workers prefill, by their "
                                "learned rates at the traffic's mean context", value=capacity)
        yield GaugeMetricFamily("kvroute_prefill_demand_ratio",
                                "Uncached prompt tokens per second over the prefill capacity: "
                                "the share of the fleet's prefill time the traffic needs",
                                value=demand / capacity if capacity > 0 else 0.0)
