"""The remote prefill step on its own: a real router service and proxy in front of a scripted
prefill worker that answers as vLLM's NixlConnector prefill server does, and a scripted decode
worker; :func:`prefill_remotely` builds the decode worker's body. The decode failure path with
decode workers that fail their KV loads as a loaded vLLM pair does, or cannot be reached."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from openai_request.bodies import ApiError
from router.http.app import create_app
from router.http.disaggregated import REMOTE_DECODE, prefill_remotely, send_disaggregated
from router.http.first_byte import FirstByteClock
from router.http.proxy import Proxy
from router.service import RouterService
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer

PROMPT = "disaggregated prefill " * 40  # 880 bytes: 27 full blocks
BODY = {"model": "kvroute-sim", "prompt": PROMPT, "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True}}
#: The params a vLLM prefill server answers with (NixlConnector), passed on unchanged.
VLLM_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_block_ids": [3, 4, 5], "remote_engine_id": "0c9e-dp0",
               "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1}


@contextlib.asynccontextmanager
async def served(prefill: ScriptedWorker, *decode: ScriptedWorker, **settings: Any
                 ) -> AsyncIterator[SimpleNamespace]:
    """What :func:`prefill_remotely` reads of the router's state: settings, service, proxy."""
    specs = (f"{prefill.url},role=prefill", *(f"{d.url},role=decode" for d in decode))
    config = RouterSettings(workers=specs, seed=3, **settings)
    async with httpx.AsyncClient() as http:
        service = RouterService(config, http)
        await service.registry.start()
        proxy = Proxy()
        await proxy.start()
        try:
            yield SimpleNamespace(settings=config, service=service, proxy=proxy,
                                  first_byte=FirstByteClock(2.0, 4.0, 300.0))
        finally:
            await service.registry.stop()
            await proxy.close()


async def test_the_prefill_answers_params_go_into_the_decode_request() -> None:
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        async with served(prefill, decode) as state:
            route = state.service.decide(BODY, "completions")
            assert (route.worker.url, route.prefill.url) == (decode.url, prefill.url)
            raw = json.dumps(BODY).encode()
            sent = await prefill_remotely(state, route, "/v1/completions", BODY, raw, {})
            # The prefill worker was asked for one token, whole, for a remote decode.
            (asked,) = prefill.requests
            assert asked == {"model": "kvroute-sim", "prompt": PROMPT, "max_tokens": 1,
                             "stream": False, "kv_transfer_params": REMOTE_DECODE}
            # The decode worker gets the original request with the params unchanged.
            assert json.loads(sent) == {**BODY, "kv_transfer_params": VLLM_PARAMS}
            assert route.prefill is not None
            assert state.service.core.in_flight(route.prefill.id) == 0  # its booking ended
            assert state.service.counters == {"pd_remote_prefills": 1}


async def test_a_failed_prefill_serves_the_request_whole_on_the_decode_worker() -> None:
    for mode, extra in (("refuse", {}), ("ok", {})):  # a 503; an answer without params
        async with ScriptedWorker(mode) as prefill, ScriptedWorker() as decode:
            prefill.answer_extra = extra
            async with served(prefill, decode) as state:
                route = state.service.decide(BODY, "completions")
                raw = json.dumps(BODY).encode()
                sent = await prefill_remotely(state, route, "/v1/completions", BODY, raw, {})
                assert sent is raw and route.prefill is None
                assert state.service.counters == {"pd_prefill_failures": 1}
                assert state.service.core.in_flight(state.service.registry.find(
                    prefill.url).id) == 0


async def test_a_decode_worker_holding_most_of_the_prompt_prefills_it_itself() -> None:
    # Nothing is cached anywhere: the decode worker would compute the whole prompt, so it
    # prefills locally exactly when the threshold is at least the prompt's length.
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        async with served(prefill, decode) as state:
            tokens = len(state.service.tokenize(BODY, "completions").token_ids)
        async with served(prefill, decode, pd_local_prefill_tokens=tokens) as state:
            route = state.service.decide(BODY, "completions")
            assert route.prefill is None and route.worker.url == decode.url
            assert state.service.counters == {"pd_local_prefills": 1}
        async with served(prefill, decode, pd_local_prefill_tokens=tokens - 1) as state:
            assert state.service.decide(BODY, "completions").prefill is not None



async def test_a_decode_worker_failing_before_its_first_byte_hands_on_with_a_fresh_prefill(
        ) -> None:
    # Two decode workers; the second reports a deep queue, so the first is chosen, and it
    # refuses (503 before any byte). The request goes to the second with a prefill of its own.
    async with (ScriptedWorker() as prefill, ScriptedWorker("refuse") as first,
                ScriptedWorker() as second):
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        second.load_answer = b'{"running": 0, "waiting": 64, "pending_prefill_tokens": 1000000}'
        async with served(prefill, first, second) as state:
            await state.service.registry.poll_once()
            state.first_byte = FirstByteClock(2.0, 4.0, 300.0)
            route = state.service.decide(BODY, "completions")
            assert (route.worker.url, route.prefill.url) == (first.url, prefill.url)
            failures: list[tuple[str, int, str]] = []
            sent = await send_disaggregated(
                state, route, "/v1/completions", BODY, json.dumps(BODY).encode(), {}, True,
                lambda w, attempt, cause: failures.append((w.url, attempt, cause)))
            assert (sent.worker.url, sent.attempt) == (second.url, 1)
            assert failures == [(first.url, 0, "status")]
            await sent.answer.read()
            # One prefill for each decode worker tried; each decode worker got its params.
            assert len(prefill.requests) == 2
            assert [r["kv_transfer_params"] for r in first.requests + second.requests] \
                == [VLLM_PARAMS, VLLM_PARAMS]
            assert state.service.counters == {"pd_remote_prefills": 2, "pd_decode_retries": 1}
            assert state.service.core.in_flight(route.prefill.id) == 0


async def test_a_remote_prefills_predicted_ttft_adds_its_queue_the_transfer_and_the_decode_wait(
        ) -> None:
    # The prefill worker has a deep queue; the decode worker is idle. The decode worker's own
    # price knows nothing of the queue there: the prediction is the sum of the three steps.
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.load_answer = b'{"running": 1, "waiting": 4, "pending_prefill_tokens": 40000}'
        for bandwidth in (25e9, 1e7):  # the default link, then a slow one
            async with served(prefill, decode, pd_transfer_bandwidth=bandwidth) as state:
                await state.service.registry.poll_once()
                route = state.service.decide(BODY, "completions")
                assert route.prefill is not None and route.prefill_decision is not None
                there, here = route.prefill_decision.chosen, route.decision.chosen
                assert there.wait_s > 0 and here.wait_s == 0
                transfer = len(route.hashes) * 32 * 32768 / bandwidth  # it holds nothing
                first = state.service.core.rates(here.worker).first_s
                assert route.predicted_ttft_s == pytest.approx(
                    there.cost + transfer + here.wait_s + first)
                assert route.predicted_ttft_s > there.cost + here.wait_s
                # The booking holds that prediction, and the first token reports it.
                state.service.dispatched(route, route.worker)
                told = state.service.first_token(route)
                assert told is not None
                assert told.predicted_s == pytest.approx(route.predicted_ttft_s)
                # A prefill that fails serves the request whole: the decode worker's own price.
                route.prefill = None
                assert route.predicted_ttft_s == here.cost


async def _send(state: SimpleNamespace, body: dict[str, Any] = BODY
                ) -> tuple[Any, list[tuple[str, int, str]], Any]:
    route = state.service.decide(body, "completions")
    failures: list[tuple[str, int, str]] = []
    sent = await send_disaggregated(
        state, route, "/v1/completions", body, json.dumps(body).encode(), {},
        bool(body.get("stream")),
        lambda w, attempt, cause: failures.append((w.url, attempt, cause)))
    await sent.answer.read()
    return sent, failures, route


async def test_a_lone_decode_worker_whose_kv_load_failed_gets_a_fresh_prefill_once() -> None:
    # The first transfer fails (a handshake that timed out), the second goes through: the
    # same decode worker serves the request with the second prefill's params.
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        decode.kv_load_failures = 1
        async with served(prefill, decode) as state:
            sent, failures, route = await _send(state)
            assert (sent.worker.url, sent.attempt, sent.answer.status) == (decode.url, 1, 200)
            assert failures == [(decode.url, 0, "status")]
            assert len(prefill.requests) == 2
            assert [r.get("kv_transfer_params") for r in decode.requests] == [VLLM_PARAMS] * 2
            assert state.service.counters == {"pd_remote_prefills": 2, "pd_decode_retries": 1}
            assert state.service.core.in_flight(route.worker.id) == 1  # answering


@pytest.mark.parametrize("stream", [False, True])
async def test_a_lone_decode_worker_that_fails_every_transfer_serves_the_request_whole(
        stream: bool) -> None:
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        decode.kv_load_failures = 99
        async with served(prefill, decode) as state:
            body = {**BODY, "stream": stream}
            sent, failures, route = await _send(state, body)
            assert (sent.worker.url, sent.attempt, sent.answer.status) == (decode.url, 2, 200)
            assert failures == [(decode.url, 0, "status"), (decode.url, 1, "status")]
            # Two decodes with a prefill's params, then the original body, whole.
            assert [r.get("kv_transfer_params") for r in decode.requests] == \
                [VLLM_PARAMS, VLLM_PARAMS, None]
            assert decode.requests[-1] == body
            assert route.prefill is None  # booked for its own prefill there
            assert state.service.counters == {"pd_remote_prefills": 2, "pd_decode_retries": 1,
                                              "pd_served_whole": 1}


async def test_a_decode_worker_that_cannot_be_reached_leaves_the_request_to_the_prefill_worker(
        ) -> None:
    # The decode worker is gone (its port closed) before the router's health poll noticed:
    # no fresh prefill for it; the prefill worker serves the request whole.
    async with ScriptedWorker() as prefill:
        decode = ScriptedWorker()
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        async with decode, served(prefill, decode) as state:
            await decode.__aexit__(None, None, None)  # it dies
            sent, failures, _ = await _send(state)
        assert (sent.worker.url, sent.answer.status) == (prefill.url, 200)
        assert {cause for _, _, cause in failures} == {"connect"}
        assert {url for url, _, _ in failures} == {decode.url}
        # Its prefills (the second for the retry a connection failure gets after a pause),
        # then the request whole.
        assert [r.get("kv_transfer_params") for r in prefill.requests] == \
            [REMOTE_DECODE, REMOTE_DECODE, None]
        assert prefill.requests[-1] == BODY
        assert state.service.counters == {"pd_remote_prefills": 2, "pd_decode_retries": 1,
                                          "pd_served_whole": 1}
        assert state.service.core.in_flight(state.service.registry.find(prefill.url).id) == 1


async def test_a_request_no_worker_can_answer_is_a_503() -> None:
    async with ScriptedWorker() as prefill, ScriptedWorker("refuse") as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        async with served(prefill, decode) as state:
            prefill.mode = "refuse"  # after its first prefill: then nothing answers
            route = state.service.decide(BODY, "completions")
            with pytest.raises(ApiError) as caught:
                await send_disaggregated(state, route, "/v1/completions", BODY,
                                         json.dumps(BODY).encode(), {}, True,
                                         lambda *_: None)
            assert caught.value.status == 503
            assert state.service.core.in_flight(route.worker.id) == 0


async def test_through_the_router_a_lone_decode_workers_kv_failures_cost_no_request() -> None:
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        decode.kv_load_failures = 99
        config = RouterSettings(workers=(f"{prefill.url},role=prefill",
                                         f"{decode.url},role=decode"), seed=3)
        async with UvicornServer(create_app(config)) as router, \
                httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            await eventually(lambda: client.get("/ready"), "the router ready",
                             until=lambda r: r.status_code == 200 and r.json()["workers"] == 2)
            answer = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvroute-worker"] == decode.url
    assert decode.requests[-1] == BODY
    assert 'kvroute_pd_prefills_total{outcome="whole"} 1.0' in metrics
    assert 'kvroute_pd_prefills_total{outcome="retried"} 1.0' in metrics


async def test_through_the_router_a_remote_prefills_answer_carries_its_own_prediction() -> None:
    async with ScriptedWorker() as prefill, ScriptedWorker() as decode:
        prefill.answer_extra = {"kv_transfer_params": VLLM_PARAMS}
        prefill.load_answer = b'{"running": 1, "waiting": 4, "pending_prefill_tokens": 40000}'
        config = RouterSettings(workers=(f"{prefill.url},role=prefill",
                                         f"{decode.url},role=decode"), seed=3)
        async with UvicornServer(create_app(config)) as router, \
                httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            await eventually(lambda: client.post("/debug/route", json=BODY),
                             "the prefill worker's queue seen",
                             until=lambda r: r.status_code == 200
                             and r.json()["prefill"] == prefill.url
                             and r.json()["workers"][0]["wait_s"] == 0
                             and r.json()["predicted_ttft_s"] > 2 * r.json()["workers"][0]["cost"])
            shown = (await client.post("/debug/route", json=BODY)).json()
            answer = await client.post("/v1/completions", json=BODY)
    assert answer.status_code == 200, answer.text
    predicted = float(answer.headers["x-kvroute-predicted-ttft-ms"])
    assert predicted == pytest.approx(shown["predicted_ttft_s"] * 1e3, abs=0.05)
    assert predicted > shown["workers"][0]["cost"] * 1e3  # more than the decode worker's own
