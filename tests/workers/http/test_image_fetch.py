"""Remote image fetching against real HTTP servers on 127.0.0.1: internal targets refused by
default and on every redirect hop, names resolved once, bland errors, bytes that must be an
image."""

from __future__ import annotations

import gc
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx
import pytest

from openai_request.bodies import ApiError
from workers.http.image_fetch import ImageBudget, fetch_remote_images
from workers.http.image_policy import ImageHostPolicy, image_format
from workers.settings import WorkerSettings, WorkerSettingsError, load_worker_settings

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
SECRET = b"root:x:0:0:internal secret"


class Server:
    """A real HTTP server on 127.0.0.1 that records the requests it got."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        routes = self.routes = {
            "/a.png": (200, {}, PNG),
            "/secret": (200, {}, SECRET),
            "/error": (503, {}, b"backend down"),
        }
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Host")))
                status, headers, body = routes.get(self.path, (404, {}, b""))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        # serve_forever looks for shutdown() between polls, every 0.5 s unless told
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.01}, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def body(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}]}


def settings(*allow: str) -> WorkerSettings:
    return WorkerSettings(allow_image_hosts=allow, image_fetch_timeout=5.0)


class StubResolver:
    """Answers names from a table and counts the lookups."""

    def __init__(self, table: dict[str, list[str] | list[list[str]]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        answer = self.table[host]
        if answer and isinstance(answer[0], list):  # one answer per lookup, in turn
            return list(answer[min(len(self.calls), len(answer)) - 1])  # type: ignore[arg-type]
        return list(answer)  # type: ignore[arg-type]


async def fetched(b: dict[str, Any], s: WorkerSettings, **kw: Any) -> dict[str, bytes]:
    """Every remote image of ``b``, by URL, in the order they were used."""
    images: dict[str, bytes] = {}

    async def use(url: str, data: bytes) -> None:
        assert url not in images, f"{url} used twice"
        images[url] = data

    await fetch_remote_images(b, s, use, **kw)
    return images


async def refused(b: dict[str, Any], s: WorkerSettings, **kw: Any) -> str:
    with pytest.raises(ApiError) as info:
        await fetched(b, s, **kw)
    assert info.value.status == 400
    return str(info.value.message)


async def test_loopback_is_refused_by_default_without_a_connection(server: Server) -> None:
    assert await refused(body(server.url("/a.png")), settings()) == "image URL not allowed"
    assert server.requests == [], "the worker never connected"


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata, link-local
    "http://10.1.2.3/x.png", "http://192.168.0.1/x.png", "http://172.16.0.1/x.png",
    "http://[::1]/x.png", "http://[fd00::1]/x.png", "http://[fe80::1]/x.png",
    "http://[::ffff:127.0.0.1]/x.png", "http://0.0.0.0/x.png", "http://224.0.0.1/x.png",
])
async def test_internal_literals_are_refused(url: str) -> None:
    assert await refused(body(url), settings()) == "image URL not allowed"


async def test_a_name_is_refused_when_any_address_is_internal(server: Server) -> None:
    resolver = StubResolver({"cdn.test": ["93.184.216.34", "127.0.0.1"]})
    url = server.url("/a.png", host="cdn.test")
    assert await refused(body(url), settings(), resolver=resolver) == "image URL not allowed"
    assert server.requests == []


async def test_an_allowed_block_is_fetched(server: Server) -> None:
    url = server.url("/a.png")
    assert await fetched(body(url), settings("127.0.0.0/8")) == {url: PNG}


async def test_a_name_resolves_once_and_the_checked_address_is_connected(
        server: Server) -> None:
    # The first answer is allowed; a rebinding answer (metadata address) on a second lookup
    # must never be used: the fetch connects to the address it checked.
    resolver = StubResolver({"images.test": [["127.0.0.1"], ["169.254.169.254"]]})
    url = server.url("/a.png", host="images.test")
    got = await fetched(body(url), settings("127.0.0.1/32"), resolver=resolver)
    assert got == {url: PNG}
    assert resolver.calls == ["images.test"]
    assert server.requests == [("/a.png", f"images.test:{server.port}")]


async def test_every_redirect_hop_is_checked(server: Server) -> None:
    # images.test is allowed by name; it redirects to the loopback literal, which is not.
    server.routes["/hop"] = (302, {"Location": server.url("/secret")}, b"")
    resolver = StubResolver({"images.test": ["127.0.0.1"]})
    url = server.url("/hop", host="images.test")
    message = await refused(body(url), settings("images.test"), resolver=resolver)
    assert message == "image URL not allowed"
    assert [path for path, _ in server.requests] == ["/hop"], "/secret was never asked for"


async def test_an_allowed_redirect_is_followed(server: Server) -> None:
    server.routes["/hop"] = (301, {"Location": "/a.png"}, b"")
    url = server.url("/hop")
    assert await fetched(body(url), settings("127.0.0.1")) == {url: PNG}


async def test_errors_do_not_reveal_the_target(server: Server) -> None:
    for path in ("/error", "/missing", "/secret"):  # 503, 404, and bytes that are no image
        message = await refused(body(server.url(path)), settings("127.0.0.1"))
        assert message == "image fetch failed"


async def test_an_oversize_image_fails() -> None:
    s = Server()
    s.routes["/big.png"] = (200, {}, PNG + b"\0" * 200)
    s.thread.start()
    try:
        small = WorkerSettings(allow_image_hosts=("127.0.0.1",), max_image_bytes=100)
        assert await refused(body(s.url("/big.png")), small) == "image fetch failed"
    finally:
        s.httpd.shutdown()
        s.httpd.server_close()


def test_image_formats_by_magic_bytes() -> None:
    assert image_format(PNG) == "png"
    assert image_format(b"\xff\xd8\xff\xe0" + b"\0" * 8) == "jpeg"
    assert image_format(b"GIF89a....") == "gif"
    assert image_format(b"RIFF\0\0\0\0WEBPVP8 ") == "webp"
    assert image_format(b"BM" + b"\0" * 12) == "bmp"
    assert image_format(b"\0\0\0\x1cftypavif") == "avif"
    assert image_format(SECRET) is None
    assert image_format(b"") is None
    assert image_format(b"RIFF\0\0\0\0WAVEfmt ") is None


def test_policy_parsing() -> None:
    policy = ImageHostPolicy.parse(["10.0.0.0/8", "Images.Internal.", " ", "::1"])
    assert policy.allows_name("images.internal")
    assert not policy.allows_name("other.internal")
    assert len(policy.networks) == 2
    with pytest.raises(ValueError):
        ImageHostPolicy.parse(["not a host/"])
    assert load_worker_settings({"allow_image_hosts": "10.0.0.0/8,img.test"}
                                ).allow_image_hosts == ("10.0.0.0/8", "img.test")
    with pytest.raises(WorkerSettingsError, match="allow_image_hosts"):
        load_worker_settings({"allow_image_hosts": "bad host!"})


async def test_the_worker_api_refuses_an_internal_image_and_serves_an_allowed_one(
        server: Server) -> None:
    from workers.http.api import create_app

    chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": server.url("/a.png")}}]}], "max_tokens": 1}
    answers = []
    for allow in ((), ("127.0.0.1",)):
        app = create_app(WorkerSettings(events_port=None, speedup=1e6, mm_tokens_per_image=4,
                                        allow_image_hosts=allow))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://w") as c:
            answers.append(await c.post("/v1/chat/completions", json=chat))
    refused, served = answers
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "image URL not allowed"
    assert served.status_code == 200, served.text
    assert [path for path, _ in server.requests] == ["/a.png"], "only the allowed fetch ran"


# -- fan-out limits: images per request, bytes per request, bytes across requests ----------

def big_png(n: int, tag: int) -> bytes:
    return PNG + bytes([tag]) * (n - len(PNG))


async def limited(b: dict[str, Any], s: WorkerSettings, status: int, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        await fetched(b, s, **kw)
    assert info.value.status == status
    return info.value


async def test_too_many_images_are_refused_before_any_fetch(server: Server) -> None:
    s = WorkerSettings(allow_image_hosts=("127.0.0.1",), max_images_per_request=4)
    for i in range(5):
        server.routes[f"/a{i}.png"] = (200, {}, PNG)
    urls = [server.url(f"/a{i}.png") for i in range(5)]
    error = await limited(body(*urls), s, 400)
    assert error.message == "a request may carry at most 4 images (max_images_per_request)"
    assert error.limit == "max_images_per_request"
    assert server.requests == [], "nothing was fetched"
    # Inline images count too: the limit is on image parts, however given.
    inline = "data:image/png;base64,iVBORw0KGgo="
    error = await limited(body(*urls[:2], *[inline] * 3), s, 400)
    assert error.limit == "max_images_per_request"
    assert await fetched(body(*urls[:4]), s) == {u: PNG for u in urls[:4]}


async def test_the_images_of_one_request_are_bounded_in_bytes_together(server: Server) -> None:
    for i in range(4):
        server.routes[f"/big{i}.png"] = (200, {}, big_png(400, i))
    s = WorkerSettings(allow_image_hosts=("127.0.0.1",), max_image_request_bytes=1000)
    urls = [server.url(f"/big{i}.png") for i in range(4)]
    assert len(await fetched(body(*urls[:2]), s)) == 2  # 800 bytes: within
    error = await limited(body(*urls), s, 400)  # 1,600 bytes: each image alone is fine
    assert error.message == (
        "the images of a request may total at most 1000 bytes (max_image_request_bytes)")
    assert error.limit == "max_image_request_bytes"


async def test_images_in_flight_across_requests_share_one_budget(server: Server) -> None:
    for i in range(2):
        server.routes[f"/big{i}.png"] = (200, {}, big_png(400, i))
    s = WorkerSettings(allow_image_hosts=("127.0.0.1",), max_image_fetch_bytes=1000)
    budget = ImageBudget(s.max_image_fetch_bytes)
    assert budget.take(600)  # another request's images, still being fetched
    urls = [server.url(f"/big{i}.png") for i in range(2)]
    error = await limited(body(*urls), s, 503, budget=budget)
    assert error.message == ("images being fetched for other requests fill this worker's "
                             "budget of 1000 bytes (max_image_fetch_bytes); try again")
    assert budget.in_flight == 600, "the refused request gave back what it had taken"
    budget.give(600)
    assert len(await fetched(body(*urls), s, budget=budget)) == 2
    assert budget.in_flight == 0, "a finished fetch gives its bytes back"


def test_fan_out_limits_must_be_positive() -> None:
    for name in ("max_images_per_request", "max_image_request_bytes", "max_image_fetch_bytes"):
        with pytest.raises(WorkerSettingsError, match=f"^{name} must be positive, got 0$"):
            WorkerSettings(**{name: 0})



def connections_alive() -> int:
    # By exact type: isinstance would read attributes of every object (torch's deprecated
    # ones warn).
    return sum(type(o) is httpcore.AsyncHTTP11Connection for o in gc.get_objects())


async def test_refused_fetches_do_not_leave_their_connections_to_the_cycle_collector(
        server: Server) -> None:
    # A connection holds what its socket read ahead of the fetch, and a fetch stopped early
    # leaves its connections in reference cycles; a worker's collector runs rarely
    # (kvroute.serve). With the automatic collector off, each refused fetch must free those
    # of the fetches refused before it (its own are still closing).
    for i in range(4):
        server.routes[f"/big{i}.png"] = (200, {}, big_png(400, i))
    s = WorkerSettings(allow_image_hosts=("127.0.0.1",), max_image_request_bytes=1000)
    urls = [server.url(f"/big{i}.png") for i in range(4)]
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            assert (await limited(body(*urls), s, 400)).limit == "max_image_request_bytes"
        alive = connections_alive()
    finally:
        gc.enable()
    assert alive <= len(urls), f"{alive} connections of 3 refused fetches of 4 images alive"
