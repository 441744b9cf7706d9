"""Engine adapters against recorded control-plane answers, served by an httpx transport.

vLLM's answers were recorded from a real server; SGLang's and TensorRT-LLM's are written from
their documented metric names (``tests/data/README.md``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from router.fleet.engines import PollFailed, WorkerUnreachable, adapter_for
from router.fleet.engines.prometheus import MetricsError, parse_metrics
from router.fleet.worker_config import WorkerConfig
from router.fleet.worker_table import IncompatibleWorker
from router.routing.load import ReportedLoad

DATA = Path(__file__).resolve().parents[2] / "data" / "engines"
URL = "http://engine:8000"


def served(routes: dict[str, httpx.Response | Callable[[], httpx.Response]]
           ) -> httpx.AsyncClient:
    """A client whose every request is answered from ``routes`` (path -> answer), else 404."""
    def answer(request: httpx.Request) -> httpx.Response:
        found = routes.get(request.url.path)
        if found is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return found() if callable(found) else found
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def recorded(engine: str, **overrides: httpx.Response) -> dict[str, httpx.Response]:
    metrics_path = "/prometheus/metrics" if engine == "trtllm" else "/metrics"
    return {"/v1/models": httpx.Response(200, text=(DATA / f"{engine}_models.json").read_text()),
            metrics_path: httpx.Response(200, text=(DATA / f"{engine}_metrics.txt").read_text()),
            "/health": httpx.Response(200), **overrides}


# -- what each engine's recorded answers say ---------------------------------------------------

async def test_vllm_describes_model_block_size_and_capacity_from_its_own_answers() -> None:
    models = json.loads((DATA / "vllm_models.json").read_text())
    text = (DATA / "vllm_metrics.txt").read_text()
    config = parse_metrics(text).named("vllm:cache_config_info")[0].labels
    worker = WorkerConfig(URL, engine="vllm", events="tcp://engine:5557")
    async with served(recorded("vllm")) as http:
        info = await adapter_for("vllm").describe(http, worker, router_block_size=16)
    assert info.model == models["data"][0]["id"]
    assert info.block_size == int(config["block_size"]) == 32  # the engine's, not the router's
    assert info.num_blocks == int(config["num_gpu_blocks"]) > 0
    assert info.max_model_len == models["data"][0]["max_model_len"]
    assert (info.events_endpoint, info.replay_endpoint) == ("tcp://engine:5557", None)
    assert info.snapshot is False and info.tokenizer == ""


async def test_sglang_reads_page_size_and_load_from_its_metrics() -> None:
    worker = WorkerConfig(URL, engine="sglang")
    async with served(recorded("sglang")) as http:
        adapter = adapter_for("sglang")
        info = await adapter.describe(http, worker, router_block_size=32)
        load = await adapter.poll(http, worker, info)
    assert (info.model, info.block_size, info.max_model_len) == (
        "meta-llama/Llama-3.1-8B-Instruct", 16, 131072)
    assert info.num_blocks == 471258 // 16
    assert load == ReportedLoad(running=5, waiting=2, decode_blocks=0.25 * (471258 // 16),
                                kv_usage=0.25)


async def test_trtllm_reads_its_metrics_path_and_tokens_per_block() -> None:
    worker = WorkerConfig(URL, engine="trtllm", block_size=32)
    async with served(recorded("trtllm")) as http:
        adapter = adapter_for("trtllm")
        info = await adapter.describe(http, worker, router_block_size=32)
        load = await adapter.poll(http, worker, info)
    assert (info.model, info.block_size, info.num_blocks) == ("Qwen/Qwen3-8B", 32, 4096)
    assert load == ReportedLoad(running=7, waiting=1, decode_blocks=2048.0, kv_usage=0.5)


# -- block size: engine, configuration, router --------------------------------------------------

async def test_a_configured_block_size_the_engine_contradicts_is_refused() -> None:
    worker = WorkerConfig(URL, engine="trtllm", block_size=64)
    async with served(recorded("trtllm")) as http:
        with pytest.raises(IncompatibleWorker, match="reports block size 32 but its "
                           "configuration says 64"):
            await adapter_for("trtllm").describe(http, worker, router_block_size=64)


async def test_without_a_reported_or_configured_block_size_the_routers_is_assumed() -> None:
    old_sglang = "\n".join(line for line in (DATA / "sglang_metrics.txt").read_text().splitlines()
                           if "page_size" not in line) + "\n"
    worker = WorkerConfig(URL, engine="sglang")
    async with served(recorded("sglang", **{"/metrics": httpx.Response(200, text=old_sglang)})
                      ) as http:
        assert (await adapter_for("sglang").describe(http, worker, 64)).block_size == 64
        configured = WorkerConfig(URL, engine="sglang", block_size=16)
        assert (await adapter_for("sglang").describe(http, configured, 64)).block_size == 16


# -- untrusted answers ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, reason", [
    ("vllm:num_requests_running{ 3\n", "do not parse"),
    ("# TYPE x gauge\nx 1\n", "lack vllm:num_requests_running"),
    ("vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n"
     "vllm:kv_cache_usage_perc 0.1\n", "is -1.0"),
    ("vllm:num_requests_running NaN\n", "is nan"),
    ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
     "vllm:kv_cache_usage_perc 7\n", "not a fraction"),
])
async def test_a_bad_metrics_answer_fails_the_poll_with_its_reason(text: str, reason: str
                                                                   ) -> None:
    worker = WorkerConfig(URL, engine="vllm")
    async with served(recorded("vllm", **{"/metrics": httpx.Response(200, text=text)})) as http:
        with pytest.raises(PollFailed, match=reason):
            await adapter_for("vllm").poll(http, worker, None)


async def test_health_decides_before_metrics_are_read() -> None:
    worker = WorkerConfig(URL, engine="vllm")
    async with served(recorded("vllm", **{"/health": httpx.Response(503)})) as http:
        with pytest.raises(PollFailed, match="/health answered 503"):
            await adapter_for("vllm").poll(http, worker, None)


def test_an_oversized_metrics_answer_is_refused_unparsed() -> None:
    with pytest.raises(MetricsError, match="over"):
        parse_metrics("x 1\n" * (3 * 1024 * 1024))


@pytest.mark.parametrize("body", [
    "[]", '{"data": []}', '{"data": [{"object": "model"}]}', "not json",
    '{"data": [{"id": "a"}, {"id": "b"}]}',
])
async def test_a_bad_models_answer_leaves_the_worker_unreachable(body: str) -> None:
    worker = WorkerConfig(URL, engine="vllm")
    async with served(recorded("vllm", **{"/v1/models": httpx.Response(200, text=body)})
                      ) as http:
        with pytest.raises(WorkerUnreachable):
            await adapter_for("vllm").describe(http, worker, 32)


async def test_lora_adapters_are_the_models_with_a_parent() -> None:
    body = {"data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}]}
    worker = WorkerConfig(URL, engine="vllm")
    async with served(recorded("vllm", **{"/v1/models": httpx.Response(200, json=body)})
                      ) as http:
        info = await adapter_for("vllm").describe(http, worker, 32)
    assert (info.model, info.lora_adapters) == ("base", ("sql",))
    assert info.serves("sql") and not info.serves("other")


async def test_the_kvroute_adapter_reads_model_info_and_load_as_before() -> None:
    model_info = {"model": "m", "block_size": 16, "tokenizer": "bytes-v1", "instance_id": "i1",
                  "events_endpoint": "tcp://*:5557", "kv_snapshot": True}
    load = {"running": 2, "waiting": 1, "pending_prefill_tokens": 64, "decode_blocks": 9,
            "kv_usage": 0.125}
    routes = {"/model_info": httpx.Response(200, json=model_info),
              "/load": httpx.Response(200, json=load)}
    async with served(routes) as http:
        adapter = adapter_for("kvroute")
        info = await adapter.describe(http, WorkerConfig("http://w:1"), 32)
        reported = await adapter.poll(http, WorkerConfig("http://w:1"), info)
    assert (info.block_size, info.events_endpoint, info.snapshot) == (16, "tcp://w:5557", True)
    assert reported == ReportedLoad(running=2, waiting=1, pending_prefill_blocks=4.0,
                                    decode_blocks=9.0, kv_usage=0.125)


# -- how a failed poll reads: gone (no answer) or answered badly --------------------------------

def _raising(exc: type[httpx.TransportError]) -> Callable[[], httpx.Response]:
    def answer() -> httpx.Response:
        raise exc("no answer")
    return answer


@pytest.mark.parametrize("engine, path", [("kvroute", "/load"), ("vllm", "/health")])
@pytest.mark.parametrize("exc, reason", [(httpx.ReadTimeout, "no answer within 0.5s"),
                                         (httpx.ConnectError, "ConnectError")])
async def test_a_poll_without_answer_fails_as_gone(
        engine: str, path: str, exc: type[httpx.TransportError], reason: str) -> None:
    async with served({path: _raising(exc)}) as http:
        with pytest.raises(PollFailed, match=reason) as failed:
            await adapter_for(engine).poll(http, WorkerConfig(URL, engine=engine), None, 0.5)
    assert failed.value.gone


@pytest.mark.parametrize("answer, reason", [(httpx.Response(500), "HTTPStatusError"),
                                            (httpx.Response(200, content=b'{"running": 1e999}'),
                                             "running")])
async def test_a_kvroute_load_answered_badly_fails_but_not_as_gone(
        answer: httpx.Response, reason: str) -> None:
    async with served({"/load": answer}) as http:
        with pytest.raises(PollFailed, match=reason) as failed:
            await adapter_for("kvroute").poll(http, WorkerConfig(URL), None, 0.5)
    assert not failed.value.gone
