"""Peer KV fetch between two sim worker apps in one process: a request carrying a trusted
fetch instruction takes the prompt's blocks it lacks from the holder before it runs (and
finds them cached), skips what it holds; every failure (untrusted or malformed instruction,
holder unreachable, refusing, answering garbage or nothing, too slow, too few free blocks)
is counted, logged once per reason, named in ``x-kvroute-fetch-result``, and the request is
answered all the same; the secret goes only where an authenticated request sent it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.support.eventually import eventually
from tests.workers.http.test_kv_read import (
    PROMPT,
    SECRET,
    complete,
    keys,
    metric,
    prompt_of,
    sim_settings,
    state,
    worker,
)
from workers.cache.block_keys import Prompt
from workers.http.kv_fetch import FetchInstruction, parse_instruction
from workers.settings import WorkerSettings

SOURCE = "http://127.0.0.1:8102"
BLOCK_BYTES = 4 * 131072  # block size 4 at the default kv_bytes_per_token
FULL = 6  # PROMPT's full blocks


def instruction(blocks: int = FULL, source: str = SOURCE, token: str | None = None
                ) -> dict[str, str]:
    headers = {"x-kvroute-fetch-source": source, "x-kvroute-fetch-blocks": str(blocks)}
    return headers | ({"x-kvroute-transfer-token": token} if token else {})


@contextlib.asynccontextmanager
async def receiver(settings: WorkerSettings, peer: httpx.AsyncBaseTransport,
                   client_host: str = "127.0.0.1") -> AsyncIterator[httpx.AsyncClient]:
    """A worker whose peer fetches go through ``peer``."""
    async with worker(settings, client_host) as client:
        fetcher = state(client).fetcher
        await fetcher.http.aclose()
        fetcher.http = httpx.AsyncClient(transport=peer)
        yield client


class Recorder(httpx.AsyncBaseTransport):
    """A peer transport that records each request and answers with ``answer``."""

    def __init__(self, answer: Callable[[httpx.Request], Any]) -> None:
        self.requests: list[httpx.Request] = []
        self._answer = answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        result = self._answer(request)
        if asyncio.iscoroutine(result):
            result = await result
        assert isinstance(result, httpx.Response)
        return result


def cached_tokens(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_trusted_instruction_fetches_the_blocks_and_the_request_finds_them() -> None:
    async with worker(sim_settings()) as holder:
        await complete(holder, PROMPT)
        peer = Recorder(lambda r: httpx.ASGITransport(holder.app)  # type: ignore[attr-defined]
                        .handle_async_request(r))
        async with receiver(sim_settings(), peer) as d:
            answer = await complete(d, PROMPT, headers=instruction())
            result = answer.headers["x-kvroute-fetch-result"]
            assert result.startswith(f"blocks={FULL};bytes={FULL * BLOCK_BYTES};seconds=")
            assert cached_tokens(answer) == FULL * 4
            # It asked for the prompt's keys, in order, at the holder's read endpoint.
            sent = peer.requests[0]
            assert sent.url == f"{SOURCE}/kv_transfer/read"
            assert json.loads(sent.content) == {"block_keys": keys(d, PROMPT)}
            assert "authorization" not in sent.headers  # no secret, nothing to send
            text = (await d.get("/metrics")).text
            assert metric(text, 'kvroute_worker_kv_fetch_total{outcome="fetched"}') == 1
            assert metric(text, "kvroute_worker_kv_fetch_blocks_total") == FULL
            assert metric(text, "kvroute_worker_kv_fetch_seconds_count") == 1
            # The received blocks went out as stored facts, as computed ones do.
            assert metric(text, "kvroute_worker_events_stored") >= 1
            # A second request: every named block is here now, nothing is asked.
            again = await complete(d, PROMPT, headers=instruction())
            assert again.headers["x-kvroute-fetch-result"] == "blocks=0;bytes=0;seconds=0.000000"
            assert len(peer.requests) == 1
            text = (await d.get("/metrics")).text
            assert metric(text, 'kvroute_worker_kv_fetch_total{outcome="skipped"}') == 1


async def test_the_receiver_asks_only_for_the_blocks_past_its_own_hit() -> None:
    async with worker(sim_settings()) as holder:
        await complete(holder, PROMPT)
        peer = Recorder(lambda r: httpx.ASGITransport(holder.app)  # type: ignore[attr-defined]
                        .handle_async_request(r))
        async with receiver(sim_settings(), peer) as d:
            await complete(d, PROMPT[:11] + "X" * 13)  # D holds the first 3 blocks
            answer = await complete(d, PROMPT, headers=instruction(blocks=5))
            # The router believed S holds 5: D asks for blocks 3 and 4 only.
            assert json.loads(peer.requests[0].content) == {"block_keys": keys(d, PROMPT)[3:5]}
            assert answer.headers["x-kvroute-fetch-result"].startswith(
                f"blocks=2;bytes={2 * BLOCK_BYTES};")
            assert cached_tokens(answer) == 5 * 4


def _refusing(status: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda r: httpx.Response(status, json={"error": {"message": "no"}})


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def _never(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("answer", "reason"), [
    (_unreachable, "unreachable"),
    (_refusing(500), "status_500"),
    (_refusing(503), "status_503"),
    (lambda r: httpx.Response(200, content=b"not json"), "bad_message"),
    (lambda r: httpx.Response(200, json={"blocks": FULL + 1}), "bad_message"),
    (lambda r: httpx.Response(200, content=b"x" * 5000), "bad_message"),
    (lambda r: httpx.Response(200, json={"blocks": 0}), "missing"),
    (_never, "timeout"),
])
async def test_a_failed_fetch_is_counted_logged_once_and_the_request_computes_its_prompt(
        answer: Callable[[httpx.Request], Any], reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    peer = Recorder(answer)
    async with receiver(sim_settings(kv_fetch_timeout=0.05), peer) as d:
        for _ in range(2):
            served = await complete(d, f"{_}{PROMPT}", headers=instruction())
            assert served.headers["x-kvroute-fetch-result"] == f"failed;reason={reason}"
            assert cached_tokens(served) == 0
        assert len(peer.requests) == 2
        text = (await d.get("/metrics")).text
        assert metric(text, 'kvroute_worker_kv_fetch_total{outcome="failed"}') == 2
        assert metric(text, "kvroute_worker_kv_fetch_blocks_total") == 0
        # Nothing was left allocated or pinned by the failed fetches.
        assert state(d).runtime.engine.load()["kv_usage"] == 0
    logged = [r for r in caplog.records if "peer KV fetch failed" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0].getMessage()


async def test_too_few_free_blocks_fails_the_fetch_and_writes_nothing() -> None:
    async with worker(sim_settings()) as holder:
        await complete(holder, PROMPT)
        peer = Recorder(lambda r: httpx.ASGITransport(holder.app)  # type: ignore[attr-defined]
                        .handle_async_request(r))
        async with receiver(sim_settings(num_blocks=16), peer) as d:
            engine = state(d).runtime.engine
            # Another request holds 12 of the 16 blocks: the prompt's 7 do not fit.
            assert engine.cache.allocate("hog", Prompt(tuple(range(1, 48)))) is not None
            result = await state(d).fetcher.fetch(
                engine, prompt_of(d, PROMPT), FetchInstruction(SOURCE, FULL), {})
            assert result.failure == "no_free_blocks"
            assert len(peer.requests) == 1
            named = [bytes.fromhex(k) for k in keys(d, PROMPT)]
            assert engine.cache.cached_run(named) == 0
            engine.cache.free("hog")
            # With the blocks back, the same fetch takes them.
            result = await state(d).fetcher.fetch(
                engine, prompt_of(d, PROMPT), FetchInstruction(SOURCE, FULL), {})
            assert (result.blocks, result.failure) == (FULL, None)
            assert engine.cache.cached_run(named) == FULL


@pytest.mark.parametrize(("settings", "client_host", "headers", "why"), [
    # With a secret: the router's token must come with the instruction.
    ({"kv_transfer_secret": SECRET}, "127.0.0.1", instruction(), "no token"),
    ({"kv_transfer_secret": SECRET}, "127.0.0.1", instruction(token=SECRET + "x"), "wrong"),
    # Without one: the caller and the source must be loopback.
    ({}, "10.0.0.7", instruction(), "caller off loopback"),
    ({}, "127.0.0.1", instruction(source="http://10.0.0.8:8100"), "source off loopback"),
    # Bound off loopback with no secret: no instruction is followed.
    ({"host": "0.0.0.0", "admin_token": "admin-token"}, "127.0.0.1", instruction(), "off"),
])
async def test_an_untrusted_instruction_is_not_followed(
        settings: dict[str, Any], client_host: str, headers: dict[str, str], why: str) -> None:
    peer = Recorder(_refusing(500))
    async with receiver(sim_settings(**settings), peer, client_host) as d:
        served = await complete(d, PROMPT, headers=headers)
        assert served.headers["x-kvroute-fetch-result"] == "failed;reason=untrusted", why
    assert peer.requests == []  # no connection to the named source, no secret sent


async def test_with_a_secret_the_receiver_sends_it_only_to_an_authenticated_source() -> None:
    secret = {"kv_transfer_secret": SECRET, "host": "10.1.2.3", "admin_token": "admin-token"}
    async with worker(sim_settings(**secret), client_host="10.1.2.4") as holder:
        await complete(holder, PROMPT)
        peer = Recorder(lambda r: httpx.ASGITransport(  # type: ignore[attr-defined]
            holder.app, client=("10.1.2.5", 1)).handle_async_request(r))
        async with receiver(sim_settings(**secret), peer, client_host="10.1.2.6") as d:
            answer = await complete(d, PROMPT, headers=instruction(
                source="http://10.1.2.3:8100", token=SECRET))
            assert answer.headers["x-kvroute-fetch-result"].startswith(f"blocks={FULL};")
            assert peer.requests[0].headers["authorization"] == f"Bearer {SECRET}"


async def test_a_holder_with_another_secret_refuses_and_the_request_is_served() -> None:
    other = "another-secret-sixteen"
    async with worker(sim_settings(kv_transfer_secret=other)) as holder:
        await complete(holder, PROMPT)
        peer = Recorder(lambda r: httpx.ASGITransport(holder.app)  # type: ignore[attr-defined]
                        .handle_async_request(r))
        async with receiver(sim_settings(kv_transfer_secret=SECRET), peer) as d:
            answer = await complete(d, PROMPT, headers=instruction(token=SECRET))
            assert answer.headers["x-kvroute-fetch-result"] == "failed;reason=status_401"
            assert cached_tokens(answer) == 0


async def test_the_pd_release_carries_the_secret_only_for_an_authenticated_request() -> None:
    released = Recorder(lambda r: httpx.Response(200, json={"released": True}))
    params = {"do_remote_prefill": True, "remote_block_ids": [0, 1],
              "remote_request_id": "lease-1", "remote_host": "10.6.6.6", "remote_port": 8100}
    async with worker(sim_settings(kv_transfer_secret=SECRET)) as d:
        peers = state(d).peers
        await peers.aclose()
        state(d).peers = httpx.AsyncClient(transport=released)
        await complete(d, PROMPT, kv_transfer_params=params)
        await complete(d, PROMPT, headers={"x-kvroute-transfer-token": SECRET},
                       kv_transfer_params=params)
    anonymous, routed = released.requests
    assert str(anonymous.url) == "http://10.6.6.6:8100/kv_transfer/release"
    assert "authorization" not in anonymous.headers
    assert routed.headers["authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize("headers", [
    {"x-kvroute-fetch-source": SOURCE},
    {"x-kvroute-fetch-blocks": "3"},
    instruction(blocks=0),
    {"x-kvroute-fetch-source": SOURCE, "x-kvroute-fetch-blocks": "many"},
    instruction(source="ftp://127.0.0.1:1"),
    instruction(source="http://127.0.0.1:8102/v1/completions"),
    instruction(source="http://user@127.0.0.1:8102"),
    instruction(source="http://127.0.0.1:port"),
])
async def test_a_malformed_instruction_is_refused_and_the_request_served(
        headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        parse_instruction(headers)
    peer = Recorder(_refusing(500))
    async with receiver(sim_settings(), peer) as d:
        served = await complete(d, PROMPT, headers=headers)
        assert served.headers["x-kvroute-fetch-result"] == "failed;reason=bad_instruction"
    assert peer.requests == []


def test_an_instruction_names_a_base_url_and_a_count() -> None:
    assert parse_instruction({}) is None
    assert parse_instruction(instruction(blocks=7, source="http://127.0.0.1:8102/")) == \
        FetchInstruction("http://127.0.0.1:8102", 7)


async def test_fetches_past_the_cap_wait_for_a_slot_without_contacting_the_source() -> None:
    release = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return httpx.Response(200, json={"blocks": 0})

    peer = Recorder(slow)
    async with receiver(sim_settings(kv_fetch_concurrency=1), peer) as d:
        fetcher = state(d).fetcher
        first = asyncio.create_task(complete(d, PROMPT, headers=instruction()))
        await eventually(lambda: fetcher.running == 1, "the first fetch to hold the slot")
        second = asyncio.create_task(complete(d, f"2{PROMPT}", headers=instruction()))
        await eventually(lambda: fetcher.waiting == 1, "the second fetch to wait")
        assert len(peer.requests) == 1  # the second has not contacted the source
        release.set()
        answers = await asyncio.gather(first, second)
        assert len(peer.requests) == 2
        assert [a.headers["x-kvroute-fetch-result"] for a in answers] == [
            "failed;reason=missing"] * 2
        assert (fetcher.running, fetcher.waiting) == (0, 0)


async def test_an_unexpected_error_in_a_fetch_is_logged_and_the_request_served(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug")

    async with receiver(sim_settings(), Recorder(broken)) as d:
        served = await complete(d, PROMPT, headers=instruction())
        assert served.headers["x-kvroute-fetch-result"] == "failed;reason=error"
    assert any("failed unexpectedly" in r.getMessage() and r.exc_info for r in caplog.records)
