"""Peer KV fetch through the router's HTTP path, against scripted workers on 127.0.0.1 that
advertise it (``docs/peer_fetch.md``): the instruction a worker is sent, the headers a
client may not send, the answer's headers, ``/debug/route``'s prices, the metrics, and what
the result teaches (a link learned, a failed pair backed off)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from indexer.events import Stored
from router.http.app import create_app
from router.http.request_path import without_fetch
from router.routing.fetch_links import IPC_BANDWIDTH, fetch_failure_reason
from router.service import RouterService, parse_fetch_result
from router.settings import RouterSettings, SettingsError, load_settings
from tests.router.http.test_request_metrics import samples, value
from tests.router.test_router_service import wait_ready
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer

#: 40,000 one-byte tokens: 1,250 blocks, whose recompute (about 0.43 s at the default rates)
#: is dearer than fetching them (about 2 ms and 52 ms over the default 25 GB/s link).
PROMPT = "x" * 40000
BODY = {"model": "kvroute-sim", "prompt": PROMPT, "max_tokens": 4}
FETCH = {"kv_fetch": {"serve": True, "receive": True, "kv_bytes_per_token": 32768,
                      "transfer": "http"}}
DEEP_QUEUE = b'{"running": 0, "waiting": 64, "pending_prefill_tokens": 2000000}'
RESULT = "blocks=1250;bytes=1310720000;seconds=0.5"


@contextlib.asynccontextmanager
async def fleet(holder: ScriptedWorker, taker: ScriptedWorker, **kw: Any
                ) -> AsyncIterator[tuple[httpx.AsyncClient, RouterService]]:
    """A router in front of ``holder`` (queued deep, holding the prompt on its device, by
    the index) and ``taker`` (idle, holding nothing)."""
    holder.load_answer = DEEP_QUEUE
    settings = RouterSettings(workers=(holder.url, taker.url), health_interval=0.1, seed=3,
                              **kw)
    app = create_app(settings)
    async with UvicornServer(app) as router, httpx.AsyncClient(base_url=router.url) as client:
        await wait_ready(client, 2)
        service: RouterService = app._state.service  # type: ignore[attr-defined]
        entry = service.registry.find(holder.url)
        assert entry is not None
        await eventually(lambda: service.core.wait(entry.id) > 1.0,
                         "the holder's deep queue read by a load poll", interval=0.02)
        tokens = service.tokenize(BODY, "completions").token_ids
        service.index.apply(entry.id, Stored(block_hashes=list(range(1, 1251)),
                                             parent_block_hash=None,
                                             token_ids=tokens[:1250 * 32], block_size=32))
        yield client, service


def _ids(service: RouterService, *workers: ScriptedWorker) -> list[int]:
    found = [service.registry.find(w.url) for w in workers]
    return [e.id for e in found if e is not None]


async def test_an_idle_worker_is_told_to_fetch_what_a_busy_holder_holds() -> None:
    async with (
        ScriptedWorker() as holder, ScriptedWorker() as taker,
    ):
        holder.model_info_extra = taker.model_info_extra = FETCH
        taker.answer_headers = {"x-kvroute-fetch-result": RESULT}
        async with fleet(holder, taker) as (client, service):
            explained = (await client.post("/debug/route", json=BODY)).json()
            answer = await client.post("/v1/completions", json=BODY, headers={
                "x-kvroute-fetch-source": "http://198.51.100.7:1", "x-kvroute-fetch-blocks": "9",
                "x-kvroute-transfer-token": "not the router's"})
            found = samples((await client.get("/metrics")).text)
            source, receiver = _ids(service, holder, taker)
            learned = service.core.fetch_link_s(source, receiver)
    assert explained["chosen"] == taker.url and explained["fetch_source"] == holder.url
    rows = {row["url"]: row for row in explained["workers"]}
    took, held = rows[taker.url], rows[holder.url]
    assert took["fetch_source"] == holder.url and took["fetch_blocks"] == 1250
    assert took["prefill_blocks"] == 0 and took["matched_blocks"] == 0
    assert took["price"] == took["fetch_price"] < took["recompute_price"]
    assert took["fetch_s"] > 0.002  # the read and the blocks
    assert held["fetch_source"] is None and held["matched_blocks"] == 1250
    assert held["wait_s"] > 1.0 and held["price"] > took["price"]  # waiting for the holder
    # The worker told to fetch got the router's instruction, none of the client's.
    assert answer.status_code == 200
    sent = {k.lower(): v for k, v in taker.headers[0].items()}
    assert sent["x-kvroute-fetch-source"] == holder.url
    assert sent["x-kvroute-fetch-blocks"] == "1250"
    assert "x-kvroute-transfer-token" not in sent  # no secret: loopback peers only
    assert answer.headers["x-kvroute-worker"] == taker.url
    assert answer.headers["x-kvroute-fetch-source"] == holder.url
    assert answer.headers["x-kvroute-fetch-result"] == RESULT  # passed through
    assert value(found, "kvroute_fetch_decisions_total") == 1
    assert value(found, "kvroute_fetch_results_total", outcome="fetched") == 1
    assert value(found, "kvroute_fetch_bytes_total") == 1310720000
    # The pair's link: 1.31 GB in 0.5 s is 2.6 GB/s, 32 KiB x 32 tokens a block.
    assert learned == pytest.approx(32 * 32768 * 0.5 / 1310720000)


def _on_gpu(gpu: str) -> dict[str, Any]:
    """``FETCH`` as a worker that also copies fetched blocks over CUDA IPC advertises it."""
    return {"kv_fetch": {**FETCH["kv_fetch"], "transfers": ["http", "cuda_ipc"],
                         "cuda_ipc": {"host": "h1", "gpu": gpu}}}


@pytest.mark.parametrize(("holder_gpu", "taker_gpu", "bandwidth"), [
    ("GPU-a", "GPU-a", IPC_BANDWIDTH), ("GPU-a", "GPU-b", 25e9), ("GPU-a", None, 25e9)])
async def test_a_pair_on_one_gpu_is_priced_at_cuda_ipc_until_it_learns(
        holder_gpu: str, taker_gpu: str | None, bandwidth: float) -> None:
    """Before any result, a pair whose /model_info both advertise CUDA IPC on one GPU is
    priced at the IPC path's bandwidth; on two GPUs, or with one worker over HTTP alone, at
    the default link. A result then teaches the pair's own."""
    async with ScriptedWorker() as holder, ScriptedWorker() as taker:
        holder.model_info_extra = _on_gpu(holder_gpu)
        taker.model_info_extra = FETCH if taker_gpu is None else _on_gpu(taker_gpu)
        taker.answer_headers = {"x-kvroute-fetch-result": RESULT}
        async with fleet(holder, taker) as (client, service):
            source, receiver = _ids(service, holder, taker)
            prior = service.core.fetch_link_s(source, receiver)
            explained = (await client.post("/debug/route", json=BODY)).json()
            await client.post("/v1/completions", json=BODY)
            learned = service.core.fetch_link_s(source, receiver)
    assert prior == pytest.approx(32 * 32768 / bandwidth)
    took = {row["url"]: row for row in explained["workers"]}[taker.url]
    assert took["fetch_s"] == pytest.approx(0.002 + 1250 * max(prior, 32 * 32768 / 50e9))
    assert learned == pytest.approx(32 * 32768 * 0.5 / 1310720000)


@pytest.mark.parametrize(("holder_http", "taker_http", "bandwidth"), [
    (0.25e9, None, 0.25e9), (None, 2e9, 2e9), (0.25e9, 2e9, 0.25e9), (1e11, None, 25e9)])
async def test_a_pair_over_http_is_priced_at_its_slower_ends_advertised_bandwidth(
        holder_http: float | None, taker_http: float | None, bandwidth: float) -> None:
    """Before any result, a pair over HTTP is priced at the slowest of the default link and
    what either worker's /model_info says its HTTP fetches move (a torch worker's encoding
    is a hundredth of a fast network's default)."""
    def advertised(http: float | None) -> dict[str, Any]:
        extra = {} if http is None else {"http_bandwidth": http}
        return {"kv_fetch": {**FETCH["kv_fetch"], **extra}}

    async with ScriptedWorker() as holder, ScriptedWorker() as taker:
        holder.model_info_extra = advertised(holder_http)
        taker.model_info_extra = advertised(taker_http)
        async with fleet(holder, taker) as (client, service):
            source, receiver = _ids(service, holder, taker)
            prior = service.core.fetch_link_s(source, receiver)
            explained = (await client.post("/debug/route", json=BODY)).json()
    assert prior == pytest.approx(32 * 32768 / bandwidth)
    took = {row["url"]: row for row in explained["workers"]}[taker.url]
    # 1,250 blocks: 5.2 s at 0.25 GB/s and 0.66 s at 2 GB/s, dearer than recomputing them;
    # 52 ms at the default 25 GB/s, cheaper.
    assert took["fetch_cost"] > 1250 * prior
    assert took["fetch_s"] == (pytest.approx(0.002 + 1250 * prior) if bandwidth > 2e9
                               else 0.0)


async def test_a_failed_fetch_backs_the_pair_off_and_the_secret_goes_with_the_instruction(
        tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("  a shared secret of some length \n")
    async with ScriptedWorker() as holder, ScriptedWorker() as taker:
        holder.model_info_extra = taker.model_info_extra = FETCH
        taker.answer_headers = {"x-kvroute-fetch-result": "failed;reason=unreachable"}
        async with fleet(holder, taker, kv_transfer_secret_file=str(secret)) as (client,
                                                                                service):
            first = await client.post("/v1/completions", json=BODY)
            again = (await client.post("/debug/route", json=BODY)).json()
            found = samples((await client.get("/metrics")).text)
            assert service.core.fetch_backed_off(*_ids(service, holder, taker),
                                                 time.monotonic())
    assert first.headers["x-kvroute-fetch-source"] == holder.url
    sent = {k.lower(): v for k, v in taker.headers[0].items()}
    assert sent["x-kvroute-transfer-token"] == "a shared secret of some length"
    assert value(found, "kvroute_fetch_results_total", outcome="failed") == 1
    assert value(found, "kvroute_fetch_failures_total", reason="unreachable") == 1
    # Backed off: the pair is no source now; the taker recomputes (or the holder is waited
    # for), and no row prices a fetch from the holder.
    assert again["fetch_source"] is None
    assert all(row["fetch_source"] is None and row["best_fetch_source_id"] is None
               for row in again["workers"])


@pytest.mark.parametrize("reason", ["missing", "evicted", "no_free_blocks"])
async def test_a_fetch_that_failed_for_the_caches_state_backs_no_link_off(reason: str) -> None:
    """The holder no longer held the blocks, or the taker had no room: the link is fine, so
    the pair stays a source (counted by reason); a transport failure would back it off."""
    async with ScriptedWorker() as holder, ScriptedWorker() as taker:
        holder.model_info_extra = taker.model_info_extra = FETCH
        taker.answer_headers = {"x-kvroute-fetch-result": f"failed;reason={reason}"}
        async with fleet(holder, taker) as (client, service):
            first = await client.post("/v1/completions", json=BODY)
            found = samples((await client.get("/metrics")).text)
            backed_off = service.core.fetch_backed_off(*_ids(service, holder, taker),
                                                       time.monotonic())
    assert first.headers["x-kvroute-fetch-source"] == holder.url
    assert value(found, "kvroute_fetch_failures_total", reason=reason) == 1
    assert value(found, "kvroute_fetch_results_total", outcome="failed") == 1
    assert not backed_off


@pytest.mark.parametrize(("text", "reason"), [
    ("failed;reason=status_503", "status"), ("failed;reason=timeout", "timeout"),
    ("failed; reason = missing ", "missing"), ("failed;reason=a-new-one", "other"),
    ("failed", "other")])
def test_a_failure_reason_is_one_of_a_bounded_set(text: str, reason: str) -> None:
    assert fetch_failure_reason(text) == reason


async def test_workers_that_advertise_no_fetch_are_never_told_to_fetch() -> None:
    async with (  # stock workers: no kv_fetch
        ScriptedWorker() as holder, ScriptedWorker() as taker, fleet(holder, taker) as (client, _),
    ):
        answer = await client.post("/v1/completions", json=BODY)
        explained = (await client.post("/debug/route", json=BODY)).json()
    assert "x-kvroute-fetch-source" not in answer.headers
    assert explained["fetch_source"] is None
    assert all(row["fetch_cost"] is None for row in explained["workers"])
    sent = {k.lower() for w in (holder, taker) for h in w.headers for k in h}
    assert not any(k.startswith("x-kvroute-fetch-") for k in sent)


async def test_kv_fetch_off_prices_no_fetch() -> None:
    async with ScriptedWorker() as holder, ScriptedWorker() as taker:
        holder.model_info_extra = taker.model_info_extra = FETCH
        async with fleet(holder, taker, kv_fetch="off") as (client, _):
            explained = (await client.post("/debug/route", json=BODY)).json()
    assert explained["chosen"] == taker.url and explained["fetch_source"] is None
    assert all(row["fetch_cost"] is None for row in explained["workers"])


def test_a_client_cannot_send_a_fetch_instruction() -> None:
    headers = {"x-kvroute-fetch-source": "http://a", "x-kvroute-fetch-blocks": "3",
               "x-kvroute-fetch-anything": "1", "x-kvroute-transfer-token": "t",
               "x-kvroute-ttft-deadline-ms": "10", "content-type": "application/json"}
    assert without_fetch(headers) == {"x-kvroute-ttft-deadline-ms": "10",
                                      "content-type": "application/json"}


@pytest.mark.parametrize(("text", "parsed"), [
    ("blocks=3;bytes=3145728;seconds=0.01", (3, 3145728.0, 0.01)),
    (" blocks = 0 ; bytes=0; seconds=0 ", (0, 0.0, 0.0)),
    ("failed;reason=timeout", None),
    ("failed", None),
])
def test_fetch_results_parse(text: str, parsed: tuple[int, float, float] | None) -> None:
    assert parse_fetch_result(text) == parsed


@pytest.mark.parametrize("text", ["", "blocks=3", "blocks=x;bytes=1;seconds=1",
                                  "blocks=-1;bytes=1;seconds=1", "blocks=1;bytes=inf;seconds=1",
                                  "blocks=1;bytes=1;seconds=nan", "ok"])
def test_a_malformed_fetch_result_is_refused_with_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="x-kvroute-fetch-result"):
        parse_fetch_result(text)


def test_fetch_settings_are_checked(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(SettingsError, match="at least 16 bytes"):
        load_settings({"kv_transfer_secret_file": str(short)}, env={})
    with pytest.raises(SettingsError, match=r"kv_transfer_secret_file .*missing"):
        load_settings({"kv_transfer_secret_file": str(tmp_path / "missing")}, env={})
    with pytest.raises(SettingsError, match="kv_fetch 'sometimes' is not one of auto, off"):
        load_settings({"kv_fetch": "sometimes"}, env={})
    good = tmp_path / "good"
    good.write_text("0123456789abcdef\n")
    settings = load_settings({}, env={"KVROUTE_KV_TRANSFER_SECRET_FILE": str(good)})
    assert settings.kv_transfer_secret == "0123456789abcdef"
    assert "0123456789abcdef" not in repr(settings)
    assert settings.fetch_reachable("http://10.0.0.9:8000")
    plain = RouterSettings()
    assert plain.kv_fetch == "auto" and plain.fetch_reachable("http://127.0.0.1:8101")
    assert not plain.fetch_reachable("http://10.0.0.9:8000")  # off loopback, no secret


def test_model_info_kv_fetch_is_read_checked_and_ignored_unless_usable() -> None:
    from router.fleet.worker_answers import MalformedAnswer, parse_model_info

    base = b'"model": "m", "block_size": 32, "tokenizer": "t", "instance_id": "i"'
    info = parse_model_info("http://127.0.0.1:1", b"{" + base + b', "kv_fetch": {"serve": true, '
                            b'"receive": false, "kv_bytes_per_token": 4096, "transfer": "http"}}')
    assert (info.kv_fetch_serve, info.kv_fetch_receive, info.kv_bytes_per_token) == (
        True, False, 4096)
    for ignored in (b"", b', "kv_fetch": null',
                    b', "kv_fetch": {"serve": true, "receive": true, "kv_bytes_per_token": 0}',
                    b', "kv_fetch": {"serve": true, "kv_bytes_per_token": 9, "transfer": "rdma"}'):
        info = parse_model_info("http://127.0.0.1:1", b"{" + base + ignored + b"}")
        assert not (info.kv_fetch_serve or info.kv_fetch_receive)
    with pytest.raises(MalformedAnswer, match="kv_fetch"):
        parse_model_info("http://127.0.0.1:1", b"{" + base + b', "kv_fetch": "yes"}')
    # CUDA IPC: the device a worker's KV is on, when it lists the path among its transfers.
    usable = b', "kv_fetch": {"serve": true, "receive": true, "kv_bytes_per_token": 9'
    device = b', "cuda_ipc": {"host": "h", "gpu": "GPU-1"}'
    info = parse_model_info("http://127.0.0.1:1", b"{" + base + usable
                            + b', "transfers": ["http", "cuda_ipc"]' + device + b"}}")
    assert info.kv_fetch_device == ("h", "GPU-1") and info.kv_fetch_receive
    for elsewhere in (usable + device + b"}", usable + b', "transfers": ["http"]' + device + b"}",
                      usable + b"}"):
        info = parse_model_info("http://127.0.0.1:1", b"{" + base + elsewhere + b"}")
        assert info.kv_fetch_device is None and info.kv_fetch_receive
    for bad in (b', "cuda_ipc": {"host": "", "gpu": "GPU-1"}', b', "cuda_ipc": {"host": "h"}',
                b', "transfers": "cuda_ipc"'):
        with pytest.raises(MalformedAnswer, match="kv_fetch"):
            parse_model_info("http://127.0.0.1:1", b"{" + base + usable + bad + b"}}")
