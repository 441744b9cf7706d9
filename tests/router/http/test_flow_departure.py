"""A client that leaves while its request waits in flow control's queue: the request leaves the
queue at once, with nothing booked, counted as ``stage="queue"`` and answered 499.

First in flow control's shell, driven by hand (the fleet, clock and departure futures of
:mod:`tests.router.http.test_flow_gate`'s kind), then through a real router on 127.0.0.1 under
both request cycles (the lean cycle's departure future, uvicorn's ``http.disconnect`` on the
receive channel) and for a long prompt decided before its body ended (its body's pump), with
the only worker's one sequence held by a paced stream the test never ends until the departure
has been seen: nothing but the departure can take the request out.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from httpapi.body import BodyTooLarge
from httpapi.server import LEAN_ENV
from openai_request.tokenizer import load_tokenizer
from router.http.flow import Ask, Departed
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from tests.router.http.test_app_boundary import metric
from tests.router.http.test_early_upstream import body_bytes
from tests.router.http.test_early_upstream import router as early_router
from tests.router.http.test_flow_control import SHORT, body, post, queued, router
from tests.router.http.test_flow_gate import Clock, Fleet, flow_control, settle
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker


def never() -> asyncio.Future[None]:
    raise AssertionError("a request admitted at once asked for the client's departure")


async def test_a_client_that_leaves_while_queued_takes_its_request_out_at_once() -> None:
    clock, fleet = Clock(), Fleet(w1=1)
    flow = flow_control(clock, fleet, urgent_share=0.0)
    first = await flow.admit(fleet.route("first"), Ask(0), departure=never)
    assert first.queued is None  # admitted at once, without a look at its client
    fleet.in_flight[1] += 1  # the only sequence is taken: the next one waits

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(flow.admit(fleet.route("w"), Ask(0), departure=lambda: gone))
    await settle()
    assert len(flow.queue) == 1 and not waiting.done()
    clock.now = 2.5
    gone.set_result(None)  # the client hangs up
    await settle()
    # Out of the queue with no sequence freed, no end seen and no tick of the dispatcher.
    assert waiting.done() and not flow.queue
    with pytest.raises(Departed) as left:
        waiting.result()
    assert (left.value.waited_s, left.value.failure) == (2.5, None)
    assert flow.dispatched == 0 and "w" not in flow.rate._running  # nothing started
    # The sequence frees: nothing waits to take it.
    fleet.end(flow, 1)
    await settle()
    assert fleet.sent == [] and not flow.queue
    await flow.close()


async def test_a_body_failing_while_queued_leaves_with_its_failure() -> None:
    clock, fleet = Clock(), Fleet(w1=1)
    flow = flow_control(clock, fleet, urgent_share=0.0)
    await fleet.send(flow, "first", 0)
    pump: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(flow.admit(fleet.route("w"), Ask(0), departure=lambda: pump))
    await settle()
    too_large = BodyTooLarge(64)
    pump.set_exception(too_large)  # the rest of an early-decided body passed the limit
    with pytest.raises(Departed) as left:
        await waiting
    assert left.value.failure is too_large and not flow.queue
    await flow.close()


async def test_a_cancelled_departure_future_leaves_the_request_waiting() -> None:
    clock, fleet = Clock(), Fleet(w1=1)
    flow = flow_control(clock, fleet, urgent_share=0.0)
    await fleet.send(flow, "first", 0)
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(flow.admit(fleet.route("w"), Ask(0), departure=lambda: gone))
    await settle()
    gone.cancel()  # whoever cancelled it stopped caring: not a departure
    await settle()
    assert len(flow.queue) == 1 and not waiting.done()
    fleet.end(flow, 1)
    route = await waiting
    assert route.queued is not None
    await flow.close()


async def _post_then_hang_up(port: int, payload: dict[str, object],
                             client: httpx.AsyncClient) -> None:
    """POST ``payload`` on a connection of its own, wait (bounded) until the router holds
    it in its queue, then hang up without reading anything."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(payload).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
    await writer.drain()
    await eventually(lambda: queued(client), "the request queued", until=lambda n: n == 1)
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("lean", ["1", "0"])
async def test_a_client_that_hangs_up_in_the_queue_is_counted_and_its_request_dropped(
        lean: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEAN_ENV, lean)
    async with ScriptedWorker("paced") as w, router(w) as client:
        port = client.base_url.port
        assert port is not None
        # One SHORT prompt (0.224 s of prefill) saturates the only worker, and its stream is
        # held until the test ends it: the next request waits in the router.
        held = asyncio.create_task(post(client, body("held", SHORT)))
        await eventually(lambda: len(w.requests), "the first request sent")
        assert await metric(client, "kvroute_client_disconnects_total", 'stage="queue"') == 0
        await _post_then_hang_up(port, body("leaves", SHORT), client)
        # Nothing freed the worker: only the departure can have emptied the queue.
        await eventually(lambda: metric(client, "kvroute_client_disconnects_total",
                                        'stage="queue"'), "the departure counted",
                         until=lambda n: n == 1)
        assert await queued(client) == 0
        assert [r["prompt"][:8] for r in w.requests] == ["<held>xx"]  # never sent
        w.finish()
        assert (await held).status_code == 200
        # Nothing was booked for it: the fleet is idle again, and the next request goes.
        text = (await client.get("/metrics")).text
        assert re.findall(r"^kvroute_requests_in_flight\{.*\} (\S+)$", text, re.M) == ["0.0"]
        w.finish()
        assert (await post(client, body("next", SHORT))).status_code == 200
        assert len(w.requests) == 2


async def test_a_client_leaving_mid_body_while_its_early_decided_request_waits(
        tmp_path: Path) -> None:
    # A long prompt decided before its body ends waits in the queue (the only worker runs
    # its one sequence); its body's pump watches the client there, so a client that hangs
    # up mid-body takes it out of the queue at once.
    tokenizer = str(write_tiny_tokenizer(tmp_path).parent)
    identity = load_tokenizer(tokenizer).identity
    async with ScriptedWorker("paced", tokenizer=identity, max_model_len=1_000_000,
                              max_num_seqs=1) as w, \
            early_router(tokenizer, w) as (server, client):
        held = asyncio.create_task(post(client, body("held", SHORT)))
        await eventually(lambda: len(w.requests), "the first request sent")
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        first = body_bytes()[:20_000]
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        await eventually(lambda: queued(client), "the early-decided request queued",
                         until=lambda n: n == 1)
        writer.close()
        await eventually(lambda: metric(client, "kvroute_client_disconnects_total",
                                        'stage="queue"'), "the departure counted",
                         until=lambda n: n == 1)
        assert await queued(client) == 0
        assert await metric(client, "kvroute_client_disconnects_total", 'stage="body"') == 0
        assert len(w.requests) == 1 and w.bodies[1:] == []
        w.finish()
        assert (await held).status_code == 200
