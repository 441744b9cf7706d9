"""What a client may not set that the router sets itself, against real sockets on 127.0.0.1:
the disaggregated-serving fields of a body (vLLM's ``kv_transfer_params``, SGLang's
``bootstrap_*``) are refused with a 400 naming them, and a client's ``X-data-parallel-rank``
is dropped before the request goes upstream, unless ``allow_client_transfer_fields`` says
the operator's clients speak those protocols themselves. A long body decided before its end
is checked again once whole: such a field after its prompt is refused the same way and the
worker never receives a complete body."""

from __future__ import annotations

import json

import pytest

from tests.router.epp import test_epp_server as epp
from tests.router.http.test_app_boundary import BODY, router
from tests.router.http.test_early_upstream import PROMPT, parts, scripted
from tests.router.http.test_early_upstream import router as early_router
from tests.router.http.test_early_upstream import tokenizer as tokenizer  # the fixture
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker

FIELDS = {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "victim",
                                 "remote_block_ids": [1, 2], "remote_host": "10.0.0.9",
                                 "remote_port": 5600},
          "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 12345}


@pytest.mark.parametrize("field", sorted(FIELDS))
async def test_a_transfer_field_from_a_client_is_refused(field: str) -> None:
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        answer = await client.post("/v1/completions", json={**BODY, field: FIELDS[field]})
        chat = await client.post("/v1/chat/completions",
                                 json={"model": "kvroute-sim", field: FIELDS[field],
                                       "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    assert field in error["message"] and "allow-client-transfer-fields" in error["message"]
    assert chat.status_code == 400
    assert worker.requests == []


async def test_a_null_transfer_field_is_no_field() -> None:
    # OpenAI clients that serialise every optional field send null: nothing is asked of it.
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        answer = await client.post("/v1/completions", json={**BODY, "kv_transfer_params": None})
    assert answer.status_code == 200, answer.text


async def test_an_operator_may_allow_transfer_fields_from_clients() -> None:
    async with ScriptedWorker() as worker, router(
            worker, allow_client_transfer_fields=True) as (_, client):
        answer = await client.post("/v1/completions",
                                   json={**BODY, "bootstrap_room": 7},
                                   headers={"X-data-parallel-rank": "3"})
    assert answer.status_code == 200, answer.text
    assert worker.requests[0]["bootstrap_room"] == 7
    sent = {k.lower(): v for k, v in worker.headers[0].items()}
    assert sent["x-data-parallel-rank"] == "3"


async def test_a_clients_data_parallel_rank_header_is_dropped() -> None:
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        answer = await client.post("/v1/completions", json=BODY,
                                   headers={"X-Data-Parallel-Rank": "3"})
    assert answer.status_code == 200, answer.text
    assert not any(k.lower() == "x-data-parallel-rank" for k in worker.headers[0])


async def test_a_transfer_field_after_an_early_decided_prompt_is_refused(tokenizer: str
                                                                         ) -> None:
    body = json.dumps({"model": "kvroute-sim", "max_tokens": 4, "prompt": PROMPT,
                       "kv_transfer_params": FIELDS["kv_transfer_params"]}).encode()
    async with scripted(tokenizer) as worker, early_router(tokenizer, worker) as (_, client):
        answer = await client.post("/v1/completions", content=parts(body, 20_000, worker),
                                   headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "kv_transfer_params"
        # the worker began the request but never received its whole body
        await eventually(lambda: worker.cancelled.is_set() or not worker.bodies,
                         "the worker's request ended")
        assert worker.bodies == []


async def test_the_endpoint_picker_refuses_a_transfer_field_too() -> None:
    async with ScriptedWorker() as worker, epp.picker_for(worker) as (stub, _, _):
        answers = await epp.exchange(stub, epp.headers(), epp.body(json.dumps(
            {**BODY, "kv_transfer_params": FIELDS["kv_transfer_params"]}).encode()))
    status, error = epp.immediate(answers[-1])
    assert (status, error["error"]["param"]) == (400, "kv_transfer_params")


@pytest.mark.parametrize("allowed", [False, True])
async def test_the_endpoint_picker_has_envoy_drop_a_clients_rank_header(allowed: bool) -> None:
    async with ScriptedWorker() as worker, epp.picker_for(
            worker, allow_client_transfer_fields=allowed) as (stub, _, _):
        answers = await epp.exchange(stub, epp.headers(), epp.body(json.dumps(BODY).encode()))
    removed = list(answers[-1].request_body.response.header_mutation.remove_headers)
    assert ("x-data-parallel-rank" in removed) is not allowed
