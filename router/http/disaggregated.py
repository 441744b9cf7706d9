"""Disaggregated serving: the remote prefill that comes before a request goes to its decode
worker.

When the service chose a prefill worker for a request (:attr:`Route.prefill`), the request is
served in two steps, by vLLM's ``kv_transfer_params`` protocol (which kvroute's own worker
speaks too, :mod:`workers.http.kv_transfer`):

1. the prefill worker gets the request with ``max_tokens`` 1, ``stream`` false and
   ``"kv_transfer_params": {"do_remote_decode": true, ...}``; it computes the prompt's KV and
   answers with ``kv_transfer_params`` naming itself and its blocks;
2. those params, unchanged, go into the original request, sent to the decode worker as any
   request is (:mod:`router.http.failover`); the decode worker pulls the KV from the prefill
   worker itself, so no KV passes through the router.

A prefill that fails (no answer, an error status, a timeout of ``pd_prefill_timeout`` seconds,
or an answer without ``kv_transfer_params``) costs the client nothing: the request is served
whole (aggregated) on its decode worker, and ``pd_prefill_failures`` counts it. Either way the
prefill worker's booking ends when its step does.

An SGLang prefill worker is driven by SGLang's protocol instead (:mod:`router.http.bootstrap`):
the bootstrap fields, the prefill sent beside the decode request rather than before it.

A decode worker that fails before its first byte costs nothing either: the request goes to the
next decode worker (:func:`router.http.failover.send_with_failover`) with a fresh prefill, since
the first one's KV was held for the worker that failed (a prefill worker releases it once one
decode has taken it, or when its lease ends); ``pd_decode_retries`` counts them. When no decode
worker is left (a fleet of one, say, whose KV transfer timed out: vLLM's NixlConnector gives a
handshake 5 s, and fails the request on a loaded machine), the chosen decode worker gets one
more try with a fresh prefill, unless it could not be reached at all; then the request is
served whole, the original body, on the decode worker (it prefills the prompt itself) or else
on the prefill worker; ``pd_served_whole`` counts those. Every request is answered while one
of the two can answer it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from openai_request.bodies import ApiError
from router.fleet.entry import Target
from router.http.bootstrap import prefill_alongside
from router.http.failover import Sent, pinned, send_with_failover
from router.http.proxy import UpstreamUnavailable
from router.http.state import RouterState
from router.service import Route

__all__ = ["REMOTE_DECODE", "prefill_remotely", "send_disaggregated"]

log = logging.getLogger(__name__)

#: The ``kv_transfer_params`` that ask a prefill worker to prefill for a remote decode.
REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 "remote_engine_id": None, "remote_block_ids": None,
                                 "remote_host": None, "remote_port": None}


async def prefill_remotely(state: RouterState, route: Route, path: str, body: dict[str, Any],
                           raw: bytes, headers: Mapping[str, str]) -> bytes:
    """Run ``route``'s remote prefill; return the body to send its decode worker: ``raw``
    with the prefill's ``kv_transfer_params``, or ``raw`` itself when the prefill failed
    (``route.prefill`` is then cleared, so the decode worker is booked for the whole
    prefill)."""
    service = state.service
    worker = route.prefill
    assert worker is not None, "a remote prefill needs its prefill worker"
    if worker.worker.engine == "sglang":
        return await prefill_alongside(state, route, path, body, headers)
    step = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    step.pop("stream_options", None)
    if "max_completion_tokens" in step:
        step["max_completion_tokens"] = 1
    booking = service.prefill_dispatched(route)
    try:
        async with asyncio.timeout(state.settings.pd_prefill_timeout):
            answer = await state.proxy.send(f"{worker.url}{path}", json.dumps(step).encode(),
                                            pinned(headers, worker), waits=worker.waits)
            content = await answer.read()
        params = _transfer_params(content) if answer.status == 200 else None
        if params is None:
            raise UpstreamUnavailable(f"answered {answer.status} without kv_transfer_params",
                                      "status")
    except (UpstreamUnavailable, TimeoutError) as exc:
        _count(service.counters, "pd_prefill_failures")
        log.warning("prefill on %s failed (%s); serving the request whole on its decode "
                    "worker", worker.url, exc or "timed out")
        route.prefill = None
        return raw
    finally:
        service.core.finished(booking)
    _count(service.counters, "pd_remote_prefills")
    return json.dumps({**body, "kv_transfer_params": params}).encode()


async def send_disaggregated(state: RouterState, route: Route, path: str,
                             body: dict[str, Any], raw: bytes, headers: Mapping[str, str],
                             stream: bool, on_failure: Callable[[Target, int, str], None]
                             ) -> Sent:
    """Send a request with a remote prefill: the prefill step, then the decode worker, and on
    a decode worker's failure before its first byte the next one with a fresh prefill; when
    none is left, the last resorts (:func:`_last_resorts`; module docstring).

    Raises:
        ApiError: 503, no worker began to answer.
    """
    decode_body = await prefill_remotely(state, route, path, body, raw, headers)
    prefill_worker = route.prefill
    causes: dict[int, str] = {}  # each worker's last failure
    tries = [0]  # attempts so far

    def failed(worker: Target, attempt: int, cause: str) -> None:
        causes[worker.id] = cause
        tries[0] = attempt + 1
        on_failure(worker, attempt, cause)

    async def refreshed() -> bytes:
        _count(state.service.counters, "pd_decode_retries")
        if route.prefill is None:  # served whole: the original body serves again
            return raw
        return await prefill_remotely(state, route, path, body, raw, headers)

    try:
        return await send_with_failover(state.service, state.proxy, state.first_byte, route,
                                        path, decode_body, headers, stream, failed, refreshed)
    except ApiError as exc:
        if exc.status != 503 or prefill_worker is None:
            raise
    return await _last_resorts(state, route, path, raw, headers, stream, failed, refreshed,
                               prefill_worker, causes, tries)


async def _last_resorts(state: RouterState, route: Route, path: str, raw: bytes,
                        headers: Mapping[str, str], stream: bool,
                        failed: Callable[[Target, int, str], None],
                        refreshed: Callable[[], Awaitable[bytes]], prefill_worker: Target,
                        causes: Mapping[int, str], tries: list[int]) -> Sent:
    """Every decode worker failed the request before its first byte: try the chosen one once
    more with a fresh prefill (a KV transfer that timed out on a loaded pair may go through
    the next time), unless it could not be reached; then serve the request whole (the
    original body): on the chosen decode worker, which prefills it itself, unless it failed
    the request whole already, then on the prefill worker. ``pd_decode_retries`` counts the
    first, ``pd_served_whole`` the second. ``causes`` (each worker's last failure) and
    ``tries`` (the attempts so far) follow ``failed``.

    Raises:
        ApiError: 503, none of them began to answer either.
    """
    service, decode = state.service, route.worker
    if route.prefill is not None and causes.get(decode.id) != "connect":
        log.warning("every decode worker failed the request before its first byte; once "
                    "more on %s with a fresh prefill", decode.url)
        try:
            return await send_with_failover(service, state.proxy, state.first_byte, route,
                                            path, raw, headers, stream, failed, refreshed,
                                            candidates=[decode], first_attempt=tries[0])
        except ApiError as exc:
            if exc.status != 503:
                raise
    # A decode worker whose own prefill failed was sent the request whole, and failed it.
    failed_whole = route.prefill is None
    route.prefill = None  # whole: the decode worker is booked for its own prefill
    _count(service.counters, "pd_served_whole")
    whole = [w for w in ((prefill_worker,) if failed_whole else (decode, prefill_worker))
             if causes.get(w.id) != "connect"]
    if not whole:
        raise ApiError(503, "no worker could take the request (every one tried failed)",
                       "service_unavailable")
    log.warning("serving the request whole on %s after its decode failed",
                " or ".join(w.url for w in whole))
    return await send_with_failover(service, state.proxy, state.first_byte, route, path, raw,
                                    headers, stream, failed, candidates=whole,
                                    first_attempt=tries[0])


def _transfer_params(content: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object of a prefill answer, or None."""
    try:
        answer = json.loads(content)
    except ValueError:
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


def _count(counters: dict[str, float], name: str) -> None:
    counters[name] = counters.get(name, 0) + 1
