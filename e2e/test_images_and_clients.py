"""Images routed by digest and by UUID, never served from another image's KV; and the
official ``openai`` client against the router, unmodified."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from e2e.harness import NOT_YET, Router
from tests.support.eventually import eventually_blocking

IMAGE_A = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
IMAGE_B = b"\x89PNG\r\n\x1a\n" + bytes(reversed(range(256))) * 4
#: The image server runs on loopback, which workers refuse to fetch from unless allowed.
ALLOW_LOOPBACK = {"allow_image_hosts": "127.0.0.1"}
LEAD = "Describe the product photo in detail, then list its defects. " * 3  # 186 bytes


@pytest.fixture
def image_server() -> Iterator[str]:
    """Serves /a.png and /b.png on 127.0.0.1 for the workers to fetch."""
    images = {"/a.png": IMAGE_A, "/b.png": IMAGE_B}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = images.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def chat(router: Router, url: str, tail: str, uuid: str | None = None) -> Any:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    body = {"model": "kvroute-sim", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": LEAD}, part, {"type": "text", "text": tail}]}]}
    return router.client.post("/v1/chat/completions", json=body)


def data_url(content: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(content).decode()


def cached(answer: Any) -> int:
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_images_by_digest_route_to_the_holder(cluster: Any) -> None:
    router, _ = cluster(workers=3)
    first = chat(router, data_url(IMAGE_A), "Question one. " * 6)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    eventually_blocking(lambda: sum(w["blocks"]["device"] for w in router.workers()) >= 7,
                        "indexed", tolerate=NOT_YET)
    again = chat(router, data_url(IMAGE_A), "Another question entirely. " * 6)
    assert again.headers["x-kvroute-worker"] == holder
    matched = int(again.headers["x-kvroute-matched-blocks"])
    assert matched * 32 == cached(again) > len(LEAD), "the image's blocks were reused"


def test_images_by_uuid_route_without_the_bytes(cluster: Any, image_server: str) -> None:
    router, _ = cluster(workers=3, worker_settings=ALLOW_LOOPBACK)
    first = chat(router, f"{image_server}/a.png", "Question one. " * 6, uuid="sku-001")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    eventually_blocking(lambda: sum(w["blocks"]["device"] for w in router.workers()) >= 7,
                        "indexed", tolerate=NOT_YET)
    # the router cannot fetch a remote image, but the UUID names it
    again = chat(router, f"{image_server}/a.png", "Another question. " * 6, uuid="sku-001")
    assert again.headers["x-kvroute-worker"] == holder
    assert int(again.headers["x-kvroute-matched-blocks"]) * 32 == cached(again) > len(LEAD)
    # without a UUID the router stops matching at the remote image
    plain = chat(router, f"{image_server}/a.png", "A third. " * 6)
    assert int(plain.headers["x-kvroute-matched-blocks"]) <= len(LEAD) // 32 + 1


def test_other_content_under_the_same_uuid_is_never_served_from_cache(
        cluster: Any, image_server: str) -> None:
    router, _ = cluster(workers=1, worker_settings=ALLOW_LOOPBACK)
    a = chat(router, f"{image_server}/a.png", "Question. " * 6, uuid="sku-001")
    assert a.status_code == 200
    eventually_blocking(lambda: router.workers()[0]["blocks"]["device"] >= 7, "indexed",
                        tolerate=NOT_YET)
    b = chat(router, f"{image_server}/b.png", "Question. " * 6, uuid="sku-001")
    assert b.status_code == 200
    # the router's hint said "cached" (same UUID); the worker's reuse is by content
    assert int(b.headers["x-kvroute-matched-blocks"]) * 32 > cached(b)
    image_start = len(b"<|user|>\n") + len(LEAD)
    assert cached(b) <= image_start, "no block holding the image was reused"


def test_the_official_openai_client_works_unmodified(cluster: Any) -> None:
    router, _ = cluster(workers=2)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list()]
    assert models == ["kvroute-sim"]
    done = client.completions.create(model="kvroute-sim", prompt=LEAD, max_tokens=5)
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert len(done.choices[0].text) == 5
    chat_done = client.chat.completions.create(
        model="kvroute-sim", max_tokens=3, messages=[{"role": "user", "content": LEAD}])
    assert chat_done.choices[0].message.role == "assistant"
    assert chat_done.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="kvroute-sim", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": LEAD}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 4
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 32 * 32
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
