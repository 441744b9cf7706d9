"""SGLang's disaggregated serving: the bootstrap fields, sent to the prefill and the decode
worker at once.

SGLang's own router (``sglang_router``'s PD mode) adds three fields to the request:

- ``bootstrap_host``: the prefill server's host, as its URL names it (an IPv6 address in
  brackets);
- ``bootstrap_port``: the prefill server's ``--disaggregation-bootstrap-port`` (8998 when not
  set; ``bootstrap_port`` in the worker's configuration, :mod:`router.fleet.worker_config`);
- ``bootstrap_room``: a random integer in ``[0, 2**63)``, the one transfer's name, the same
  in both bodies;

and sends the same body to both servers at once: the decode server's answer is the client's;
the prefill server's, which comes when its prefill is done, is read and dropped. The KV goes
from the prefill server to the decode server through the bootstrap server named; none passes
through the router.

Here the prefill step runs beside the decode request (:func:`prefill_alongside` starts it and
returns the decode worker's body at once); the prefill worker's booking ends when its answer
arrives, fails, or ``pd_prefill_timeout`` passes. A prefill that fails is counted
(``pd_prefill_failures``) and logged; the decode worker then fails the request or serves it
as its engine decides, and the failover path treats that as any failed answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from router.http.failover import pinned
from router.http.proxy import UpstreamUnavailable
from router.http.state import RouterState
from router.service import Route

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "bootstrap_fields", "prefill_alongside"]

log = logging.getLogger(__name__)

#: SGLang's ``--disaggregation-bootstrap-port`` default.
DEFAULT_BOOTSTRAP_PORT = 8998
#: The prefill steps still running, held so none is collected before it ends.
_RUNNING: set[asyncio.Task[None]] = set()


def bootstrap_fields(prefill_url: str, port: int | None, room: int) -> dict[str, Any]:
    """The fields SGLang's router adds to a request prefilled on ``prefill_url``, for the
    transfer named ``room``."""
    host = urlsplit(prefill_url).hostname or ""
    return {"bootstrap_host": f"[{host}]" if ":" in host else host,
            "bootstrap_port": DEFAULT_BOOTSTRAP_PORT if port is None else port,
            "bootstrap_room": room}


async def prefill_alongside(state: RouterState, route: Route, path: str, body: dict[str, Any],
                            headers: Mapping[str, str]) -> bytes:
    """Start ``route``'s prefill on its SGLang prefill worker and return the body to send its
    decode worker now: ``body`` with the bootstrap fields, the same bytes the prefill worker
    is sent."""
    worker = route.prefill
    assert worker is not None, "a remote prefill needs its prefill worker"
    config = worker.worker.config
    # From the system's randomness, not the routing seed: router replicas started with the
    # same seed must not name two transfers alike.
    fields = bootstrap_fields(worker.url, config.bootstrap_port if config else None,
                              secrets.randbits(63))
    raw = json.dumps({**body, **fields}).encode()
    booking = state.service.prefill_dispatched(route)
    task = asyncio.get_running_loop().create_task(
        _prefill(state, route, f"{worker.url}{path}", raw, headers, booking),
        name=f"kvroute-prefill-{route.request_id}")
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return raw


async def _prefill(state: RouterState, route: Route, url: str, raw: bytes,
                   headers: Mapping[str, str], booking: str) -> None:
    service = state.service
    worker = route.prefill
    assert worker is not None
    try:
        async with asyncio.timeout(state.settings.pd_prefill_timeout):
            answer = await state.proxy.send(url, raw, pinned(headers, worker),
                                            waits=worker.waits)
            await answer.read()
        if answer.status != 200:
            raise UpstreamUnavailable(f"answered {answer.status}", "status")
        name = "pd_remote_prefills"
    except (UpstreamUnavailable, TimeoutError) as exc:
        name = "pd_prefill_failures"
        log.warning("prefill on %s beside its decode failed (%s) [request %s]", worker.url,
                    exc or "timed out", route.request_id)
    finally:
        service.core.finished(booking)
    service.counters[name] = service.counters.get(name, 0) + 1
