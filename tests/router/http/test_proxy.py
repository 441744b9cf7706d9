"""The proxy against a scripted upstream on 127.0.0.1: what passes through, which failures
are "retry elsewhere" and with which cause, deadlines that a stalled upstream always reaches,
waits the health poll gives up, and a client that leaves closing the upstream."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvroute.up import free_port
from router.fleet.first_byte_waits import FirstByteWaits
from router.http.proxy import Proxy, UpstreamAnswer, UpstreamUnavailable
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, sse_events

BODY = json.dumps({"model": "kvroute-sim", "prompt": "hello", "max_tokens": 4}).encode()
STREAM = json.dumps({"model": "kvroute-sim", "prompt": "hello", "stream": True}).encode()
HEADERS = {"Content-Type": "application/json", "Connection": "keep-alive", "X-Client": "a"}


async def body_of(answer: UpstreamAnswer) -> bytes:
    return b"".join([chunk async for chunk in answer.stream()])


async def test_a_stream_passes_through_chunk_by_chunk(proxy: Proxy) -> None:
    async with ScriptedWorker() as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", STREAM, HEADERS, stream=True)
        assert answer.status == 200 and answer.first_chunk.startswith(b"data: ")
        events = sse_events(await body_of(answer))
    assert events[-1] == "[DONE]" and len(events) == 4
    assert worker.requests == [json.loads(STREAM)]  # the body forwarded as it came
    # hop-by-hop and length headers are the proxy's own, never copied back
    assert answer.headers["Content-Type"] == "text/event-stream"
    assert not {"content-length", "date", "server", "transfer-encoding"} & {
        k.lower() for k in answer.headers}


async def test_a_whole_answer_is_read_once(proxy: Proxy) -> None:
    async with ScriptedWorker() as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", BODY, HEADERS)
        assert answer.status == 200 and answer.first_chunk == b""
        assert json.loads(await answer.read())["choices"][0]["text"] == "ok"


async def test_a_client_error_is_an_answer_passed_back(proxy: Proxy) -> None:
    async with ScriptedWorker("reject") as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", BODY, HEADERS)
        assert answer.status == 400
        assert json.loads(await answer.read())["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("mode", "stream", "cause", "detail"), [
    ("refuse", False, "status", "overloaded"),
    ("refuse", True, "status", "status 503"),
    ("fail_stream", True, "stream_error", "the engine failed the request"),
])
async def test_a_failure_before_the_first_byte_is_retryable_with_its_cause(
        proxy: Proxy, mode: str, stream: bool, cause: str, detail: str) -> None:
    async with ScriptedWorker(mode) as worker:
        with pytest.raises(UpstreamUnavailable) as failed:
            await proxy.send(f"{worker.url}/v1/completions", STREAM if stream else BODY,
                             HEADERS, stream=stream)
    assert failed.value.cause == cause
    assert detail in str(failed.value)


async def test_a_refused_connection_is_retryable(proxy: Proxy) -> None:
    with pytest.raises(UpstreamUnavailable) as failed:
        await proxy.send(f"http://127.0.0.1:{free_port()}/v1/completions", BODY, HEADERS)
    assert failed.value.cause == "connect"


async def test_a_stream_with_no_first_chunk_by_its_deadline_is_retryable(proxy: Proxy) -> None:
    # The stalled upstream sends its headers and never a chunk: the deadline always passes.
    async with ScriptedWorker("stall") as worker:
        with pytest.raises(UpstreamUnavailable) as failed:
            await proxy.send(f"{worker.url}/v1/completions", STREAM, HEADERS, stream=True,
                             first_byte=0.05)
        assert failed.value.cause == "deadline"
        await eventually(worker.cancelled.is_set, "the upstream to see the request dropped")


async def test_the_health_poll_ends_a_wait_at_once(proxy: Proxy) -> None:
    # No deadline of its own but the proxy's ceiling (300 s): only give_up can end it.
    waits = FirstByteWaits()
    async with ScriptedWorker("stall") as worker:
        send = asyncio.create_task(proxy.send(f"{worker.url}/v1/completions", STREAM,
                                              HEADERS, stream=True, waits=waits))
        await eventually(lambda: len(waits) == 1 and bool(worker.requests), "the send waiting")
        assert waits.give_up() == 1
        with pytest.raises(UpstreamUnavailable) as failed:
            await asyncio.wait_for(send, 10)
    assert failed.value.cause == "deadline"
    assert len(waits) == 0 and waits.give_up() == 0


async def test_a_failure_mid_stream_ends_with_an_error_event(proxy: Proxy) -> None:
    async with ScriptedWorker("die_mid_stream") as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", STREAM, HEADERS, stream=True)
        events = sse_events(await body_of(answer))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "upstream_error"
    assert all("choices" in e for e in events[:-2]) and len(events) >= 3


async def test_a_client_that_leaves_closes_the_upstream(proxy: Proxy) -> None:
    async with ScriptedWorker("slow") as worker:
        answer = await proxy.send(f"{worker.url}/v1/completions", STREAM, HEADERS, stream=True)
        chunks = answer.stream()
        assert (await anext(chunks)).startswith(b"data: ")
        await chunks.aclose()  # the client went away after one chunk
        await eventually(worker.cancelled.is_set, "the upstream to see the disconnect")


async def test_a_proxy_sends_only_between_start_and_close() -> None:
    p = Proxy()
    with pytest.raises(RuntimeError, match="not started"):
        await p.send("http://127.0.0.1:9/v1/completions", BODY, HEADERS)
    await p.start()
    await p.close()
    await p.close()  # twice is fine
    with pytest.raises(RuntimeError, match="not started"):
        await p.send("http://127.0.0.1:9/v1/completions", BODY, HEADERS)
