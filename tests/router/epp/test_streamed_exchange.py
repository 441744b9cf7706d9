"""The full-duplex exchange reading its body as it arrives: under ``--tokenize match`` it
decides once the prompt's match ends inside what arrived, before the body's last chunk, sends
every chunk on byte for byte, and picks the worker the buffered path picks for the same body;
what it cannot settle early it decides at the end, as before."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from router.epp.exchange import Exchange
from router.epp.picker import Picker
from router.fleet.worker_table import WorkerInfo
from router.service import RouterService
from router.settings import RouterSettings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer

PROMPT = " ".join(f"the gateway streams block {i} of a long prompt" for i in range(2000))
CHUNK = 4096


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def service_for(tmp_path: Path, http: httpx.AsyncClient, tokenize: str = "match",
                adapters: tuple[str, ...] = ()) -> RouterService:
    """Two workers on distinct ports serving ``m`` (and ``adapters``), nothing held, a fixed
    seed: built alike each call."""
    write_tiny_tokenizer(tmp_path)
    service = RouterService(RouterSettings(tokenizer=str(tmp_path), block_size=16, seed=1,
                                           tokenize=tokenize), http)
    for w in range(2):
        service.registry.adopt(WorkerInfo(url=f"http://127.0.0.1:{8100 + w}", model="m",
                                          lora_adapters=adapters, block_size=16,
                                          tokenizer=service.tokenizer.identity,
                                          instance_id=f"i{w}", max_model_len=1 << 22))
    return service


def headers(path: str, length: int | None, duplex: bool = True) -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":path", raw_value=path.encode())]
    if length is not None:
        values.append(base_pb2.HeaderValue(key="content-length", raw_value=str(length).encode()))
    request = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=values)))
    if duplex:
        request.protocol_config.request_body_mode = \
            processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return request


def streamed(service: RouterService, path: str, raw: bytes, *, length: bool = True
             ) -> tuple[Exchange, list[list[ep.ProcessingResponse]]]:
    """Send ``raw`` in chunks; the exchange and the answers to each message (headers first)."""
    exchange = Exchange(Picker(service))
    answers = [exchange.on_message(headers(path, len(raw) if length else None))]
    for at in range(0, len(raw), CHUNK):
        piece = raw[at:at + CHUNK]
        answers.append(exchange.on_message(ep.ProcessingRequest(request_body=ep.HttpBody(
            body=piece, end_of_stream=at + CHUNK >= len(raw)))))
    return exchange, answers


def buffered_endpoint(service: RouterService, path: str, raw: bytes) -> str:
    exchange = Exchange(Picker(service))
    exchange.on_message(headers(path, len(raw), duplex=False))
    exchange.on_message(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw,
                                                                      end_of_stream=True)))
    assert exchange.pick is not None
    return exchange.pick.endpoint


def sent_on(answers: list[list[ep.ProcessingResponse]]) -> tuple[int, bytes, str]:
    """The index of the message that got the headers answer, the body sent on, and the
    destination named."""
    decided, body, endpoint = -1, b"", ""
    last_end = False
    for i, batch in enumerate(answers):
        for a in batch:
            if a.WhichOneof("response") == "request_headers":
                decided = i
                (option,) = a.request_headers.response.header_mutation.set_headers
                endpoint = option.header.raw_value.decode()
            elif a.WhichOneof("response") == "request_body":
                s = a.request_body.response.body_mutation.streamed_response
                assert not last_end, "nothing after the end of the stream"
                body += s.body
                last_end = s.end_of_stream
    assert last_end, "the body's end is sent on"
    return decided, body, endpoint


def hold(service: RouterService, http: httpx.AsyncClient, worker: int,
         body: dict[str, object], kind: str, share: float) -> None:
    """Worker ``worker`` holds the first ``share`` of the body's blocks (by the exact hashes
    of a ``--tokenize full`` twin)."""
    folder = Path(str(service.settings.tokenizer)) / "exact"
    folder.mkdir(exist_ok=True)
    exact = service_for(folder, http, "full")
    hashes = exact.decide(body, kind).hashes
    target = service.registry.candidates()[worker].id
    service.index.store_hashes(target, hashes[:int(len(hashes) * share)])


BODIES = [
    ("/v1/completions", "completions", {"model": "m", "prompt": PROMPT, "max_tokens": 4}),
    ("/v1/chat/completions", "chat", {"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]}),
    # OpenAI's SDKs write the messages first: the fleet's only model stands in until then.
    ("/v1/chat/completions", "chat", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}],
        "model": "m"}),
]


@pytest.mark.parametrize(("path", "kind", "body"), BODIES)
@pytest.mark.parametrize("share", [0.0, 0.2])
async def test_decided_before_the_last_chunk_on_the_buffered_choice(
        tmp_path: Path, http: httpx.AsyncClient, path: str, kind: str,
        body: dict[str, object], share: float) -> None:
    raw = json.dumps(body).encode()
    services = []
    for name in ("streamed", "buffered"):
        (tmp_path / name).mkdir()
        services.append(service_for(tmp_path / name, http))
        hold(services[-1], http, 1, body, kind, share)
    exchange, answers = streamed(services[0], path, raw)
    decided, sent, endpoint = sent_on(answers)
    assert exchange.early and 0 < decided < len(answers) - 1
    assert decided <= len(raw) // CHUNK // 2  # well before the end: the match ends early
    assert sent == raw  # every byte sent on, unchanged, in order
    assert endpoint == buffered_endpoint(services[1], path, raw)
    if share:
        assert endpoint == "127.0.0.1:8101"  # the holder
    # The booking counts the whole prompt's length, as the buffered decision's does.
    assert exchange.pick is not None
    early_total = exchange.pick.route.prompt.total_tokens
    buffered = services[1].decide(body, kind)
    assert abs(early_total - buffered.prompt.total_tokens) < 0.1 * buffered.prompt.total_tokens
    exchange.close()
    assert services[0].core.in_flight(exchange.pick.worker.id) == 0


async def test_a_prompt_held_to_its_end_is_decided_at_the_end(
        tmp_path: Path, http: httpx.AsyncClient) -> None:
    path, kind, body = BODIES[0]
    raw = json.dumps(body).encode()
    service = service_for(tmp_path, http)
    hold(service, http, 0, body, kind, 1.0)
    exchange, answers = streamed(service, path, raw)
    decided, sent, endpoint = sent_on(answers)
    assert not exchange.early and decided == len(answers) - 1
    assert sent == raw and endpoint == "127.0.0.1:8100"


@pytest.mark.parametrize("raw", [
    # the model after the prompt, from a fleet serving two names (a model and an adapter)
    json.dumps({"prompt": PROMPT, "model": "m"}).encode(),
    # a repeated key: the reader gives up, the buffered parse refuses it (a 400 at the end)
    b'{"model": "m", "model": "m", "prompt": ' + json.dumps(PROMPT).encode() + b"}",
    json.dumps({"model": "m", "prompt": PROMPT.split()}).encode(),  # a 400 at the end
])
async def test_what_cannot_be_settled_early_is_decided_at_the_end(
        tmp_path: Path, http: httpx.AsyncClient, raw: bytes) -> None:
    exchange, answers = streamed(service_for(tmp_path, http, adapters=("m-lora",)),
                                 "/v1/completions", raw)
    assert all(not batch for batch in answers[:-1])  # nothing sent before the end
    assert not exchange.early
    if b"[" not in raw and b'"model": "m", "model"' not in raw:
        assert exchange.pick is not None and sent_on(answers)[1] == raw
    else:
        assert answers[-1][0].immediate_response.status.code == 400


async def test_without_content_length_or_match_mode(tmp_path: Path,
                                                    http: httpx.AsyncClient) -> None:
    path, _, body = BODIES[0]
    raw = json.dumps(body).encode()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # No content-length: decided early all the same, the rest of the length estimated as
    # none (what arrived is all that is known).
    exchange, answers = streamed(service_for(tmp_path / "a", http), path, raw, length=False)
    assert exchange.early and sent_on(answers)[1] == raw
    # --tokenize full walks nothing: the whole prompt is needed, decided at the end.
    exchange, answers = streamed(service_for(tmp_path / "b", http, "full"), path, raw)
    assert not exchange.early and sent_on(answers)[1] == raw


async def test_a_body_past_the_limit_is_refused_while_streaming(
        tmp_path: Path, http: httpx.AsyncClient) -> None:
    service = service_for(tmp_path, http, adapters=("m-lora",))
    service.settings = dataclasses.replace(service.settings, max_body_bytes=3 * CHUNK)
    # never settled early: the model comes after the prompt and the fleet serves two names
    raw = json.dumps({"prompt": PROMPT, "model": "m"}).encode()
    _, answers = streamed(service, "/v1/completions", raw, length=False)
    refusals = [a for batch in answers for a in batch if a.HasField("immediate_response")]
    assert [r.immediate_response.status.code for r in refusals] == [413]
    assert answers[4] == refusals and not any(answers[5:])  # the rest is dropped
    # a declared length past the limit is refused at the headers, before any byte is held
    _, answers = streamed(service, "/v1/completions", raw)
    refusals = [a for batch in answers for a in batch if a.HasField("immediate_response")]
    assert [r.immediate_response.status.code for r in refusals] == [413]
    assert answers[0] == refusals and not any(answers[1:])
