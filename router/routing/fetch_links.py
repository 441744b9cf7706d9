"""What a peer fetch costs over each pair of workers: the links' learned bandwidth and the
pairs backed off after a failure.

A worker D told to fetch a prompt's leading blocks from a holder S (``docs/peer_fetch.md``)
answers how it went in ``x-kvroute-fetch-result``: the blocks, bytes and seconds of a fetch
that inserted blocks, or a failure (D then recomputed). :class:`FetchLinks` turns those into
the seconds a block takes over the pair's link, which the rule prices a fetch with
(:class:`router.routing.scheduler.FetchSource`):

- Until a pair has a result, its bandwidth is what the pair advertises: :data:`IPC_BANDWIDTH`
  between two workers whose KV is on one GPU and that both copy fetched blocks over CUDA
  IPC (``cuda_ipc`` in their ``/model_info``'s ``kv_fetch``, with one device identity), else
  the slowest of the default (the router's ``--pd-transfer-bandwidth``, the same network a
  disaggregated prefill's KV crosses) and what either end says its HTTP fetches move
  (``kv_fetch``'s ``http_bandwidth``: a torch worker's encoding and decoding moves 0.2-0.3
  GB/s, a hundredth of the network's default). A block's bytes are the source's advertised
  ``kv_bytes_per_token`` times the block size.
- Each fetched result folds in: the pair's bandwidth is its bytes over its seconds, summed
  over its results with weights decaying by ``decay`` a result (as the rate factor's pairs
  are, :class:`router.routing.rates.RateScale`), so it follows a link that slows down.
- A failure of the link (:data:`FETCH_STATE_FAILURES` are not: the holder had lost the
  blocks, the receiver had no room) backs the pair off: it is no source for that worker for
  ``backoff_s``, doubled at each failure in a row up to ``max_backoff_s``; a fetched result
  ends the run.

Pure: the caller passes ``now`` (monotonic seconds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FETCH_FAILURES", "FETCH_READ_S", "FETCH_STATE_FAILURES", "IPC_BANDWIDTH",
           "FetchAbility", "FetchLinks", "fetch_failure_reason"]

#: Seconds a fetch costs besides its blocks: a request to the source and its lookup of the
#: blocks (an HTTP round trip on one host or rack).
FETCH_READ_S = 0.002

#: Bytes a second a fetch moves over CUDA IPC between two workers on one GPU: 49.1 GB/s,
#: the median of a 1,023-block fetch of ``llama-1b``'s 1 MiB blocks on an H200
#: (``docs/gpu.md``, "Peer KV fetch between workers on one GPU"; over HTTP there 0.3 GB/s).
IPC_BANDWIDTH = 49.1e9


#: Why a worker's fetch failed, as the router counts it (``kvroute_fetch_failures``): the
#: reasons of ``workers.http.kv_fetch``; any other is counted as ``other``.
FETCH_FAILURES = ("unreachable", "timeout", "bad_message", "status", "untrusted",
                  "bad_instruction", "error", "missing", "evicted", "no_free_blocks", "other")
#: Failures that say nothing of the pair's link: the holder no longer held the blocks, or
#: the receiver had no room for them (or lost its own meanwhile). They back nothing off;
#: the rest (the holder unreachable, slow, refusing, answering what does not decode; the
#: instruction untrusted) would fail the next fetch too, so the pair is backed off.
FETCH_STATE_FAILURES = frozenset({"missing", "evicted", "no_free_blocks"})


def fetch_failure_reason(value: str) -> str:
    """The reason of a ``failed;reason=R`` fetch result, one of :data:`FETCH_FAILURES`
    (``status_<code>`` is ``status``; an unknown or absent reason is ``other``)."""
    for part in value.split(";")[1:]:
        name, _, reason = part.partition("=")
        if name.strip() == "reason":
            reason = reason.strip()
            reason = "status" if reason.startswith("status_") else reason
            return reason if reason in FETCH_FAILURES else "other"
    return "other"



@dataclass(frozen=True, slots=True)
class FetchAbility:
    """What a worker advertises of peer fetch (its ``/model_info`` ``kv_fetch``), as the
    router may use it (a secret, or loopback: ``docs/peer_fetch.md``)."""

    #: It answers block reads (may be a source).
    serve: bool = False
    #: It honours fetch instructions (may be told to fetch).
    receive: bool = False
    #: Bytes of KV one token of its cache takes.
    kv_bytes_per_token: int = 0
    #: The machine and GPU its KV is on, when it copies fetched blocks over CUDA IPC
    #: (None: it does not): two workers of one device are priced at :data:`IPC_BANDWIDTH`.
    device: tuple[str, str] | None = None
    #: Bytes a second it says its fetches over HTTP move (0: it does not say).
    http_bandwidth: float = 0.0

    def http_link(self, default: float) -> float:
        """The bandwidth of a fetch over HTTP at this end, over a ``default`` link."""
        bandwidth = self.http_bandwidth
        return bandwidth if 0 < bandwidth < default else default

    def shares_device(self, other: FetchAbility) -> bool:
        """Whether fetches between this worker and ``other`` may go over CUDA IPC."""
        return self.device is not None and self.device == other.device


class _Link:
    __slots__ = ("bytes", "failures", "seconds", "until")

    def __init__(self) -> None:
        self.bytes = self.seconds = 0.0  # decayed sums of the fetched results
        self.failures = 0  # in a row
        self.until = -math.inf  # backed off before this


class FetchLinks:
    """Each (source, receiver) pair's learned link and backoff (module docstring).

    Args:
        bandwidth: the default link, bytes a second.
        block_size: tokens a block.
        decay: the weight kept of past results at each new one.
        backoff_s: seconds a pair is no source after a failure (doubled each one in a row).
        max_backoff_s: the longest backoff.

    Raises:
        ValueError: a figure out of range.
    """

    def __init__(self, bandwidth: float, block_size: int, decay: float = 0.9,
                 backoff_s: float = 30.0, max_backoff_s: float = 600.0) -> None:
        if not (bandwidth > 0 and math.isfinite(bandwidth)) or block_size < 1:
            raise ValueError("bandwidth must be a positive number and block_size >= 1")
        if not 0 < decay <= 1 or not 0 < backoff_s <= max_backoff_s:
            raise ValueError("decay in (0, 1], 0 < backoff_s <= max_backoff_s")
        self.bandwidth = bandwidth
        self.block_size = block_size
        self.decay = decay
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._by_source: dict[int, dict[int, _Link]] = {}

    def default_block_s(self, kv_bytes_per_token: int, bandwidth: float | None = None
                        ) -> float:
        """Seconds a block of a source with ``kv_bytes_per_token`` takes over a pair with no
        result yet: at ``bandwidth``, what the pair advertises (None: the default link)."""
        return self.block_size * kv_bytes_per_token / (bandwidth or self.bandwidth)

    def block_s(self, source: int, receiver: int, kv_bytes_per_token: int,
                bandwidth: float | None = None) -> float:
        """Seconds a block takes from ``source`` to ``receiver``: learned, or before any
        result at ``bandwidth`` (:meth:`default_block_s`)."""
        link = self._by_source.get(source, {}).get(receiver)
        if link is None or link.bytes <= 0 or link.seconds <= 0:
            return self.default_block_s(kv_bytes_per_token, bandwidth)
        return self.block_size * kv_bytes_per_token * link.seconds / link.bytes

    def backed_off(self, source: int, receiver: int, now: float) -> bool:
        """Whether ``receiver`` may not fetch from ``source`` now (a recent failure)."""
        link = self._by_source.get(source, {}).get(receiver)
        return link is not None and now < link.until

    def known(self, source: int) -> Iterable[int]:
        """The receivers whose link from ``source`` is not the default (learned, or backed
        off): a decision prices each of them on its own."""
        return self._by_source.get(source, {}).keys()

    def fetched(self, source: int, receiver: int, nbytes: float, seconds: float) -> bool:
        """Fold in a fetch that moved ``nbytes`` in ``seconds``. Returns whether it was
        used (a result with no bytes, or no time, teaches nothing but ends a failure run)."""
        link = self._link(source, receiver)
        link.failures, link.until = 0, -math.inf
        if not (nbytes > 0 and seconds > 0 and math.isfinite(nbytes)
                and math.isfinite(seconds)):
            return False
        link.bytes = self.decay * link.bytes + nbytes
        link.seconds = self.decay * link.seconds + seconds
        return True

    def failed(self, source: int, receiver: int, now: float) -> float:
        """A fetch from ``source`` to ``receiver`` failed at ``now``: back the pair off.
        Returns the seconds of the backoff."""
        link = self._link(source, receiver)
        seconds = min(self.backoff_s * 2.0 ** min(link.failures, 30), self.max_backoff_s)
        link.failures += 1
        link.until = now + seconds
        return seconds

    def forget(self, worker: int) -> None:
        """``worker`` left: drop every link from or to it."""
        self._by_source.pop(worker, None)
        for links in self._by_source.values():
            links.pop(worker, None)

    def _link(self, source: int, receiver: int) -> _Link:
        links = self._by_source.setdefault(source, {})
        link = links.get(receiver)
        if link is None:
            link = links[receiver] = _Link()
        return link
