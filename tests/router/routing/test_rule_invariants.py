"""The rule's two invariants (``router.routing.scheduler``'s docstring), property-tested for the
specification (:func:`router.routing.scheduler.choose`, its prices) and the fast twin
(:func:`router.routing.load_groups.choose_fast`, through the core) alike:

1. of two idle workers with the same rates, one holding more of the prompt, and no less of it
   on the device, is never priced above the other (so never chosen over it unless they tie);
2. a worker whose queued wait exceeds the time to recompute the whole prompt on an idle worker
   is never chosen over that idle one, with or without a TTFT objective;
3. with a TTFT objective, in a busy fleet, the choice is within it whenever some candidate
   is, and has the least prefill of those within it; with none within it, the choice is the
   rule's without an objective;
4. a peer fetch is never chosen for a worker whose recompute is no dearer there, never from a
   worker that serves no reads or whose link to it is backed off, never by a worker that
   receives none, and never of fewer blocks than it holds.

1-3 are checked with and without peer fetch (every worker serving and receiving, at a random
default link); 4 on fleets of random abilities, links and failures.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.routing.core import CoreSettings, RoutingCore
from router.routing.fetch_links import FetchAbility
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


#: Peer fetch for a fleet: None, or (default link bytes a second, KV bytes a token); from a
#: slow link to one faster than any host copy.
FETCH = st.none() | st.tuples(st.floats(1e8, 1e14), st.sampled_from([4096, 32768, 1 << 20]))


def _core(r: Rates, workers: int, slo: float | None = None,
          fetch: tuple[float, int] | None = None) -> RoutingCore:
    bandwidth = 25e9 if fetch is None else fetch[0]
    core = RoutingCore(CoreSettings(rates=r, ttft_slo=slo, fetch_bandwidth=bandwidth))
    ability = None if fetch is None else FetchAbility(True, True, fetch[1])
    for w in range(workers):
        core.worker_joined(w, fetch=ability)
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
    sources = core._sources(matches, None, len(hashes))
    fast = choose_fast(len(hashes), core._holders(hashes, matches, 0.0, passed_on, sources),
                       core._groups, random.Random(seed), passed_on, slo, sources).worker
    return prices, spec, fast


@settings(max_examples=200, deadline=None)
@given(r=rates(), blocks=st.integers(0, 400), data=st.data(),
       others=st.lists(st.tuples(st.floats(0, 5000), st.floats(0, 5000), st.integers(0, 400)),
                       max_size=6),
       seed=st.integers(0, 2**32), fetch=FETCH)
def test_an_idle_worker_holding_more_is_never_priced_above_one_holding_less(
        r: Rates, blocks: int, data: st.DataObject,
        others: list[tuple[float, float, int]], seed: int,
        fetch: tuple[float, int] | None) -> None:
    more = data.draw(st.integers(0, blocks))
    less = data.draw(st.integers(0, more))
    less_device = data.draw(st.integers(0, less))
    more_device = data.draw(st.integers(less_device, more))
    core = _core(r, 2 + len(others), fetch=fetch)
    hashes = list(range(1, blocks + 1))
    matches = {0: (more, more_device), 1: (less, less_device)}
    for i, (queued, decoding, held) in enumerate(others, start=2):
        _busy(core, i, queued, decoding)
        # With fetch the others hold theirs on the device: sources for both.
        matches[i] = (min(held, blocks), 0 if fetch is None else min(held, blocks))
    matches = {w: m for w, m in matches.items() if m[0]}
    prices, spec, fast = _both_choices(core, hashes, matches, seed)
    # Equal up to rounding: a host copy as dear as a recompute sums the same seconds in
    # another order (a few ulps either way).
    close = math.isclose(prices[0], prices[1], rel_tol=1e-12)
    assert prices[0] <= prices[1] or close
    for chosen in (spec, fast):
        assert chosen != 1 or close


@settings(max_examples=200, deadline=None)
@given(r=rates(), blocks=st.integers(1, 400), data=st.data(),
       extra_s=st.floats(1e-6, 10.0), decoding=st.floats(0, 5000), seed=st.integers(0, 2**32),
       slo=st.none() | st.floats(1e-4, 20.0), fetch=FETCH)
def test_a_worker_queued_past_a_whole_recompute_loses_to_an_idle_one(
        r: Rates, blocks: int, data: st.DataObject, extra_s: float, decoding: float,
        seed: int, slo: float | None, fetch: tuple[float, int] | None) -> None:
    core = _core(r, 2, slo, fetch)
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
       seed=st.integers(0, 2**32), fetch=FETCH)
def test_under_an_objective_a_busy_fleet_takes_the_least_prefill_within_it(
        r: Rates, blocks: int, slo: float, fleet: list[tuple[float, float, int, int]],
        seed: int, fetch: tuple[float, int] | None) -> None:
    core = _core(r, len(fleet), slo, fetch)
    plain = _core(r, len(fleet), fetch=fetch)
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


#: Abilities a fleet of the fetch invariant mixes (None: a stock engine).
ABILITIES = st.sampled_from([FetchAbility(True, True, 32768), FetchAbility(True, False, 32768),
                             FetchAbility(False, True, 32768), FetchAbility(True, True, 4096),
                             None])


@settings(max_examples=300, deadline=None)
@given(r=rates(), blocks=st.integers(1, 300), slo=st.none() | st.floats(1e-3, 5.0),
       fleet=st.lists(st.tuples(ABILITIES, st.floats(0, 20000), st.integers(0, 300),
                                st.integers(0, 300)), min_size=1, max_size=8),
       results=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7), st.booleans(),
                                  st.floats(1e3, 1e9), st.floats(1e-5, 1.0)), max_size=10),
       bandwidth=st.floats(1e8, 1e13), seed=st.integers(0, 2**32))
def test_a_fetch_is_chosen_only_where_it_is_cheaper_and_from_a_worker_that_serves(
        r: Rates, blocks: int, slo: float | None,
        fleet: list[tuple[FetchAbility | None, float, int, int]],
        results: list[tuple[int, int, bool, float, float]], bandwidth: float,
        seed: int) -> None:
    core = RoutingCore(CoreSettings(rates=r, ttft_slo=slo, fetch_bandwidth=bandwidth))
    matches: dict[int, tuple[int, int]] = {}
    for w, (ability, queued, held, on_device) in enumerate(fleet):
        core.worker_joined(w, fetch=ability)
        if queued:
            _busy(core, w, queued, 0.0)
        if min(held, blocks):
            matches[w] = (min(held, blocks), min(on_device, held, blocks))
    for source, receiver, ok, nbytes, seconds in results:  # links learned, pairs backed off
        if ok:
            core.fetched(source, receiver, nbytes, seconds)
        else:
            core.fetch_failed(source, receiver, 0.0)
    hashes = list(range(1, blocks + 1))
    candidates = core.candidates(range(len(fleet)), hashes, matches, 0.0)
    costs = price(blocks, candidates, slo).costs
    busy = all(c.wait_s > 0 for c in candidates)
    fast = core.decide(hashes, matches, 0.0, random.Random(seed)).decision.chosen
    for c in [*costs, fast]:
        if c.fetch_source is None:
            continue
        receiver, source = core.fetch_ability(c.worker), core.fetch_ability(c.fetch_source)
        assert receiver is not None and receiver.receive
        assert source is not None and source.serve and c.fetch_source != c.worker
        assert not core._links.backed_off(c.fetch_source, c.worker, 0.0)
        assert c.fetch_blocks > c.matched_blocks
        assert c.fetch_blocks <= matches[c.fetch_source][1]  # what it holds on its device
        recompute_within = busy and slo is not None and c.recompute_cost <= slo
        assert (c.price, c.cost if c.within_slo else 0.0) < (
            c.recompute_price, c.recompute_cost if recompute_within else 0.0)
