"""The preamble both apps share (:mod:`httpapi.app`): refusals and clients that left are
answered the same way on FastAPI routes and on raw routes, a raw route answers only ``POST``
(FastAPI keeps the other methods), and the admin check guards a handler."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.types import Receive, Scope, Send

from httpapi.app import Admin, new_app
from httpapi.body import ClientGone, receive_body
from openai_request.bodies import ApiError


class FakeState:
    """An :class:`httpapi.app.AppState` that writes down what it is told."""

    def __init__(self) -> None:
        self.refused_statuses: list[int] = []
        self.gone: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        yield

    def refused(self, error: ApiError) -> None:
        self.refused_statuses.append(error.status)

    def client_gone(self, stage: str) -> None:
        self.gone.append(stage)

    def render_metrics(self) -> tuple[bytes, str]:
        return b"# a metric\n", "text/plain; version=0.0.4"


class Echo:
    """A raw route: echoes its body; ``refuse`` in it is a 422, ``leave`` a client gone."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await receive_body(None, receive, 1024)
        if body == b"refuse":
            raise ApiError(422, "refused by the raw route", param="body")
        if body == b"leave":
            raise ClientGone
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def app_for(state: FakeState) -> FastAPI:
    app = new_app("test", state, {"/raw": Echo()})
    admin = Admin("s3cret")

    @app.post("/fastapi")
    async def fastapi_route(request: Request) -> dict[str, str]:
        admin(request)
        raise ApiError(409, "refused by a FastAPI route", code="busy")

    return app


@contextlib.asynccontextmanager
async def client_for(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                 base_url="http://test") as client:
        yield client


async def test_a_raw_route_answers_post_ahead_of_fastapi() -> None:
    async with client_for(app_for(FakeState())) as client:
        r = await client.post("/raw", content=b"hello")
        assert (r.status_code, r.content) == (200, b"hello")
        assert (await client.get("/raw")).status_code == 405  # FastAPI keeps other methods
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/metrics")).text == "# a metric\n"


@pytest.mark.parametrize("path", ["/raw", "/fastapi"])
async def test_a_refusal_is_an_openai_error_and_is_told_to_the_state(path: str) -> None:
    state = FakeState()
    async with client_for(app_for(state)) as client:
        headers = {"authorization": "Bearer s3cret"}
        r = await client.post(path, content=b"refuse", headers=headers)
    status = 422 if path == "/raw" else 409
    assert r.status_code == status
    assert r.json()["error"]["message"].startswith("refused by")
    assert state.refused_statuses == [status]


async def test_a_client_gone_from_a_raw_route_is_counted_and_answered_499() -> None:
    state = FakeState()
    async with client_for(app_for(state)) as client:
        r = await client.post("/raw", content=b"leave")
    assert r.status_code == 499
    assert state.gone == ["body"]


async def test_the_admin_check_refuses_a_request_without_the_token() -> None:
    state = FakeState()
    async with client_for(app_for(state)) as client:
        r = await client.post("/fastapi", content=b"")
    assert r.status_code == 401
    assert state.refused_statuses == [401]


async def test_receive_body_refuses_a_body_past_the_limit_as_it_arrives() -> None:
    messages = iter([{"type": "http.request", "body": b"x" * 600, "more_body": True},
                     {"type": "http.request", "body": b"x" * 600, "more_body": False}])

    async def receive() -> dict[str, object]:
        return next(messages)

    with pytest.raises(ApiError) as refused:
        await receive_body(None, receive, 1000)
    assert refused.value.status == 413
    with pytest.raises(ApiError, match="not a number"):
        await receive_body("12x", receive, 1000)


async def test_receive_body_raises_client_gone_on_a_disconnect() -> None:
    async def receive() -> dict[str, object]:
        return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        await receive_body(None, receive, 1000)
