"""A flood of low-priority long chats and a few high-priority short ones through a router with
flow control's DEFAULT settings, in front of real engines: two sim workers (each running 8
sequences at most); ``e2e/test_vllm_flow_flood.py`` runs it in front of two stock vLLM CPU
servers.

What must hold, whatever the machine's speed: every request is answered (served, or refused
with 429 and a ``Retry-After``, or 503), none runs into the client's timeout; every
high-priority request is served; and the high-priority ones jump the router's queue: each
joined it behind lows already waiting, with none of them ahead of it (its answer's
``x-kvroute-queue-*`` headers), while the lows wait behind one another.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from e2e.harness import metric
from tests.support.eventually import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: A client's patience, in seconds: no request may run into it.
CLIENT_TIMEOUT = 120.0

_WORDS = ("cache", "router", "block", "prefix", "engine", "token", "worker", "model", "alpha",
          "kilo", "mira", "sola", "tavi", "zeta", "bravo", "lumen")


def chat(rng: random.Random, model: str, words: int, max_tokens: int, priority: int
         ) -> dict[str, Any]:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "priority": priority, "stream": True}


async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    """One chat, its stream read to the end (a timeout or a broken stream raises)."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        await answer.aread()
    return answer


async def flood(url: str, model: str, lows: int, highs: int, low_words: int,
                low_tokens: int) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """Send ``lows`` long chats at once; once some wait in the router, ``highs`` short ones.
    Returns the answers of each."""
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT,
                                 limits=httpx.Limits(max_connections=None)) as client:
        low = [asyncio.create_task(send(client, chat(rng, model, low_words, low_tokens, 10)))
               for _ in range(lows)]

        async def queued() -> float:
            return metric((await client.get("/metrics")).text, "kvroute_flow_queued",
                          priority="10", tenant="other")

        await eventually(queued, "lows waiting in the router", 60.0, until=lambda n: n > 0)
        high = [asyncio.create_task(send(client, chat(rng, model, 8, 4, 0)))
                for _ in range(highs)]
        return list(await asyncio.gather(*low)), list(await asyncio.gather(*high))


def check(low: list[httpx.Response], high: list[httpx.Response]) -> None:
    """The flood's outcome (module docstring)."""
    for answer in low + high:
        assert answer.status_code in (200, 429, 503), (answer.status_code, answer.text)
        if answer.status_code == 429:
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["code"] in ("deadline_unmeetable", "queue_full",
                                                     "queue_timeout")
    assert [a.status_code for a in high] == [200] * len(high)
    for answer in high:
        # It waited in the router's queue (lows were waiting) with no low ahead of it: at
        # most the highs that joined before it.
        assert "x-kvroute-queue-length" in answer.headers, dict(answer.headers)
        ahead = int(answer.headers["x-kvroute-queue-ahead"])
        length = int(answer.headers["x-kvroute-queue-length"])
        assert ahead < len(high) and length > ahead, (ahead, length)
    waited = [a for a in low if a.status_code == 200 and "x-kvroute-queue-length" in a.headers]
    assert waited, "no low-priority request waited in the router"
    # A low joined behind every request waiting then (FIFO within its band, one tenant).
    assert all(int(a.headers["x-kvroute-queue-ahead"]) == int(a.headers["x-kvroute-queue-length"])
               for a in waited)


def test_a_low_priority_flood_on_sim_workers_is_answered_and_the_urgent_pass_it(
        cluster: Callable[..., Any]) -> None:
    # At speedup 2 the 120 lows hold the 14 sequences open to them for several seconds, so
    # lows still wait when the highs come (at speedup 20 they drained in about a second, and a
    # high sent after the first look at the queue could find it empty and go at once).
    router, _ = cluster(workers=2, worker_settings={"speedup": 2, "max_num_seqs": 8})
    low, high = asyncio.run(flood(router.url, "kvroute-sim", lows=120, highs=10,
                                  low_words=300, low_tokens=200))
    check(low, high)
    served = sum(a.status_code == 200 for a in low)
    assert served >= 16  # at least the sequences the two workers run at once
    text = router.client.get("/metrics").text
    assert metric(text, "kvroute_flow_queued", priority="10", tenant="other") == 0
