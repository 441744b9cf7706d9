"""A body that repeats a key never reaches a worker, against real sockets on 127.0.0.1: a
buffered body is refused (400) before any worker sees it, and a long body decided before its
end whose ``model`` repeats after the prompt (the early decision read the first, vLLM would
serve the last) is refused once whole, its upstream request never completed."""

from __future__ import annotations

import json

from tests.router.http.test_app_boundary import router
from tests.router.http.test_early_upstream import PROMPT, parts, scripted
from tests.router.http.test_early_upstream import router as early_router
from tests.router.http.test_early_upstream import tokenizer as tokenizer  # the fixture
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker


async def test_a_buffered_body_with_a_repeated_model_is_refused() -> None:
    raw = b'{"model": "kvroute-sim", "prompt": "hi", "max_tokens": 2, "model": "other"}'
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        answer = await client.post("/v1/completions", content=raw,
                                   headers={"content-type": "application/json"})
        chat = await client.post("/v1/chat/completions", content=(
            b'{"model": "kvroute-sim", "messages": [{"role": "user", "content": "a",'
            b' "content": "b"}]}'), headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert "'model'" in answer.json()["error"]["message"]
    assert chat.status_code == 400, chat.text
    assert worker.requests == []


async def test_a_model_repeated_after_an_early_decided_prompt_is_refused(tokenizer: str
                                                                         ) -> None:
    head = json.dumps({"model": "kvroute-sim", "max_tokens": 4, "prompt": PROMPT})
    body = (head[:-1] + ', "model": "another-model"}').encode()
    async with scripted(tokenizer) as worker, early_router(tokenizer, worker) as (_, client):
        answer = await client.post("/v1/completions", content=parts(body, 20_000, worker),
                                   headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        await eventually(lambda: worker.cancelled.is_set() or not worker.bodies,
                         "the worker's request ended")
        assert worker.bodies == []
