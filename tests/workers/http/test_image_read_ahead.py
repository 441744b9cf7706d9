"""A request's image fetches run ahead of the images' use only as far as the read-ahead's bytes
allow (:mod:`workers.http.image_read_ahead`): against a real HTTP server on 127.0.0.1 serving
large images, and the rules alone, driven by hand."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from openai_request.images import image_digest
from openai_request.prompts import build_prompt, image_refs
from openai_request.tokenizer import ByteTokenizer
from tests.workers.http.test_image_fetch import Server, big_png, body
from workers.http.image_fetch import fetch_remote_images, remote_image_digests
from workers.http.image_read_ahead import READ_BYTES, ReadAhead, least_read_ahead
from workers.settings import WorkerSettings, WorkerSettingsError, load_worker_settings

KiB = 1024
IMAGE = 400 * KiB


@pytest.fixture
def server() -> Iterator[Server]:
    """An image host on 127.0.0.1 (:class:`tests.workers.http.test_image_fetch.Server`)."""
    s = Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def settings(**kw: Any) -> WorkerSettings:
    return WorkerSettings(allow_image_hosts=("127.0.0.1",), image_fetch_timeout=30.0,
                          max_image_bytes=IMAGE, **kw)


async def test_a_request_of_many_large_images_holds_no_more_than_the_read_ahead(
        server: Server) -> None:
    # Eight images of 400 KiB (3.2 MiB) through a read-ahead of one image and two reads: the
    # fetches run ahead of the use only as far as it allows, and every image still arrives,
    # whole and in order.
    images = [big_png(IMAGE, i) for i in range(8)]
    for i, data in enumerate(images):
        server.routes[f"/big{i}.png"] = (200, {}, data)
    urls = [server.url(f"/big{i}.png") for i in range(8)]
    limit = least_read_ahead(IMAGE)
    ahead = ReadAhead(limit, IMAGE)
    used: list[tuple[str, bytes]] = []
    held_at_use: list[int] = []

    async def use(url: str, data: bytes) -> None:
        held_at_use.append(ahead.held)
        used.append((url, data))
        for _ in range(50):  # a slow use: the other fetches get every chance to run ahead
            await asyncio.sleep(0)

    await fetch_remote_images(body(*urls), settings(max_image_read_ahead_bytes=limit), use,
                              ahead=ahead)
    assert used == list(zip(urls, images, strict=True))  # nothing lost, in order
    assert sum(map(len, images)) > 6 * limit
    assert ahead.peak <= limit and max(held_at_use) <= limit
    assert ahead.held == 0 and ahead.current == 8


async def test_digests_made_as_images_arrive_are_the_prompts_own(server: Server) -> None:
    # Repeats and UUIDs: the digests the worker makes (each image hashed once per UUID it is
    # named with, then dropped) give the prompt that handing build_prompt the bytes gives.
    a, b = big_png(IMAGE, 1), big_png(300 * KiB, 2)
    server.routes["/a.png"], server.routes["/b.png"] = (200, {}, a), (200, {}, b)
    ua, ub = server.url("/a.png"), server.url("/b.png")
    chat = body(ua, ub, ua, ua)
    chat["mm_uuids"] = [None, "u-b", "u-a", None]
    s = settings(max_image_read_ahead_bytes=least_read_ahead(IMAGE))
    digests = await remote_image_digests(chat, s)
    assert digests == {(ua, None): hashlib.sha256(a).hexdigest(), (ub, "u-b"):
                       image_digest(b, "u-b"), (ua, "u-a"): image_digest(a, "u-a")}
    assert [(r.url, r.uuid) for r in image_refs(chat)] == [
        (ua, None), (ub, "u-b"), (ua, "u-a"), (ua, None)]
    tokenizer = ByteTokenizer()
    kw: Any = {"mm_tokens_per_image": 4, "max_image_bytes": IMAGE}
    given = build_prompt(chat, "chat", tokenizer, fetch=None,
                         digests=lambda url, uuid: digests.get((url, uuid)), **kw)
    fetched = build_prompt(chat, "chat", tokenizer, fetch={ua: a, ub: b}.get, **kw)
    assert given == fetched and all(span.digest for span in given.images)


def test_an_image_ahead_waits_for_room_kept_for_the_current_one() -> None:
    ahead = ReadAhead(least_read_ahead(1000) + 500, 1000)
    # Image 0 is current: it may read while one more read fits under the bound.
    assert ahead.fits(0) and ahead.fits(1)
    ahead.read(1, 400)  # ahead: 400 of the 500 spare
    assert ahead.fits(1)
    ahead.read(1, 200)  # ahead: 600, past the room a whole image 0 and a read need
    assert not ahead.fits(1) and not ahead.fits(2)
    assert ahead.fits(0)  # the current image always has room to be read whole
    ahead.read(0, 1000)
    assert ahead.fits(0) and ahead.held == 1600
    ahead.used(0)  # image 0's bytes go; image 1 is current and may read again
    assert ahead.held == 600 and ahead.current == 1 and ahead.fits(1) and ahead.fits(2)


async def test_a_fetch_waiting_for_room_reads_again_once_an_image_is_used() -> None:
    ahead = ReadAhead(least_read_ahead(1000), 1000)
    ahead.read(1, 1)  # anything ahead leaves no room at the least bound
    waiting = asyncio.create_task(ahead.may_read(2))
    await asyncio.sleep(0)
    assert not waiting.done()
    ahead.used(0)
    ahead.used(1)
    await asyncio.wait_for(waiting, 1)  # bounded; woken by the use, not by time
    assert ahead.held == 0


def test_the_read_ahead_must_hold_one_image_and_two_reads() -> None:
    least = 20 * 1024 * 1024 + 2 * READ_BYTES
    assert WorkerSettings().max_image_read_ahead_bytes == 64 * 1024 * 1024
    assert WorkerSettings(max_image_read_ahead_bytes=least).max_image_read_ahead_bytes == least
    with pytest.raises(WorkerSettingsError, match=(
            rf"^max_image_read_ahead_bytes must hold one whole image \(max_image_bytes "
            rf"20971520\) and two reads of 65536: at least {least}, got {least - 1}$")):
        WorkerSettings(max_image_read_ahead_bytes=least - 1)
    with pytest.raises(WorkerSettingsError, match=r"^max_image_read_ahead_bytes must be "
                       r"positive, got 0$"):
        WorkerSettings(max_image_read_ahead_bytes=0)
    assert load_worker_settings({"max_image_read_ahead_bytes": "30000000"}
                                ).max_image_read_ahead_bytes == 30_000_000
    with pytest.raises(ValueError, match="at least 1131072 bytes for images of 1000000"):
        ReadAhead(1_000_000, 1_000_000)


async def test_the_worker_serves_a_chat_whose_images_pass_its_read_ahead(
        server: Server) -> None:
    from workers.http.api import create_app

    for i in range(6):
        server.routes[f"/big{i}.png"] = (200, {}, big_png(IMAGE, i))
    parts = [{"type": "image_url", "image_url": {"url": server.url(f"/big{i}.png")}}
             for i in range(6)]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                      *parts]}], "max_tokens": 1}
    app = create_app(settings(events_port=None, speedup=1e6, mm_tokens_per_image=4,
                              max_image_read_ahead_bytes=least_read_ahead(IMAGE)))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://w") as c:
        answer = await c.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text  # 2.4 MiB of images through 528 KiB
    assert sorted(path for path, _ in server.requests) == [f"/big{i}.png" for i in range(6)]
