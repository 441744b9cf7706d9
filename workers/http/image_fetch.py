"""Fetches the ``http(s)`` images of a chat request, with a size, a time and a host limit.

Runs before tokenization (which is pure and synchronous): every remote image URL in the body is
fetched concurrently, and each image is used as soon as it and those before it have arrived:
:func:`remote_image_digests` hashes it under each UUID its parts give it and drops its bytes,
and the digests go to :func:`openai_request.prompts.build_prompt` (its ``digests``). The bytes
fetched and not yet used stay within ``max_image_read_ahead_bytes``
(:mod:`workers.http.image_read_ahead`: a fetch that runs too far ahead waits, nothing is
refused for it).

Each hop resolves the host once (:data:`Resolver`), checks every address against the
:class:`~workers.http.image_policy.ImageHostPolicy`, and connects to the first address by IP,
with the original name in the ``Host`` header and as the TLS server name. Redirects are
followed by hand, at most :data:`MAX_REDIRECTS`, each hop checked anew. The answer must be an
image by its magic bytes.

Fan-out is bounded three ways, each refusal naming its setting (:class:`ImageLimit`, counted
as ``kvroute_worker_image_limits`` by the HTTP layer):

1. ``max_images_per_request`` image parts (inline or remote) per request, checked before any
   fetch: 400.
2. ``max_image_request_bytes`` fetched bytes per request, all its images together, counted as
   they arrive: 400, and the request's other fetches are cancelled at once.
3. ``max_image_fetch_bytes`` fetched bytes in flight across all requests (:class:`ImageBudget`,
   one per worker): 503, since the request itself is not at fault; a request gives its bytes
   back when its fetch ends.

So one request fetches at most ``max_image_request_bytes`` of images and holds at most
``max_image_read_ahead_bytes`` of them at once, and all requests together fetch at most
``max_image_fetch_bytes`` at once, whatever their URLs answer.

A refused or failed fetch is a 400 that says only "image URL not allowed" or "image fetch
failed": neither the target's status nor its content, nor which check failed, reaches the
caller (the log has the details).

A fetch stopped early (a limit, a failure, the time limit, the client gone) leaves its
connections in reference cycles (httpx keeps a streamed answer and its stream in one, a task
group its failures' tracebacks in others), and each connection holds what its socket read
ahead of the fetch, up to a whole image (the HTTP client's socket reads without flow
control). A worker's cyclic collector runs rarely (:mod:`kvroute.serve`), so those bytes
stayed: a worker refusing 16 x 15 MB image requests grew by 75-85 MiB a request and never
gave it back. So a fetch that stops early runs the collector (5-15 ms on a loaded worker of a
shared 2-core machine), which frees every earlier such fetch's connections; its own are still
closing (the event loop holds them until their sockets close) and go with the next.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from openai_request.bodies import ApiError
from openai_request.images import image_digest
from openai_request.prompts import image_refs
from workers.http.image_policy import ImageHostPolicy, IpAddress, image_format
from workers.http.image_read_ahead import ReadAhead
from workers.settings import WorkerSettings

__all__ = ["MAX_REDIRECTS", "ImageBudget", "ImageLimit", "Resolver", "Use",
           "fetch_remote_images", "image_part_urls", "remote_image_digests",
           "remote_image_urls", "system_resolver"]

log = logging.getLogger(__name__)

#: Resolves ``(host, port)`` to IP address strings; the fetch connects to one of them.
Resolver = Callable[[str, int], Awaitable[list[str]]]
#: Uses one fetched image (its URL and bytes); its bytes are dropped once it returns.
Use = Callable[[str, bytes], Awaitable[None]]
MAX_REDIRECTS = 5
NOT_ALLOWED = "image URL not allowed"
FAILED = "image fetch failed"
#: Images from this size are hashed in a thread, not on the event loop.
_HASH_OFF_LOOP_BYTES = 256 * 1024


class ImageLimit(ApiError):
    """A request refused by a fan-out limit; ``limit`` names the setting."""

    def __init__(self, status: int, message: str, limit: str) -> None:
        super().__init__(status, message, param="messages")
        self.limit = limit


class ImageBudget:
    """Image bytes being fetched for all of one worker's requests, at most ``limit``.

    Invariant: ``in_flight`` is the sum of what :meth:`take` granted and :meth:`give` has not
    returned; it never exceeds ``limit``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the image budget must be at least 1 byte, got {limit}")
        self.limit = limit
        self.in_flight = 0

    def take(self, n: int) -> bool:
        """Take ``n`` bytes; False (nothing taken) when they would pass the limit."""
        if self.in_flight + n > self.limit:
            return False
        self.in_flight += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        assert 0 <= n <= self.in_flight, f"giving back {n} of {self.in_flight} bytes taken"
        self.in_flight -= n


class _Tally:
    """One request's fetched bytes, against its own limit and the worker's budget."""

    def __init__(self, limit: int, budget: ImageBudget) -> None:
        self.limit = limit
        self.budget = budget
        self.taken = 0

    def add(self, n: int) -> None:
        if self.taken + n > self.limit:
            raise ImageLimit(400, f"the images of a request may total at most {self.limit} "
                             "bytes (max_image_request_bytes)", "max_image_request_bytes")
        if not self.budget.take(n):
            raise ImageLimit(503, "images being fetched for other requests fill this "
                             f"worker's budget of {self.budget.limit} bytes "
                             "(max_image_fetch_bytes); try again", "max_image_fetch_bytes")
        self.taken += n

    def close(self) -> None:
        self.budget.give(self.taken)
        self.taken = 0


class _Refused(Exception):
    """The URL or one of its redirects points where the policy forbids."""


class _Failed(Exception):
    """The fetch did not give an image (status, size, format, network)."""


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve ``host`` with the system resolver (``getaddrinfo``)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def image_part_urls(body: dict[str, Any]) -> list[str]:
    """The URL of every image part of a chat body, in order, repeats included."""
    urls: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str):
                urls.append(url)
    return urls


def remote_image_urls(body: dict[str, Any]) -> list[str]:
    """The distinct ``http(s)`` image URLs of a chat body, in order."""
    return list(dict.fromkeys(u for u in image_part_urls(body)
                              if u.startswith(("http://", "https://"))))


def _literal(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def _checked_address(url: httpx.URL, policy: ImageHostPolicy, resolver: Resolver
                           ) -> IpAddress:
    if url.scheme not in ("http", "https") or not url.host:
        raise _Refused(f"{url.scheme!r} URL")
    host = url.host
    literal = _literal(host)
    if literal is not None:
        addresses = [literal]
    else:
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0])
                         for a in await resolver(host, url.port or 443)]
        except (OSError, ValueError) as exc:
            raise _Failed(f"{host} does not resolve: {exc}") from None
        if not addresses:
            raise _Failed(f"{host} does not resolve")
        if policy.allows_name(host):
            return addresses[0]
    refused = [str(a) for a in addresses if not policy.allows_address(a)]
    if refused:
        raise _Refused(f"{host} resolves to {', '.join(refused)}")
    return addresses[0]


async def _fetch_one(client: httpx.AsyncClient, url: str, max_bytes: int,
                     policy: ImageHostPolicy, resolver: Resolver, tally: _Tally,
                     ahead: ReadAhead, image: int) -> bytes:
    target = httpx.URL(url)
    for _ in range(MAX_REDIRECTS + 1):
        address = await _checked_address(target, policy, resolver)
        pinned = target.copy_with(host=str(address))
        headers = {"Host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
        await ahead.may_read(image)  # the answer's head brings its body's first bytes
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect and "location" in response.headers:
                target = target.join(response.headers["location"])
                continue
            if response.status_code != 200:
                raise _Failed(f"{target} answered HTTP {response.status_code}")
            chunks: list[bytes] = []
            size = 0
            try:
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise _Failed(f"{target} is over {max_bytes} bytes")
                    tally.add(len(chunk))
                    ahead.read(image, len(chunk))
                    chunks.append(chunk)
                    await ahead.may_read(image)  # before each read: nothing until it fits
            except BaseException:
                # A traceback keeps this frame alive until the cycle collector runs: the
                # bytes read so far go now, not then.
                chunks.clear()
                raise
        finally:
            await response.aclose()
            ahead.ended(image)
        data = b"".join(chunks)
        chunks.clear()
        if image_format(data) is None:
            raise _Failed(f"{target} is not an image")
        return data
    raise _Failed(f"{url} redirects more than {MAX_REDIRECTS} times")


async def remote_image_digests(body: dict[str, Any], settings: WorkerSettings, *,
                               resolver: Resolver = system_resolver,
                               budget: ImageBudget | None = None,
                               ahead: ReadAhead | None = None
                               ) -> dict[tuple[str, str | None], str]:
    """The digest of every remote image of ``body`` under each UUID its parts give it
    (:func:`~openai_request.prompts.image_refs`), by URL and UUID: each image is hashed as
    soon as it and those before it arrived, and its bytes dropped
    (:func:`fetch_remote_images`, whose arguments these are).

    Raises:
        ValueError: the messages or ``mm_uuids`` are malformed (a 400's reason).
        ApiError: as :func:`fetch_remote_images`.
    """
    uuids: dict[str, list[str | None]] = {}
    if remote_image_urls(body):
        for ref in image_refs(body):
            named = uuids.setdefault(ref.url, [])
            if ref.uuid not in named:
                named.append(ref.uuid)
    digests: dict[tuple[str, str | None], str] = {}

    async def use(url: str, data: bytes) -> None:
        for uuid in uuids.get(url, ()):
            digests[url, uuid] = (await asyncio.to_thread(image_digest, data, uuid)
                                  if len(data) >= _HASH_OFF_LOOP_BYTES
                                  else image_digest(data, uuid))

    await fetch_remote_images(body, settings, use, resolver=resolver, budget=budget,
                              ahead=ahead)
    return digests


async def fetch_remote_images(body: dict[str, Any], settings: WorkerSettings, use: Use, *,
                              resolver: Resolver = system_resolver,
                              budget: ImageBudget | None = None,
                              ahead: ReadAhead | None = None) -> None:
    """Fetch every remote image of ``body`` and hand each to ``use``, once, in the order of
    their first parts, as soon as it and those before it arrived; the bytes fetched and not
    yet used stay within ``settings.max_image_read_ahead_bytes``.

    Args:
        body: the chat request.
        settings: the worker's settings (size, count and time limits, allowed hosts).
        use: called with each image's URL and bytes; the image is used when it returns.
        resolver: resolves host names; the system's by default.
        budget: the worker's bytes in flight across requests (a fresh one of
            ``settings.max_image_fetch_bytes`` when not given).
        ahead: the request's bytes fetched and not yet used (a fresh one of
            ``settings.max_image_read_ahead_bytes`` when not given).

    Raises:
        ImageLimit: a fan-out limit (module docstring), naming the setting.
        ApiError: 400 "image URL not allowed" when a URL or a redirect points at an address
            the policy refuses; 400 "image fetch failed" when an image could not be fetched
            in time, answered an error, is too large or is not an image.
    """
    parts = len(image_part_urls(body))
    if parts > settings.max_images_per_request:
        raise ImageLimit(400, f"a request may carry at most {settings.max_images_per_request} "
                         "images (max_images_per_request)", "max_images_per_request")
    urls = remote_image_urls(body)
    if not urls:
        return
    if ahead is None:
        ahead = ReadAhead(settings.max_image_read_ahead_bytes, settings.max_image_bytes)
    policy = ImageHostPolicy.parse(settings.allow_image_hosts)
    timeout = httpx.Timeout(settings.image_fetch_timeout)
    tally = _Tally(settings.max_image_request_bytes,
                   budget or ImageBudget(settings.max_image_fetch_bytes))
    # trust_env=False: a proxy from the environment would connect by name, past the checks.
    try:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False,
                                     trust_env=False) as client:
            try:
                async with asyncio.timeout(settings.image_fetch_timeout):
                    await _fetch_all(client, urls, settings.max_image_bytes, policy,
                                     resolver, tally, ahead, use)
            except TimeoutError as exc:
                log.info("image fetch failed: %s: %s", type(exc).__name__, exc)
                raise ApiError(400, FAILED) from None
    except BaseException:
        gc.collect()  # stopped early: free the read-ahead of those before (module docstring)
        raise
    finally:
        tally.close()


async def _fetch_all(client: httpx.AsyncClient, urls: list[str], max_bytes: int,
                     policy: ImageHostPolicy, resolver: Resolver, tally: _Tally,
                     ahead: ReadAhead, use: Use) -> None:
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the others at once
            fetches: list[asyncio.Task[bytes] | None] = [
                group.create_task(_fetch_one(client, u, max_bytes, policy, resolver, tally,
                                             ahead, i))
                for i, u in enumerate(urls)]
            for i, url in enumerate(urls):
                fetch = fetches[i]
                assert fetch is not None, "each image is used once"
                data = await fetch
                fetches[i] = fetch = None  # the task held the bytes as its result
                await use(url, data)
                del data
                ahead.used(i)
    except* ImageLimit as limits:
        raise _first(limits) from None
    except* _Refused as refused:
        log.warning("refused an image URL: %s", _first(refused))
        raise ApiError(400, NOT_ALLOWED) from None
    except* (_Failed, httpx.HTTPError, httpx.InvalidURL) as failed:
        exc = _first(failed)
        log.info("image fetch failed: %s: %s", type(exc).__name__, exc)
        raise ApiError(400, FAILED) from None


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first exception of a (possibly nested) group."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found
