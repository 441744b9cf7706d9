"""Scenarios through :class:`router.routing.core.RoutingCore` on an idle two-worker fleet: where a
prefix everyone shares goes, and how the session term weighs a live conversation against it.
Every request is booked as routed and finished before the next (an idle fleet), so only the
prefix and the session terms differ between the workers."""

from __future__ import annotations

import random

from router.routing.core import CoreSettings, RoutingCore


def _idle_pair() -> RoutingCore:
    core = RoutingCore(CoreSettings(auto_queue=False))
    for w in (0, 1):
        core.worker_joined(w)
    return core


def _route(core: RoutingCore, name: str, hashes: list[int], now: float,
           rng: random.Random) -> int:
    routed = core.decide(hashes, {}, now, rng, tokens=32 * len(hashes) + 1)
    worker = routed.decision.worker
    core.routed(name, worker, hashes, core.credited(routed.decision, worker), now,
                routed.continued, 32 * len(hashes) + 1)
    core.first_token(name)
    core.finished(name)
    return worker


def test_requests_sharing_only_a_prefix_all_go_to_its_holder() -> None:
    # Twelve requests: one 12-block prefix, then 4 blocks of their own. None holds another's
    # last block, so none continues a session and the session term is 0: after the first
    # (a tie, drawn), the predicted prefix keeps every one on the same worker.
    core, rng = _idle_pair(), random.Random(0)
    prefix = list(range(1, 13))
    workers = [_route(core, f"r{i}", prefix + [1000 + 10 * i + j for j in range(4)],
                      0.1 * i, rng) for i in range(12)]
    assert workers == [workers[0]] * 12
    assert core.follows_sessions and core.continue_rate == 0.0


def test_a_live_conversation_outweighs_a_shorter_shared_opening() -> None:
    # Conversations of three turns (blocks [A], [A, B], [A, B, C]) that all open with the
    # same A. The first lives on worker w; its turns stay home, so the continue rate is 1
    # and w holds one live session more than the other worker. A new conversation there
    # costs overlap 32 x session weight 16 = 512; starting it on the other worker costs
    # recomputing A: 32 per block.
    def second_conversation(opening: int) -> tuple[int, int]:
        core, rng = _idle_pair(), random.Random(0)
        a = list(range(1, opening + 1))
        b, c = [100 + i for i in range(16)], [200 + i for i in range(15)]
        first = [_route(core, f"t{i}", turn, 0.1 * i, rng)
                 for i, turn in enumerate([a, a + b, a + b + c])]
        assert first == [first[0]] * 3  # continuations stay home
        return first[0], _route(core, "new", a, 0.3, rng)

    # A 12-block opening (384) is worth less than one live session (512): the new
    # conversation starts on the other worker, and the opening is computed there once.
    home, new = second_conversation(12)
    assert new != home
    # A 17-block opening (544) is worth more: the new conversation joins its holder.
    home, new = second_conversation(17)
    assert new == home
