"""Client API keys and their tokens per minute: the check on an injected clock, then a real
router on 127.0.0.1 in front of a scripted worker (401 before the body, 429 with a computed
Retry-After and an OpenAI-style body, metrics by key name)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from httpapi.api_keys import KeyRing, hash_line, parse_keys
from openai_request.bodies import ApiError
from router.http.app import create_app
from router.http.client_quotas import ClientAccess, KeyCheck, RateLimited
from router.settings import RouterSettings, SettingsError, load_settings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer

KEYS = "\n".join([hash_line("sk-alice", "alice", 600), hash_line("sk-bob", "bob", 0),
                  hash_line("sk-anon")])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def access(default_tpm: int = 60, clock: Clock | None = None) -> ClientAccess:
    return ClientAccess(KeyRing(parse_keys(KEYS)), default_tpm, CollectorRegistry(),
                        clock or Clock())


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_each_key_draws_on_its_own_bucket_and_is_told_when_to_come_back() -> None:
    clock = Clock()
    gate = access(clock=clock)
    assert gate.charge(bearer("sk-alice"), 500).name == "alice"  # 600 a minute: 100 left
    with pytest.raises(RateLimited) as caught:
        gate.charge(bearer("sk-alice"), 250)  # 150 short at 10 a second
    error = caught.value
    assert (error.status, error.kind, error.code) == (429, "tokens", "rate_limit_exceeded")
    assert error.headers == {"retry-after": "15", "x-ratelimit-limit-tokens": "600",
                             "x-ratelimit-remaining-tokens": "100",
                             "x-ratelimit-reset-tokens": "15s"}
    assert "Please try again in 15s" in error.message and "sk-alice" not in error.message
    clock.now += 14.5  # 245 held: half a second short, told 1 s
    with pytest.raises(RateLimited) as caught:
        gate.charge(bearer("sk-alice"), 250)
    assert caught.value.headers["retry-after"] == "1"
    clock.now += 0.5
    gate.charge(bearer("sk-alice"), 250)
    # The key without a tpm= has the default, 60; bob's tpm=0 has no limit.
    gate.charge(bearer("sk-anon"), 60)
    with pytest.raises(RateLimited):
        gate.charge(bearer("sk-anon"), 1)
    gate.charge(bearer("sk-bob"), 10**9)


def test_a_prompt_larger_than_a_minute_of_quota_gets_no_retry_after() -> None:
    gate = access()
    with pytest.raises(RateLimited) as caught:
        gate.charge(bearer("sk-alice"), 601)
    assert "retry-after" not in caught.value.headers
    assert "Request too large" in caught.value.message
    gate.charge(bearer("sk-alice"), 600)  # nothing was taken


async def test_a_request_decided_twice_is_charged_once() -> None:
    # A body decided early and refused there is decided again at its end: one charge.
    gate = access()
    taken = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        for _ in range(2):
            taken.append(gate.charge(bearer("sk-alice"), 400).name)

    check = KeyCheck(app, lambda: gate)
    await check({"type": "http", "headers": [(b"authorization", b"Bearer sk-alice")]},
                None, None)  # type: ignore[arg-type]
    assert taken == ["alice", "alice"]
    assert gate.tokens.labels("alice").value == 400
    # The next request is charged afresh: 200 of 600 are left.
    with pytest.raises(RateLimited):
        await check({"type": "http", "headers": [(b"authorization", b"Bearer sk-alice")]},
                    None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("headers", "reason"), [({}, "missing"),
                                                 (bearer("sk-mallory"), "unknown"),
                                                 ({"authorization": "Basic c2s="}, "missing")])
def test_no_key_or_an_unknown_one_is_401(headers: dict[str, str], reason: str) -> None:
    gate = access()
    with pytest.raises(ApiError) as caught:
        gate.charge(headers, 1)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    assert gate.unauthorized.labels(reason).value == 1


def test_metrics_name_the_key_by_its_name_or_other_never_the_key() -> None:
    registry = CollectorRegistry()
    gate = ClientAccess(KeyRing(parse_keys(KEYS)), 60, registry, Clock())
    gate.charge(bearer("sk-alice"), 100)
    gate.charge({"x-api-key": "sk-anon"}, 50)
    with pytest.raises(RateLimited):
        gate.charge(bearer("sk-anon"), 50)
    text = generate_latest(registry).decode()
    assert 'kvroute_api_key_prompt_tokens_total{key="alice"} 100.0' in text
    assert 'kvroute_api_key_prompt_tokens_total{key="other"} 50.0' in text
    assert 'kvroute_api_key_requests_total{key="other",outcome="rate_limited"} 1.0' in text
    assert "sk-" not in text


def test_settings_read_the_keys_file_once_and_refuse_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(KEYS + "\n")
    settings = load_settings({"api_keys_file": str(path)}, env={})
    ring = settings.client_key_ring()
    assert ring is not None and [k.label for k in ring.keys] == ["alice", "bob", "other"]
    assert "sha256$" not in repr(settings)
    env = load_settings({}, env={"KVROUTE_API_KEYS": hash_line("k", "k")})
    assert env.client_key_ring() is not None
    assert RouterSettings().client_key_ring() is None
    path.write_text("sk-alice\n")
    with pytest.raises(SettingsError, match=f"{path}, line 1"):
        load_settings({"api_keys_file": str(path)}, env={})
    with pytest.raises(SettingsError, match="No such file"):
        load_settings({"api_keys_file": str(tmp_path / "missing")}, env={})
    with pytest.raises(SettingsError, match="api_key_tokens_per_minute"):
        RouterSettings(api_key_tokens_per_minute=-1)


@contextlib.asynccontextmanager
async def router(worker: ScriptedWorker, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(workers=(worker.url,), health_interval=0.1, seed=3,
                              api_keys=KEYS, **kw)
    async with UvicornServer(create_app(settings)) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await eventually(lambda: client.get("/ready"), "the worker ready",
                         until=lambda r: r.status_code == 200)
        yield client


def completion(size: int) -> dict[str, Any]:
    return {"model": "kvroute-sim", "prompt": "x" * size, "max_tokens": 1}


async def test_the_router_checks_keys_and_quotas_on_v1() -> None:
    async with ScriptedWorker() as worker, router(worker, api_key_tokens_per_minute=60) as c:
        # No key: 401 before the body reaches any worker, OpenAI-style.
        r = await c.post("/v1/completions", json=completion(10))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", headers=bearer("sk-nobody"),
                         json={"model": "kvroute-sim", "messages": []})
        assert r.status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        assert worker.requests == []
        models = await c.get("/v1/models", headers={"x-api-key": "sk-alice"})
        assert models.status_code == 200
        # The default key's 60 tokens a minute: 40 bytes and the BOS, 41 tokens, pass; 41 more
        # are 22 short at 1 a second.
        r = await c.post("/v1/completions", headers=bearer("sk-anon"), json=completion(40))
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", headers=bearer("sk-anon"), json=completion(40))
        assert r.status_code == 429
        assert 1 <= int(r.headers["retry-after"]) <= 22
        assert r.json()["error"]["type"] == "tokens"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert len(worker.requests) == 1
        # Another key's bucket is its own.
        r = await c.post("/v1/completions", headers=bearer("sk-alice"), json=completion(400))
        assert r.status_code == 200
        metrics = (await c.get("/metrics")).text
        assert 'kvroute_api_key_requests_total{key="other",outcome="rate_limited"} 1.0' in metrics
        assert 'kvroute_api_key_prompt_tokens_total{key="other"} 41.0' in metrics
        assert 'kvroute_api_key_unauthorized_total{reason="missing"}' in metrics
        assert 'kvroute_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics


async def test_without_keys_v1_stays_open() -> None:
    async with ScriptedWorker() as worker:
        settings = RouterSettings(workers=(worker.url,), health_interval=0.1, seed=3)
        async with UvicornServer(create_app(settings)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            await eventually(lambda: c.get("/ready"), "the worker ready",
                             until=lambda r: r.status_code == 200)
            assert (await c.post("/v1/completions", json=completion(10))).status_code == 200
            assert "kvroute_api_key" not in (await c.get("/metrics")).text
