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
decode has taken it, or when its lease ends); ``pd_decode_retries`` counts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

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
    a decode worker's failure before its first byte the next one with a fresh prefill (module
    docstring; the prefill worker stays the one chosen, which holds the prompt now).

    Raises:
        ApiError: 503, no decode worker began to answer.
    """
    decode_body = await prefill_remotely(state, route, path, body, raw, headers)

    async def refreshed() -> bytes:
        _count(state.service.counters, "pd_decode_retries")
        if route.prefill is None:  # served whole: the original body serves again
            return raw
        return await prefill_remotely(state, route, path, body, raw, headers)

    return await send_with_failover(state.service, state.proxy, state.first_byte, route, path,
                                    decode_body, headers, stream, on_failure, refreshed)


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
