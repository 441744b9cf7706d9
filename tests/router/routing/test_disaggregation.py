"""The second step of a disaggregated decision (:func:`router.routing.disaggregation.
choose_prefill`), the one the router and the benchmark's kvroute policy both take."""

from __future__ import annotations

import random

from router.routing.core import CoreSettings, RoutingCore
from router.routing.disaggregation import (
    PrefillLink,
    choose_prefill,
    decode_terms,
    remote_prefill_ttft,
    transfer_seconds,
)

LINK = PrefillLink(local_prefill_tokens=64, kv_bytes_per_token=1024, bandwidth=1e9)


def _fleet() -> RoutingCore:
    # Workers 0 and 1 decode, 2 and 3 prefill.
    core = RoutingCore(CoreSettings(block_size=32))
    for w in range(4):
        core.worker_joined(w)
    return core


def test_a_decode_worker_holding_all_but_a_short_tail_prefills_it_itself() -> None:
    core, rng = _fleet(), random.Random(0)
    hashes = list(range(1, 9))
    matches = {0: (8, 8)}
    decode = core.decide(hashes, matches, 0.0, rng, workers=[0, 1], tokens=8 * 32 + 40,
                         fetch=False).decision.chosen
    assert decode.worker == 0 and decode.matched_blocks == 8
    assert choose_prefill(core, hashes, matches, 0.0, rng, decode, 8 * 32 + 40, [2, 3],
                          LINK) is None


def test_a_cold_prompt_goes_to_the_prefill_worker_holding_it_priced_three_steps() -> None:
    core, rng = _fleet(), random.Random(0)
    hashes = list(range(1, 9))
    matches = {3: (6, 6)}
    decode = core.decide(hashes, matches, 0.0, rng, workers=[0, 1], tokens=8 * 32,
                         fetch=False).decision.chosen
    remote = choose_prefill(core, hashes, matches, 0.0, rng, decode, 8 * 32, [2, 3], LINK)
    assert remote is not None and remote.decision.worker == 3
    moved = 8 - decode.matched_blocks
    assert remote.ttft_s == remote_prefill_ttft(
        remote.decision.chosen, decode, core.rates(decode.worker).first_s,
        transfer_seconds(moved, 32, 1024, 1e9))
    booked = decode_terms(decode)
    assert (booked.prefill_blocks, booked.prefill_s) == (0, 0.0)
    assert booked.worker == decode.worker and booked.matched_blocks == decode.matched_blocks
