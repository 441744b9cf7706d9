"""What the registry asks of a worker's engine, whatever the engine is.

An :class:`EngineAdapter` turns one engine's control plane into the router's terms: who the
worker is (:class:`~router.fleet.worker_table.WorkerInfo`) and how loaded it is
(:class:`~router.routing.load.ReportedLoad`). The registry owns the schedule (when to ask, what a
failure does); the adapter owns the questions and reads the answers, which are untrusted input.

Every answer is read with :func:`read_answer`, incrementally and at most
:data:`MAX_ANSWER_BYTES`: a worker that answers a poll with hundreds of MB (a runaway metrics
page, or a hostile peer) costs the router that much and no more, and is unhealthy with the
reason (``oversize`` set on the error, counted per worker as
``kvroute_control_answers_oversize``).

Errors, by boundary::

    Exception
     +-- AnswerTooLarge      read_answer(): the answer passed MAX_ANSWER_BYTES
     +-- WorkerUnreachable   describe(): the worker did not answer usably; retried later
     +-- PollFailed          poll(): no health or load this time; the worker is unhealthy
     +-- WorkerChanged       poll(): healthy, but what it serves changed; here is it anew
     +-- ValueError
          +-- IncompatibleWorker  describe(): the worker answered, and must not be routed to
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import httpx

from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import WorkerInfo
from router.routing.load import ReportedLoad

__all__ = ["MAX_ANSWER_BYTES", "Answer", "AnswerTooLarge", "EngineAdapter", "PollFailed",
           "WorkerChanged", "WorkerUnreachable", "poll_failed", "read_answer"]

#: The most bytes the router reads of one control-plane answer (model info, load, models,
#: health, metrics). A vLLM metrics page with every histogram is about 100 KB.
MAX_ANSWER_BYTES = 4 * 1024 * 1024


class AnswerTooLarge(Exception):
    """A control-plane answer passed :data:`MAX_ANSWER_BYTES`; the message names the URL."""


class WorkerUnreachable(Exception):
    """The worker did not answer its description request, or answered something unusable.

    Args:
        reason: why, as ``/workers`` shows it.
        oversize: the answer was over :data:`MAX_ANSWER_BYTES` (counted per worker).
    """

    def __init__(self, reason: str, *, oversize: bool = False) -> None:
        super().__init__(reason)
        self.oversize = oversize


class PollFailed(Exception):
    """A health or load poll failed; the message is the reason ``/workers`` shows.

    Args:
        reason: why, as ``/workers`` shows it.
        gone: the worker did not answer at all (timed out, refused, reset): requests waiting
            for its first byte are sent elsewhere.
        late: no answer within the timeout (a busy worker may still be alive: the registry
            weighs it with the data path's evidence, :mod:`router.fleet.liveness`).
        oversize: the answer was over :data:`MAX_ANSWER_BYTES` (counted per worker).
    """

    def __init__(self, reason: str, *, gone: bool = False, late: bool = False,
                 oversize: bool = False) -> None:
        super().__init__(reason)
        self.gone = gone
        self.late = late
        self.oversize = oversize


class WorkerChanged(Exception):
    """A poll was answered, and the worker now serves something else than it was described
    with (a renamed model, an adapter added or gone).

    Args:
        reason: what changed, as ``/workers`` shows it.
        info: the worker's description now.
        load: the load this poll read.
    """

    def __init__(self, reason: str, info: WorkerInfo, load: ReportedLoad) -> None:
        super().__init__(reason)
        self.info = info
        self.load = load


class Answer(NamedTuple):
    """A control-plane answer read whole: its status and at most the limit of bytes."""

    status_code: int
    content: bytes

    def raise_for_status(self, url: str) -> None:
        """Raise :class:`httpx.HTTPStatusError` unless the status is 2xx."""
        if not 200 <= self.status_code < 300:
            request = httpx.Request("GET", url)
            raise httpx.HTTPStatusError(
                f"{url} answered HTTP {self.status_code}", request=request,
                response=httpx.Response(self.status_code, request=request))


async def read_answer(http: httpx.AsyncClient, url: str, *, timeout: float,
                      max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
    """``GET url`` and read the answer incrementally, refusing it past ``max_bytes``.

    Args:
        http: the router's client for control calls.
        url: what to read.
        timeout: the client's timeout for each step (connect, each read).
        max_bytes: the most bytes accepted.

    Raises:
        AnswerTooLarge: the declared length or the bytes read passed ``max_bytes`` (the
            connection is closed at once; the rest is never read).
        httpx.HTTPError: the request failed.
    """
    async with http.stream("GET", url, timeout=timeout) as response:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise AnswerTooLarge(f"the answer of {url} is over {max_bytes} bytes")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > max_bytes:
                raise AnswerTooLarge(f"the answer of {url} is over {max_bytes} bytes")
        return Answer(response.status_code, bytes(data))


def poll_failed(what: str, exc: httpx.HTTPError, timeout: float) -> PollFailed:
    """The :class:`PollFailed` for an HTTP error during a poll: no answer within ``timeout``
    and transport errors mean the worker is gone; an error status does not.

    Args:
        what: what was being asked (``"load poll"``, ``"health check"``...).
        exc: the client's error.
        timeout: the poll's timeout in seconds (named in the reason).
    """
    if isinstance(exc, httpx.TimeoutException):
        return PollFailed(f"{what} failed: no answer within {timeout}s", gone=True, late=True)
    return PollFailed(f"{what} failed: {type(exc).__name__}: {exc}",
                      gone=isinstance(exc, httpx.TransportError))


class EngineAdapter(Protocol):
    """One engine's control plane, as the registry needs it."""

    name: str

    async def describe(self, http: httpx.AsyncClient, worker: WorkerConfig,
                       router_block_size: int) -> WorkerInfo:
        """Learn who the worker is: model, block size, event endpoints.

        Args:
            http: the router's client for control calls.
            worker: the worker's configuration.
            router_block_size: the router's block size, assumed where neither the engine nor
                the configuration gives one.

        Raises:
            WorkerUnreachable: no usable answer (the registry retries).
            IncompatibleWorker: the answer is well formed but configuration contradicts it.
        """
        ...

    async def poll(self, http: httpx.AsyncClient, worker: WorkerConfig,
                   info: WorkerInfo | None, timeout: float = 2.0) -> ReportedLoad:
        """Check health and read the worker's load.

        Args:
            http: the router's client for control calls.
            worker: the worker's configuration.
            info: what :meth:`describe` last returned (``None`` before it succeeded).
            timeout: seconds to wait for each answer (the router's ``health_timeout``).

        Raises:
            PollFailed: the worker is not healthy now, or answered something unusable.
        """
        ...
