"""``kvroute_affinity4`` and ``kvroute_affinity1``: ``kvroute`` with the affinity factor set, for an
engine whose decode attention reads paged K/V in place (4, at a lead of 4 blocks, as the seventh
session measured it; the router's default since the eighth session is 4 at a lead of 8) or one
that concatenates K/V every step (1, the default before).

``kvroute``'s overlap weight (32) says a prefill block costs about as much as 32 blocks of
decode context on the worker; that ratio came from the calibrated timing, whose decode
figures were measured concatenating K/V every step (80.3 ns a token of context). A kernel that
reads paged K/V in place costs 8.9 ns a token on the same H200 (``docs/gpu.md``), so a block
of decode context is about 9 times cheaper against a prefill block than the weight assumes.
Under that timing (``bench.replay --timing paged``) ``kvroute`` moved continuing sessions to
workers with less decode context and recomputed their conversation there: 150 of 2,000 turns
in a 4-worker ``multi_turn`` run, each one because the decode blocks it saved outweighed the
recompute at weight 32, where SGLang's policy moved 7. Raising the weight everywhere
(``kvroute_ow64``, 128, 256) keeps sessions but also piles new sessions onto the workers that
hold their system prompt, and ``agentic`` then loses its balance (load imbalance 1.33-1.37 at
128); there the decode term is what spreads new sessions.

So the router's ``--affinity-weight`` (:mod:`router.scheduler`) raises the weight only for a
request one worker holds clearly more of than any other (a lead of ``--affinity-lead-blocks``,
4: a continuing session, whose conversation only that worker caches, or a prefix only one
worker holds); a request whose best
prefix several workers share (a new session over a shared system prompt) is priced as
without it. 4 met more of the issue's targets on the paged timing (44 of 56 session runs,
against 28 at 1) and fewer on the calibrated one (16 of 28, against 20), so when the
benchmark's default engine became the paged one, 4 became the router's default, with a lead
of 8 blocks, which met four more runs and broke none (``docs/benchmarks.md``, "The default
engine"); ``kvroute_affinity1`` keeps the old default. Results in ``docs/benchmarks.md`` ("The
decode price, measured" and "The default engine").
"""

from __future__ import annotations

import dataclasses

from bench.policies.kvroute_pressure import KvrouteAuto

__all__ = ["KvrouteAffinity", "KvrouteAffinity1"]


class KvrouteAffinity(KvrouteAuto):
    """``kvroute`` with ``--affinity-weight`` (module docstring).

    Args:
        factor: the affinity weight.
        lead_blocks: the affinity lead, in blocks.
    """

    name = "kvroute_affinity4"

    def __init__(self, factor: float = 4.0, lead_blocks: int = 4) -> None:
        super().__init__()
        self.config = dataclasses.replace(self.config, affinity_weight=factor,
                                          affinity_lead_blocks=lead_blocks)


class KvrouteAffinity1(KvrouteAffinity):
    """``kvroute`` with ``--affinity-weight 1`` (no factor: the router's default before the
    eighth session, and the better setting on the calibrated timing)."""

    name = "kvroute_affinity1"

    def __init__(self) -> None:
        super().__init__(factor=1.0)
