"""Envoy + kvroute's endpoint picker in front of sim workers: the gateway path, for real.

Each request goes client -> Envoy -> (ext_proc) kvroute epp -> Envoy's original-destination
cluster -> the worker the EPP named. Envoy's ``x-kvroute-worker`` response header (its
upstream address) says which worker answered; the worker's ``cached_tokens`` says whether the
prefix was there.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.envoy import envoy_binary
from e2e.gateway import Envoy, Epp
from e2e.harness import NOT_YET, Process, Worker
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from tests.support.eventually import eventually_blocking
from tests.support.servers import sse_events

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")]

SYSTEM = "You are a careful assistant. Answer briefly and cite the source. " * 8  # 520 bytes


@dataclass
class Gateway:
    workers: list[Worker]
    epps: list[Epp]
    envoys: list[Envoy]

    def address(self, worker: Worker) -> str:
        return f"127.0.0.1:{worker.port}"


@pytest.fixture
def gateway(tmp_path: Path, processes: list[Process]) -> Callable[..., Gateway]:
    """Factory: ``gateway(workers=3, replicas=1)`` starts the workers, one EPP per replica and
    one Envoy in front of each EPP; everything is killed at the end, logs printed on
    failure."""

    def make(workers: int = 3, replicas: int = 1, full_duplex: bool = False,
             epp: dict[str, Any] | None = None, **worker_settings: Any) -> Gateway:
        ws = [Worker(i, tmp_path, **worker_settings) for i in range(workers)]
        for w in ws:
            w.start()
            processes.append(w)
        for w in ws:
            w.wait_healthy()
        epps = [Epp(f"epp-{i}", ws, tmp_path, seed=i, **(epp or {})) for i in range(replicas)]
        for e in epps:
            e.start()
            processes.append(e)
        envoys = [Envoy(f"envoy-{i}", e, tmp_path, full_duplex)
                  for i, e in enumerate(epps)]
        for v in envoys:
            v.start()
            processes.append(v)
        for e in epps:
            e.wait_ready()
        for v in envoys:
            v.wait_ready()
        return Gateway(ws, epps, envoys)

    return make


def _cached(response: Any) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_repeats_go_to_the_holder_and_hit_its_cache(gateway: Callable[..., Gateway]) -> None:
    gw = gateway()
    envoy = gw.envoys[0]
    first = envoy.complete(SYSTEM + "Question one?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    assert holder in {gw.address(w) for w in gw.workers}
    assert _cached(first) == 0
    for follow in ("Question two, a different one?", "Question three?"):
        again = envoy.complete(SYSTEM + follow)
        assert again.status_code == 200
        assert again.headers["x-kvroute-worker"] == holder
        assert _cached(again) == (len(SYSTEM.encode()) // 32) * 32


def test_full_duplex_streamed_bodies_are_routed_the_same_way(
        gateway: Callable[..., Gateway]) -> None:
    gw = gateway(workers=2, full_duplex=True)
    envoy = gw.envoys[0]
    raw = json.dumps({"model": "kvroute-sim", "prompt": SYSTEM + "Question one?",
                      "max_tokens": 4}).encode()

    def pieces() -> Iterator[bytes]:  # chunked upload: the EPP gets the body in parts
        yield from (raw[i:i + 100] for i in range(0, len(raw), 100))

    first = envoy.client.post("/v1/completions", content=pieces(),
                              headers={"content-type": "application/json"})
    assert first.status_code == 200, first.text
    again = envoy.complete(SYSTEM + "Question two?")
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert _cached(again) == (len(SYSTEM.encode()) // 32) * 32
    bad = envoy.client.post("/v1/completions", content=b"[1, 2]",
                            headers={"content-type": "application/json"})
    assert bad.status_code == 400


def test_full_duplex_decides_before_the_body_ends(gateway: Callable[..., Gateway],
                                                  tmp_path: Path) -> None:
    # A BPE tokenizer (the byte-level one has no walk): the EPP tokenizes a first-time
    # prompt only past its first block, decides, and Envoy opens the upstream request while
    # the client still holds half the body back; every byte then reaches the worker.
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    write_tiny_tokenizer(folder)
    gw = gateway(workers=2, full_duplex=True, tokenizer=str(folder),
                 epp={"tokenizer": str(folder), "tokenize": "match"})
    envoy = gw.envoys[0]
    # ~58 KB: ~50k tokens of the tiny tokenizer, inside the sim's model length
    prompt = " ".join(f"a gateway streams part {i} of one long document" for i in range(1200))
    raw = json.dumps({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}).encode()
    half = len(raw) // 2

    def upstream_requests() -> int:
        stats = httpx.get(f"http://127.0.0.1:{envoy.admin_port}/stats?filter="
                          "upstream_rq_total", timeout=5).text
        return sum(int(line.rsplit(" ", 1)[-1]) for line in stats.splitlines()
                   if line.startswith("cluster.kvroute_workers."))

    def pieces() -> Iterator[bytes]:
        yield from (raw[i:i + 8192] for i in range(0, half, 8192))
        eventually_blocking(upstream_requests, "the upstream request before the body's end",
                            timeout=30)
        yield from (raw[i:i + 8192] for i in range(half + -half % 8192, len(raw), 8192))

    first = envoy.client.post("/v1/completions", content=pieces(),
                              headers={"content-type": "application/json"})
    assert first.status_code == 200, first.text
    tokens = first.json()["usage"]["prompt_tokens"]
    assert tokens > 0.9 * len(prompt) / 5  # the worker read the whole prompt
    again = envoy.client.post("/v1/completions", content=raw,
                              headers={"content-type": "application/json"})
    assert again.status_code == 200
    assert again.json()["usage"]["prompt_tokens"] == tokens
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert _cached(again) >= tokens // 32 * 32 - 32


def test_concurrent_first_requests_spread_over_the_workers(
        gateway: Callable[..., Gateway]) -> None:
    gw = gateway()
    envoy = gw.envoys[0]
    # Three distinct prompts at once, each decoding long enough to overlap the others: the
    # EPP's load books send them to three different workers.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: envoy.complete(f"{i} distinct " * 40, max_tokens=48),
                                range(3)))
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert {a.headers["x-kvroute-worker"] for a in answers} == {
        gw.address(w) for w in gw.workers}


def test_streams_pass_through_and_bad_bodies_are_refused(
        gateway: Callable[..., Gateway]) -> None:
    gw = gateway(workers=2)
    envoy = gw.envoys[0]
    with envoy.client.stream("POST", "/v1/completions", json={
            "model": "kvroute-sim", "prompt": SYSTEM, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read())
    assert events[-1] == "[DONE]"
    assert len([e for e in events[:-1] if e["choices"][0]["text"]]) == 5
    chat = envoy.client.post("/v1/chat/completions", json={
        "model": "kvroute-sim", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    models = envoy.client.get("/v1/models")  # no body: any worker answers
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "kvroute-sim"
    bad = envoy.client.post("/v1/completions", content=b"{not json",
                            headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    unknown = envoy.complete("hello", model="no-such-model")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_a_killed_worker_is_avoided_and_no_worker_gives_503(
        gateway: Callable[..., Gateway]) -> None:
    gw = gateway(workers=2)
    envoy = gw.envoys[0]
    first = envoy.complete(SYSTEM + "one")
    holder = next(w for w in gw.workers if gw.address(w) == first.headers["x-kvroute-worker"])
    other = next(w for w in gw.workers if w is not holder)
    holder.kill(signal.SIGKILL)
    # Until the EPP's health poll notices, a request may still be sent to the dead worker
    # (Envoy answers 503): the index still names it as the prefix's holder. A failed request
    # moves only its own session and predictions, so a success alone does not mean the
    # EPP has noticed. Once it has, every request goes to the live one.
    eventually_blocking(lambda: gw.epps[0].healthy_workers() == 1, "the EPP to notice the kill",
                        tolerate=NOT_YET)
    for i in range(4):
        r = envoy.complete(SYSTEM + f"after {i}")
        assert r.status_code == 200
        assert r.headers["x-kvroute-worker"] == gw.address(other)
    other.kill(signal.SIGKILL)

    def refused() -> bool:
        r = envoy.complete("anything")
        return r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    eventually_blocking(refused, "the EPP to answer 503 with no worker left", tolerate=NOT_YET)


def test_two_replicas_make_the_same_choices(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(replicas=2)
    a, b = gw.envoys
    prefixes = [f"Tenant {i} system prompt. " * 20 for i in range(3)]
    holders = {}
    for p in prefixes:
        r = a.complete(p + "first")
        assert r.status_code == 200
        holders[p] = r.headers["x-kvroute-worker"]
    by_address = {gw.address(w): w for w in gw.workers}
    for p, address in holders.items():  # the holders published what they hold
        eventually_blocking(lambda p=p, address=address: len(by_address[address].resident())
                            >= len(p.encode()) // 32, "the holder's events", tolerate=NOT_YET)
    # Replica b never saw these requests; it learned the holders from their KV events.
    for p, address in holders.items():
        r = b.complete(p + "second, through the other replica")
        assert r.status_code == 200
        assert r.headers["x-kvroute-worker"] == address
        assert _cached(r) == (len(p.encode()) // 32) * 32
