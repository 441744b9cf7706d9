"""One log format for kvroute's lines and uvicorn's, text or JSON, with the id of the request
each line was written for; the id is the client's x-request-id when usable, else a new one
that is passed on (the router's request headers go to the worker) and answered."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from httpapi.logs import RequestIds, configure_logging, request_id


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    kept = (list(root.handlers), root.level)
    out = io.StringIO()
    yield out
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in kept[0]:
        root.addHandler(handler)
    root.setLevel(kept[1])


def _into(out: io.StringIO) -> None:
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(out)


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    logging.getLogger("kvroute.test").warning("handling %s", scope["path"])
    seen = dict(scope["headers"]).get(b"x-request-id", b"").decode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"x-seen", seen.encode())]})
    await send({"type": "http.response.body", "body": (request_id() or "").encode()})


async def test_json_lines_carry_the_request_id_and_uvicorns_lines_share_the_format(
        captured: io.StringIO) -> None:
    configure_logging("info", "json")
    _into(captured)
    app = RequestIds(_echo)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://a") as c:
        given = await c.get("/one", headers={"x-request-id": "client-7"})
        made = await c.get("/two")
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert given.headers["x-request-id"] == given.text == given.headers["x-seen"] == "client-7"
    new = made.headers["x-request-id"]
    assert new and new == made.text == made.headers["x-seen"]  # passed on to the app
    assert [(x["logger"], x["message"], x.get("request_id")) for x in lines] == [
        ("kvroute.test", "handling /one", "client-7"),
        ("kvroute.test", "handling /two", new),
        ("uvicorn.error", "Application startup complete.", None),
    ]
    assert all(x["time"].endswith("Z") and x["level"] in ("warning", "info") for x in lines)


async def test_text_lines_name_the_request_and_an_unusable_client_id_is_replaced(
        captured: io.StringIO) -> None:
    configure_logging("warning", "text")
    _into(captured)
    app = RequestIds(_echo)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://a") as c:
        forged = await c.get("/x", headers={"x-request-id": "a b\x7f" + "z" * 200})
    rid = forged.headers["x-request-id"]
    assert rid != "" and " " not in rid and len(rid) < 40
    (line,) = captured.getvalue().splitlines()
    assert line.endswith(f"WARNING kvroute.test: handling /x [request {rid}]")


def test_an_unknown_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml' is not one of text, json"):
        configure_logging("info", "xml")
    with pytest.raises(ValueError, match="log level 'loud'"):
        configure_logging("loud", "text")


async def _noop(scope: Any, receive: Any, send: Any) -> None:
    return None


def test_naming_in_place_changes_the_callers_scope_and_naming_a_copy_does_not() -> None:
    ids = RequestIds(_noop)
    for in_place in (False, True):
        given = [(b"host", b"h"), (b"x-request-id", b"client-7")]
        scope = {"type": "http", "headers": given}
        named, rid = ids.named(scope, in_place=in_place)
        assert rid == "client-7" and named["headers"] == given  # usable: kept as it came
        for headers in ([(b"host", b"h")], [(b"x-request-id", b"a b"), (b"host", b"h")]):
            before = list(headers)
            scope = {"type": "http", "headers": headers}
            named, rid = ids.named(scope, in_place=in_place)
            assert rid != "a b" and named["headers"] == [(b"host", b"h"),
                                                         (b"x-request-id", rid.encode())]
            assert (named is scope) is in_place
            if not in_place:
                assert scope["headers"] == before, "the caller's scope is left as it was"
