"""Selective disaggregation: when a decode worker prefills a request itself.

Under disaggregated serving a request's prompt is prefilled on a prefill worker and its KV
moved to the decode worker, so that decode workers' steps never share a forward pass with a
long prefill. When the decode worker already holds most of the prompt (a follow-up turn whose
history it cached), the part left to compute is short: computing it there costs its decode
steps little, while a remote prefill adds a round trip, a transfer and a prefill worker's
queue. The router then skips the remote prefill (llm-d does the same). The threshold is the
router's ``--pd-local-prefill-tokens``; the benchmark that set its default is in
``docs/benchmarks.md`` ("Disaggregated against aggregated workers").

A request prefilled remotely has its first token after three things in a row
(:func:`remote_prefill_ttft`): the prefill worker's queue and prefill, the transfer, and the
decode worker's wait for its first step. That sum, not the decode worker's own price, is
what the router predicts and books for it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.routing.scheduler import Decision, WorkerCost

if TYPE_CHECKING:
    from router.routing.core import Matches, RoutingCore

__all__ = ["PrefillLink", "RemotePrefill", "choose_prefill", "decode_terms", "prefills_locally",
           "remote_prefill_ttft", "transfer_seconds"]


@dataclass(frozen=True, slots=True)
class PrefillLink:
    """The settings of a remote prefill: the router's ``--pd-*`` flags."""

    #: At most this many uncached tokens the decode worker prefills itself
    #: (:func:`prefills_locally`).
    local_prefill_tokens: int
    #: KV bytes a token moves from the prefill worker to the decode worker.
    kv_bytes_per_token: int
    #: The prefill-to-decode link, bytes a second.
    bandwidth: float


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A remote prefill chosen for a request: the prefill worker's decision and the
    predicted time to first token through it (:func:`remote_prefill_ttft`)."""

    decision: Decision
    ttft_s: float


def choose_prefill(core: RoutingCore, hashes: Sequence[int], matches: Matches, now: float,
                   rng: random.Random, decode: WorkerCost, tokens: int,
                   prefill_workers: Sequence[int], link: PrefillLink) -> RemotePrefill | None:
    """The second step of a disaggregated decision, after the decode worker's (``decode``,
    its chosen terms): None when the decode worker prefills the ``tokens``-token prompt
    itself (:func:`prefills_locally`), else the prefill worker by the rule among
    ``prefill_workers`` (no peer fetch: its KV moves by the transfer) and the predicted
    time to first token through it. Books nothing: the caller books the prefill worker
    when it sends the prefill, and the decode worker at :func:`decode_terms`."""
    block_size = core.settings.block_size
    if prefills_locally(tokens, decode.matched_blocks, block_size, link.local_prefill_tokens):
        return None
    chosen = core.decide(hashes, matches, now, rng, workers=prefill_workers,
                         fetch=False).decision
    moved = len(hashes) - decode.matched_blocks
    ttft = remote_prefill_ttft(
        chosen.chosen, decode, core.rates(decode.worker).first_s,
        transfer_seconds(moved, block_size, link.kv_bytes_per_token, link.bandwidth))
    return RemotePrefill(chosen, ttft)


def decode_terms(terms: WorkerCost) -> WorkerCost:
    """The decode worker's booking under a remote prefill: its KV arrives by transfer,
    nothing to prefill there."""
    return dataclasses.replace(terms, prefill_blocks=0, prefill_s=0.0)


def prefills_locally(prompt_tokens: int, held_blocks: int, block_size: int,
                     local_tokens: int) -> bool:
    """Whether the decode worker computes the prompt itself: at most ``local_tokens`` of its
    ``prompt_tokens`` lie past the ``held_blocks`` blocks it holds (``local_tokens`` 0: only a
    prompt whose every block it holds)."""
    return prompt_tokens - held_blocks * block_size <= local_tokens


def remote_prefill_ttft(prefill: WorkerCost, decode: WorkerCost, decode_first_s: float,
                        transfer_s: float) -> float:
    """The predicted time to first token of a request prefilled on another worker: the
    prefill worker's own time to its one token (``prefill.cost``: its wait, the prompt's
    prefill there, its first step), the transfer of the KV to the decode worker
    (``transfer_s``, :func:`transfer_seconds`), then the decode worker's wait for its first
    step (``decode.wait_s``: its queued prefill and decodes) and that step
    (``decode_first_s``)."""
    return prefill.cost + transfer_s + decode.wait_s + decode_first_s


def transfer_seconds(blocks: int, block_size: int, kv_bytes_per_token: int,
                     bandwidth: float) -> float:
    """Seconds to move ``blocks`` blocks of KV over a link of ``bandwidth`` bytes a second."""
    return blocks * block_size * kv_bytes_per_token / bandwidth
