"""``/v1/responses`` and Anthropic's ``/v1/messages`` through a real router to bundled workers
on 127.0.0.1 (their events over ZeroMQ): routed as the chat request they render as (a
Messages request meets the blocks a chat completion of its conversation left; a Responses
request, tokenized with special tokens as vLLM does, its own earlier turns), and answered in
each API's own shape, streamed or whole, as the worker sent it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.http.app import create_app as create_router
from router.settings import RouterSettings
from tests.router.test_router_service import wait_ready
from tests.support.eventually import eventually
from tests.support.servers import UvicornServer
from workers.http.api import create_app as create_worker
from workers.settings import WorkerSettings

BLOCK = 16
SYSTEM = " ".join(f"rule {i}: answer in the house style" for i in range(60))
QUESTION = "What does rule 7 say?"


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    workers = [create_worker(WorkerSettings(events_port=0, replay_port=0, speedup=1e6,
                                            block_size=BLOCK)) for _ in range(2)]
    async with UvicornServer(workers[0]) as one, UvicornServer(workers[1]) as two:
        router = create_router(RouterSettings(workers=(one.url, two.url), block_size=BLOCK,
                                              health_interval=0.1, seed=3))
        async with UvicornServer(router) as r, \
                httpx.AsyncClient(base_url=r.url, timeout=30) as c:
            await wait_ready(c, 2)
            yield c


async def indexed(client: httpx.AsyncClient, blocks: int) -> None:
    async def enough() -> bool:
        metrics = (await client.get("/metrics")).text
        line = next(x for x in metrics.splitlines() if x.startswith("kvroute_index_blocks "))
        return float(line.split()[1]) >= blocks
    await eventually(enough, "the worker's events at the router")


def events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body's ``(event, data)`` pairs."""
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_chat_conversation_is_found_when_messages_sends_it(client: httpx.AsyncClient
                                                                  ) -> None:
    chat = await client.post("/v1/chat/completions", json={
        "model": "kvroute-sim", "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": QUESTION}]})
    assert chat.status_code == 200, chat.text
    holder = chat.headers["x-kvroute-worker"]
    prompt = chat.json()["usage"]["prompt_tokens"]
    await indexed(client, prompt // BLOCK)

    messages = await client.post("/v1/messages", json={
        "model": "kvroute-sim", "max_tokens": 2,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]})
    assert messages.status_code == 200, messages.text
    answer = messages.json()
    assert answer["type"] == "message" and answer["content"][0]["type"] == "text"
    assert messages.headers["x-kvroute-worker"] == holder
    matched = int(messages.headers["x-kvroute-matched-blocks"])
    assert matched == prompt // BLOCK  # the same prompt: every full block
    usage = answer["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    # The worker reuses every full block but one holding the prompt's last token, which it
    # computes again.
    assert (matched - 1) * BLOCK <= usage["cache_read_input_tokens"] <= matched * BLOCK
    assert answer["stop_reason"] == "max_tokens"


async def test_a_responses_conversation_is_found_when_it_comes_again(
        client: httpx.AsyncClient) -> None:
    body = {"model": "kvroute-sim", "max_output_tokens": 2, "instructions": SYSTEM,
            "input": [{"role": "user",
                       "content": [{"type": "input_text", "text": QUESTION}]}]}
    first = await client.post("/v1/responses", json=body)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message"
    prompt = answer["usage"]["input_tokens"]
    await indexed(client, prompt // BLOCK)
    again = await client.post("/v1/responses", json=body)
    assert again.status_code == 200, again.text
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    matched = int(again.headers["x-kvroute-matched-blocks"])
    assert matched == prompt // BLOCK
    cached = again.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert (matched - 1) * BLOCK <= cached <= matched * BLOCK
    metrics = (await client.get("/metrics")).text
    assert 'kvroute_requests_total{endpoint="/v1/responses",status="200"} 2.0' in metrics


async def test_streams_pass_through_in_each_apis_own_events(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={"model": "kvroute-sim", "input": QUESTION,
                                                 "max_output_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    seen = events(r.text)
    kinds = [k for k, _ in seen]
    assert kinds[:3] == ["response.created", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[3:6] == ["response.output_text.delta"] * 3
    assert kinds[6:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in seen] == list(range(len(seen)))
    deltas = "".join(d["delta"] for k, d in seen if k == "response.output_text.delta")
    completed = seen[-1][1]["response"]
    assert completed["output"][0]["content"][0]["text"] == deltas
    assert completed["usage"]["output_tokens"] == 3

    r = await client.post("/v1/messages", json={
        "model": "kvroute-sim", "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200
    assert [k for k, _ in events(r.text)] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events(r.text)[-2][1]["delta"]["stop_reason"] == "max_tokens"


async def test_a_body_neither_api_can_read_is_a_400_before_any_worker(
        client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={"model": "kvroute-sim", "input": 7})
    assert r.status_code == 400 and "input must be" in r.json()["error"]["message"]
    r = await client.post("/v1/messages", json={"model": "kvroute-sim", "messages": "hi"})
    assert r.status_code == 400 and "messages must be a list" in r.json()["error"]["message"]
    r = await client.post("/v1/messages", json={"model": "nope", "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404


async def test_a_request_continuing_a_stored_response_goes_where_it_was_made(
        client: httpx.AsyncClient) -> None:
    first = await client.post("/v1/responses", json={
        "model": "kvroute-sim", "input": "remember this", "max_output_tokens": 1})
    assert first.status_code == 200
    made_on, made = first.headers["x-kvroute-worker"], first.json()["id"]
    # A long prompt cached on the other worker pulls a request there...
    for seed in range(20):
        document = f"<{seed}> " + SYSTEM
        placed = await client.post("/v1/responses", json={
            "model": "kvroute-sim", "input": document, "max_output_tokens": 1})
        if placed.headers["x-kvroute-worker"] != made_on:
            break
    else:
        raise AssertionError("every prompt went to the first worker")
    prompt = placed.json()["usage"]["input_tokens"]
    await indexed(client, prompt // BLOCK)
    follow = {"model": "kvroute-sim", "input": document + " and more",
              "max_output_tokens": 1}
    elsewhere = await client.post("/v1/responses", json=follow)
    assert elsewhere.headers["x-kvroute-worker"] == placed.headers["x-kvroute-worker"]
    # ...unless it continues a response the first worker made: that worker holds it.
    home = await client.post("/v1/responses", json={**follow, "previous_response_id": made})
    assert home.status_code == 200, home.text
    assert home.headers["x-kvroute-worker"] == made_on
    # An id the router never saw is routed by its prompt.
    unknown = await client.post("/v1/responses",
                                json={**follow, "previous_response_id": "resp_unseen"})
    assert unknown.headers["x-kvroute-worker"] == placed.headers["x-kvroute-worker"]


async def test_the_routers_transfer_fields_are_refused_in_either_api(client: httpx.AsyncClient
                                                                    ) -> None:
    """The body goes upstream as sent, so a client's ``kv_transfer_params`` in it would reach
    the engine: refused as in a chat body, before any worker."""
    for path, body in (("/v1/responses", {"input": QUESTION}),
                       ("/v1/messages", {"max_tokens": 4,
                                         "messages": [{"role": "user", "content": QUESTION}]})):
        answer = await client.post(path, json={**body, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 1}})
        assert answer.status_code == 400, (path, answer.text)
        assert "kv_transfer_params" in answer.text
        assert "x-kvroute-worker" not in answer.headers
