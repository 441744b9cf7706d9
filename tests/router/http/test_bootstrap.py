"""SGLang's disaggregated protocol: the bootstrap fields, and the prefill sent beside the
decode request. A real router service and proxy in front of scripted workers that record what
they are sent; the expected bodies are the exchange SGLang's own router (``sglang_router``'s PD
mode) makes: the client's body plus ``bootstrap_host`` (the prefill server's host),
``bootstrap_port`` (its bootstrap server's port) and one random ``bootstrap_room``, the same
body to both servers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from router.fleet.worker_config import parse_worker
from router.http.bootstrap import DEFAULT_BOOTSTRAP_PORT, bootstrap_fields
from router.http.disaggregated import prefill_remotely
from tests.router.http.test_disaggregated import BODY, served
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

#: A request as SGLang's router sends it to both servers of a pair (a recorded exchange,
#: prefill server at 10.0.0.7 with --disaggregation-bootstrap-port 8998).
RECORDED = {"model": "qwen", "prompt": "Hello", "max_tokens": 16, "stream": True,
            "bootstrap_host": "10.0.0.7", "bootstrap_port": 8998,
            "bootstrap_room": 6022581830135493133}


def test_the_fields_are_the_ones_sglangs_router_adds() -> None:
    sent = {k: RECORDED[k] for k in ("model", "prompt", "max_tokens", "stream")}
    fields = bootstrap_fields("http://10.0.0.7:30000", None, RECORDED["bootstrap_room"])
    assert {**sent, **fields} == RECORDED
    assert bootstrap_fields("http://[fd00::7]:30000", 9000, 1) == {
        "bootstrap_host": "[fd00::7]", "bootstrap_port": 9000, "bootstrap_room": 1}
    assert DEFAULT_BOOTSTRAP_PORT == 8998


def test_a_prefill_workers_bootstrap_port_is_configured_and_checked() -> None:
    worker = parse_worker("http://10.0.0.7:30000,engine=sglang,role=prefill,bootstrap_port=9000")
    assert (worker.engine, worker.role, worker.bootstrap_port) == ("sglang", "prefill", 9000)
    with pytest.raises(ValueError, match=r"bootstrap_port 70000 is not in 1\.\.65535"):
        parse_worker("http://10.0.0.7:30000,bootstrap_port=70000")


def _as_sglang(entry: object, port: int | None = None) -> None:
    """Make a registered scripted worker the SGLang prefill server it plays."""
    config = entry.config  # type: ignore[attr-defined]
    entry.config = dataclasses.replace(  # type: ignore[attr-defined]
        config, engine="sglang", bootstrap_port=port)


async def test_both_workers_get_the_same_body_and_the_prefill_runs_beside_the_decode() -> None:
    async with (ScriptedWorker() as prefill, ScriptedWorker() as decode,
                served(prefill, decode) as state):
        route = state.service.decide(BODY, "completions")
        assert route.prefill is not None and route.prefill.url == prefill.url
        _as_sglang(route.prefill, port=8999)
        prefill.pause()  # its prefill takes as long as the test wants
        sent = await prefill_remotely(state, route, "/v1/completions", BODY,
                                      json.dumps(BODY).encode(), {})
        # The decode worker's body is ready while the prefill has not answered.
        body = json.loads(sent)
        assert body == {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8999,
                        "bootstrap_room": body["bootstrap_room"]}
        assert 0 <= body["bootstrap_room"] < 2 ** 63
        await eventually(lambda: prefill.requests, "the prefill worker got the request")
        assert prefill.requests == [body]  # the very same body, room included
        assert route.prefill is not None  # the decode worker is booked without a prefill
        assert state.service.core.in_flight(route.prefill.id) == 1
        prefill.resume()
        await eventually(lambda: state.service.core.in_flight(route.prefill.id),
                         "the prefill worker's booking ends with its answer",
                         until=lambda n: n == 0)
        await eventually(lambda: state.service.counters, "the prefill counted",
                         until=lambda c: c == {"pd_remote_prefills": 1})


async def test_rooms_differ_and_a_failed_prefill_is_counted_and_released() -> None:
    async with (ScriptedWorker("refuse") as prefill, ScriptedWorker() as decode,
                served(prefill, decode) as state):
        rooms = set()
        for _ in range(2):
            route = state.service.decide(BODY, "completions")
            _as_sglang(route.prefill)
            sent = await prefill_remotely(state, route, "/v1/completions", BODY,
                                          json.dumps(BODY).encode(), {})
            rooms.add(json.loads(sent)["bootstrap_room"])
            assert json.loads(sent)["bootstrap_port"] == DEFAULT_BOOTSTRAP_PORT
        assert len(rooms) == 2
        await eventually(lambda: state.service.counters, "both failures counted",
                         until=lambda c: c == {"pd_prefill_failures": 2})
        entry = state.service.registry.find(prefill.url)
        assert state.service.core.in_flight(entry.id) == 0
