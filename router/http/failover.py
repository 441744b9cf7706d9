"""Sending a decided request: its chosen worker first, then the next-best ones, until one
begins to answer.

A worker that fails before the first byte (:class:`~router.http.proxy.UpstreamUnavailable`:
refused, 5xx, a stream that opened with an error, no first byte by the deadline, or given up
when the health poll found the worker hung) costs the client nothing: the request's booking
there is withdrawn and it goes to the next candidate that is still healthy, up to
``MAX_ATTEMPTS`` workers. When every one of them failed to connect, the same is tried once
more after ``RETRY_PAUSE_S``: a blip of the network fails healthy workers too. Only the
first attempt has the learned deadline (:mod:`router.http.first_byte`); a fallback waits the
proxy's ceiling, so a request is never failed by an estimate alone. A worker that answers a
client error (4xx) refused the request: its booking is withdrawn too, and the answer goes
back as it is.

Under disaggregated serving the body carries a prefill's ``kv_transfer_params``, which name
KV held for one decode: a retry on another decode worker goes with a fresh prefill's body
(``refreshed``, :func:`router.http.disaggregated.send_disaggregated`).

A candidate that is one data-parallel rank of a worker (:mod:`router.fleet.ranks`) is pinned
with the ``X-data-parallel-rank`` header (a client's own is replaced), so the worker's engine
serves the request on the rank whose cache was chosen.

A worker the decision tells to fetch the prompt's leading blocks from a peer
(``docs/peer_fetch.md``) gets the instruction's headers on its attempt, and the
``x-kvroute-fetch-result`` its answer begins with teaches the pair's link
(:meth:`~router.service.RouterService.fetch_answered`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from openai_request.bodies import ApiError
from router.fleet.entry import Target
from router.fleet.ranks import RANK_HEADER
from router.fleet.worker_table import WorkerState
from router.http.first_byte import FirstByteClock
from router.http.incoming_body import IncomingBody
from router.http.proxy import Proxy, UpstreamAnswer, UpstreamUnavailable
from router.http.tracing import traced_headers
from router.service import FETCH_RESULT, Route, RouterService

__all__ = ["MAX_ATTEMPTS", "RETRY_PAUSE_S", "Sent", "instructed", "pinned",
           "send_with_failover"]

log = logging.getLogger(__name__)

#: Workers tried per round at most (the chosen one and two fallbacks).
MAX_ATTEMPTS = 3
#: Seconds before the second round, tried only when every attempt of the first failed to
#: connect: a network blip (a resolver answering nothing, a bridge being rebuilt) fails every
#: new connection at once, healthy workers' too.
RETRY_PAUSE_S = 0.5


@dataclass(slots=True)
class Sent:
    """A request some worker began to answer."""

    worker: Target
    answer: UpstreamAnswer
    attempt: int


async def send_with_failover(service: RouterService, proxy: Proxy, clock: FirstByteClock,
                             route: Route, path: str, body: bytes | IncomingBody,
                             headers: Mapping[str, str], stream: bool | Callable[[], bool],
                             on_failure: Callable[[Target, int, str], None],
                             refreshed: Callable[[], Awaitable[bytes]] | None = None,
                             pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
                             candidates: list[Target] | None = None, first_attempt: int = 0
                             ) -> Sent:
    """Send ``route``'s request until a worker begins to answer.

    Args:
        service: books the request on each worker tried (and withdraws it on failure).
        proxy: sends.
        clock: gives the first attempt's deadline and learns from streams that begin.
        route: the decided request.
        path: the endpoint path on the worker.
        body: the request body, forwarded as is (one still arriving is sent as it arrives,
            and replayed from its first byte to each worker tried).
        headers: the client's headers.
        stream: whether the client asked for a stream; a callable, asked once a worker's
            answer began, for a body sent before its end (whose first attempt then has no
            learned deadline: the client's upload is no part of the worker's prefill).
        on_failure: called with the worker, the attempt and the cause of each failure.
        refreshed: gives the body for each attempt after the first (None: ``body`` again).
        pause: waits the seconds before the second round.
        candidates: the workers to try, in order (default: the route's chosen worker, then
            its fallbacks).
        first_attempt: the number of the first attempt (a later try of a request some
            worker failed already: no learned deadline, and ``refreshed`` for each body).

    Raises:
        ApiError: 503, no worker began to answer.
    """
    listed: Callable[[], Iterable[Target]] = (
        route.ranked if candidates is None else (lambda: candidates))
    tried = first_attempt
    causes: set[str] = set()
    for worker in _attempts(listed, causes):
        if worker is None:
            await pause(RETRY_PAUSE_S)
            continue
        attempt, tried = tried, tried + 1
        if attempt and refreshed is not None:
            body = await refreshed()
        service.dispatched(route, worker)
        # The prefill queued ahead of it times a stream's first byte; a whole answer has none.
        ahead = service.queued_prefill(worker) if stream is not False else 0.0
        deadline = clock.deadline(worker.id, ahead) if stream is True and attempt == 0 else None
        started = time.monotonic()
        fetch = service.fetch_headers(route, worker)
        try:
            answer = await proxy.send(f"{worker.url}{path}", body,
                                      traced_headers(pinned(instructed(headers, fetch),
                                                            worker), worker, attempt, path),
                                      stream=stream,
                                      first_byte=deadline, waits=worker.waits)
        except UpstreamUnavailable as exc:
            service.undispatched(route, worker)
            causes.add(exc.cause)
            on_failure(worker, attempt, exc.cause)
            log.warning("worker %s failed before answering (%s): %s", worker.url, exc.cause,
                        exc)
            continue
        if fetch:  # told to fetch: its answer says how that went (none else does)
            service.fetch_answered(route, worker, answer.header(FETCH_RESULT))
        worker.liveness.progressed()  # an answer began: alive, whatever its probe says
        answer.on_progress = worker.liveness.progressed
        if (stream() if callable(stream) else stream) and answer.status == 200:
            if isinstance(body, IncomingBody):  # timed from the body's end, not its upload
                started = max(started, body.completed_at or started)
            clock.observed(worker.id, ahead, time.monotonic() - started)
        elif answer.status >= 400:
            service.refused(route, worker)
        return Sent(worker, answer, attempt)
    raise ApiError(503, f"no worker could take the request (tried {tried - first_attempt})",
                   "service_unavailable")


def _attempts(listed: Callable[[], Iterable[Target]], causes: set[str]
              ) -> Iterator[Target | None]:
    """The workers to try, in order: the first ``listed`` (the chosen one), then up to
    ``MAX_ATTEMPTS`` in all of the others still healthy; then, when every failure was a
    connection's (``causes``), ``None`` for the pause and a second such round of the ones
    healthy then."""
    for second in (False, True):
        if second:
            if causes != {"connect"}:
                return
            yield None
        given = 0
        for worker in listed():
            if given == MAX_ATTEMPTS:
                break
            if (second or given) and worker.state is not WorkerState.HEALTHY:
                continue  # turned unhealthy since the decision
            given += 1
            yield worker


def instructed(headers: Mapping[str, str], fetch: Mapping[str, str]) -> Mapping[str, str]:
    """``headers`` with the fetch instruction ``fetch`` added (the client's own fetch
    headers were stripped on arrival: :func:`router.http.request_path.without_fetch`)."""
    if not fetch:
        return headers
    return {**headers, **fetch}


def pinned(headers: Mapping[str, str], worker: Target) -> Mapping[str, str]:
    """``headers``, with the header that pins ``worker``'s data-parallel rank if it has one."""
    rank = worker.rank
    if rank is None:
        return headers
    kept = {k: v for k, v in headers.items() if k.lower() != RANK_HEADER}
    kept[RANK_HEADER] = str(rank)
    return kept
