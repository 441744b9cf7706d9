"""The routing policies as values: what each prices and what it keeps, chosen once by name.

The router's ``--policy`` flag names one of :data:`POLICIES`; :func:`policy_named` gives its
:class:`Policy`, and the core (:class:`router.routing.core.CoreSettings`), the service and the
settings read its attributes instead of comparing names:

- ``kv``: the time to first token from each worker's rates, learned from first tokens; follows
  sessions, prices peer fetches and takes a TTFT objective.
- ``dynamo``: NVIDIA Dynamo's rule, fixed rates in blocks
  (:data:`router.routing.rates.DYNAMO_RATES`): a score, not a predicted time.
- ``round_robin``, ``random``: the cache-blind baselines, a choice made in place of the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BASELINES", "POLICIES", "Policy", "policy_named"]


@dataclass(frozen=True, slots=True)
class Policy:
    """One routing policy: what it prices and what it keeps."""

    name: str
    #: Chooses without pricing the cache (the next worker in turn, or one at random).
    cache_blind: bool = False
    #: The cache-blind choice takes the next worker in turn (otherwise one at random).
    in_turn: bool = False
    #: Prices in blocks at Dynamo's fixed rates (:data:`~router.routing.rates.DYNAMO_RATES`).
    block_rates: bool = False
    #: Its price is a predicted time to first token (shown, checked against the delivered).
    predicts_ttft: bool = False
    #: Learns each worker's rate factor from its first tokens (on default rates).
    learns_rates: bool = False
    #: Follows sessions.
    follows_sessions: bool = False
    #: Prices a peer fetch between workers that advertise it.
    prices_fetch: bool = False
    #: Takes a TTFT objective (``ttft_slo``).
    takes_slo: bool = False
    #: Counts a worker's stored device blocks as its head prefill's progress, and prices the
    #: later requests a busy fleet's prefill delays by the fleet's prefilling count.
    tracks_prefill: bool = False


_KV = Policy("kv", predicts_ttft=True, learns_rates=True, follows_sessions=True,
             prices_fetch=True, takes_slo=True, tracks_prefill=True)

#: Every policy by name, in the order the flag's help lists them.
_BY_NAME: dict[str, Policy] = {p.name: p for p in (
    _KV,
    Policy("dynamo", block_rates=True),
    Policy("round_robin", cache_blind=True, in_turn=True),
    Policy("random", cache_blind=True),
)}

#: The policies' names.
POLICIES: tuple[str, ...] = tuple(_BY_NAME)
#: The cache-blind policies' names, measured against.
BASELINES: tuple[str, ...] = tuple(n for n, p in _BY_NAME.items() if p.cache_blind)


def policy_named(name: str) -> Policy:
    """The policy called ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`POLICIES`.
    """
    policy = _BY_NAME.get(name)
    if policy is None:
        raise ValueError(f"policy {name!r} is not one of {', '.join(POLICIES)}")
    return policy
