"""The rule's two invariants (``router.routing.scheduler``'s docstring), property-tested for the
specification (:func:`router.routing.scheduler.choose`, its prices) and the fast twin
(:func:`router.routing.load_groups.choose_fast`, through the core) alike:

1. of two idle workers with the same rates, one holding more of the prompt, and no less of it
   on the device, is never priced above the other (so never chosen over it unless they tie);
2. a worker whose queued wait exceeds the time to recompute the whole prompt on an idle worker
   is never chosen over that idle one, with or without a TTFT objective;
3. with a TTFT objective, in a busy fleet, the choice is within it whenever some candidate
   is, and has the least prefill of those within it; with none within it, the choice is the
   rule's without an objective.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.routing.core import CoreSettings, RoutingCore
from router.routing.load import ReportedLoad
from router.routing.load_groups import choose_fast
from router.routing.rates import Rates
from router.routing.scheduler import choose, prefill_seconds, price


@st.composite
def rates(draw: st.DrawFn) -> Rates:
    prefill = draw(st.floats(1e-7, 1e-4))
    return Rates(prefill_s=prefill, context_s=draw(st.floats(0.0, 1e-8)),
                 decode_s=draw(st.floats(0.0, 1e-6)),
                 onboard_s=draw(st.floats(0.0, 1.0)) * prefill,
                 first_s=draw(st.floats(0.0, 0.05)))


def _core(r: Rates, workers: int, slo: float | None = None) -> RoutingCore:
    core = RoutingCore(CoreSettings(rates=r, ttft_slo=slo))
    for w in range(workers):
        core.worker_joined(w)
    return core


def _busy(core: RoutingCore, worker: int, prefill_blocks: float, decode_blocks: float) -> None:
    """Load on ``worker`` another router sent (its report: one request we did not route)."""
    core.load_reported(worker, ReportedLoad(running=1, pending_prefill_blocks=prefill_blocks,
                                            decode_blocks=decode_blocks))


def _both_choices(core: RoutingCore, hashes: list[int], matches: dict[int, tuple[int, int]],
                  seed: int) -> tuple[dict[int, float], int, int]:
    """Every worker's price (the spec's), the spec's choice and the fast twin's."""
    workers = range(core.workers())
    slo = core.settings.ttft_slo
    candidates = core.candidates(workers, hashes, matches, 0.0)
    prices = {c.worker: c.cost for c in price(len(hashes), candidates, slo).costs}
    spec = choose(len(hashes), candidates, random.Random(seed), slo).worker
    passed_on = core.passed_on()
    fast = choose_fast(len(hashes), core._holders(hashes, matches, 0.0, passed_on),
                       core._groups, random.Random(seed), passed_on, slo).worker
    return prices, spec, fast


@settings(max_examples=200, deadline=None)
@given(r=rates(), blocks=st.integers(0, 400), data=st.data(),
       others=st.lists(st.tuples(st.floats(0, 5000), st.floats(0, 5000), st.integers(0, 400)),
                       max_size=6),
       seed=st.integers(0, 2**32))
def test_an_idle_worker_holding_more_is_never_priced_above_one_holding_less(
        r: Rates, blocks: int, data: st.DataObject,
        others: list[tuple[float, float, int]], seed: int) -> None:
    more = data.draw(st.integers(0, blocks))
    less = data.draw(st.integers(0, more))
    less_device = data.draw(st.integers(0, less))
    more_device = data.draw(st.integers(less_device, more))
    core = _core(r, 2 + len(others))
    hashes = list(range(1, blocks + 1))
    matches = {0: (more, more_device), 1: (less, less_device)}
    for i, (queued, decoding, held) in enumerate(others, start=2):
        _busy(core, i, queued, decoding)
        matches[i] = (min(held, blocks), 0)
    matches = {w: m for w, m in matches.items() if m[0]}
    prices, spec, fast = _both_choices(core, hashes, matches, seed)
    assert prices[0] <= prices[1]
    for chosen in (spec, fast):
        assert chosen != 1 or prices[1] == prices[0]


@settings(max_examples=200, deadline=None)
@given(r=rates(), blocks=st.integers(1, 400), data=st.data(),
       extra_s=st.floats(1e-6, 10.0), decoding=st.floats(0, 5000), seed=st.integers(0, 2**32),
       slo=st.none() | st.floats(1e-4, 20.0))
def test_a_worker_queued_past_a_whole_recompute_loses_to_an_idle_one(
        r: Rates, blocks: int, data: st.DataObject, extra_s: float, decoding: float,
        seed: int, slo: float | None) -> None:
    core = _core(r, 2, slo)
    per_block = r.per_block(core.settings.block_size)
    recompute = prefill_seconds(per_block.prefill_s, per_block.context_s, 0.0, blocks, 0, 0)
    # Worker 0 holds the whole prompt behind a queue whose wait exceeds that recompute.
    queued = (recompute + extra_s) / per_block.prefill_s
    _busy(core, 0, queued, decoding)
    assert core.wait(0) > recompute
    idle_holds = data.draw(st.integers(0, blocks))
    matches = {0: (blocks, blocks)}
    if idle_holds:
        matches[1] = (idle_holds, data.draw(st.integers(0, idle_holds)))
    hashes = list(range(1, blocks + 1))
    prices, spec, fast = _both_choices(core, hashes, matches, seed)
    assert prices[0] > prices[1]
    assert spec == fast == 1


@settings(max_examples=300, deadline=None)
@given(r=rates(), blocks=st.integers(0, 400), slo=st.floats(1e-3, 5.0),
       fleet=st.lists(st.tuples(st.floats(1.0, 20000), st.floats(0, 5000), st.integers(0, 400),
                                st.integers(0, 400)), min_size=1, max_size=8),
       seed=st.integers(0, 2**32))
def test_under_an_objective_a_busy_fleet_takes_the_least_prefill_within_it(
        r: Rates, blocks: int, slo: float, fleet: list[tuple[float, float, int, int]],
        seed: int) -> None:
    core = _core(r, len(fleet), slo)
    plain = _core(r, len(fleet))
    matches: dict[int, tuple[int, int]] = {}
    for w, (queued, decoding, held, on_device) in enumerate(fleet):
        for c in (core, plain):
            _busy(c, w, queued, decoding)  # every worker has a wait: a busy fleet
        if min(held, blocks):
            matches[w] = (min(held, blocks), min(on_device, held, blocks))
    hashes = list(range(1, blocks + 1))
    candidates = core.candidates(range(len(fleet)), hashes, matches, 0.0)
    terms = {c.worker: c for c in price(len(hashes), candidates, slo).costs}
    _, spec, fast = _both_choices(core, hashes, matches, seed)
    within = [c for c in terms.values() if c.cost <= slo]
    for chosen in (spec, fast):
        if within:
            assert terms[chosen].cost <= slo and terms[chosen].within_slo
            assert terms[chosen].prefill_s == min(c.prefill_s for c in within)
        else:
            assert chosen == _both_choices(plain, hashes, matches, seed)[1]
