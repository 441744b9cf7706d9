"""Fetches the ``http(s)`` images of a chat request, with a size, a time and a host limit.

Runs before tokenization (which is pure and synchronous): every remote image URL in the body is
fetched concurrently; the bytes are handed to :func:`openai_request.prompts.build_prompt`
through its ``fetch`` callable.

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

So one request holds at most ``max_image_request_bytes`` of images, and all requests together
at most ``max_image_fetch_bytes``, whatever their URLs answer.

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
from workers.http.image_policy import ImageHostPolicy, IpAddress, image_format
from workers.settings import WorkerSettings

__all__ = ["MAX_REDIRECTS", "ImageBudget", "ImageLimit", "Resolver", "fetch_remote_images",
           "image_part_urls", "remote_image_urls", "system_resolver"]

log = logging.getLogger(__name__)

#: Resolves ``(host, port)`` to IP address strings; the fetch connects to one of them.
Resolver = Callable[[str, int], Awaitable[list[str]]]
MAX_REDIRECTS = 5
NOT_ALLOWED = "image URL not allowed"
FAILED = "image fetch failed"


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
                     policy: ImageHostPolicy, resolver: Resolver, tally: _Tally) -> bytes:
    target = httpx.URL(url)
    for _ in range(MAX_REDIRECTS + 1):
        address = await _checked_address(target, policy, resolver)
        pinned = target.copy_with(host=str(address))
        headers = {"Host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
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
                    chunks.append(chunk)
            except BaseException:
                # A traceback keeps this frame alive until the cycle collector runs: the
                # bytes read so far go now, not then.
                chunks.clear()
                raise
        finally:
            await response.aclose()
        data = b"".join(chunks)
        if image_format(data) is None:
            raise _Failed(f"{target} is not an image")
        return data
    raise _Failed(f"{url} redirects more than {MAX_REDIRECTS} times")


async def fetch_remote_images(body: dict[str, Any], settings: WorkerSettings, *,
                              resolver: Resolver = system_resolver,
                              budget: ImageBudget | None = None) -> dict[str, bytes]:
    """Fetch every remote image of ``body``; returns url -> bytes.

    Args:
        body: the chat request.
        settings: the worker's settings (size, count and time limits, allowed hosts).
        resolver: resolves host names; the system's by default.
        budget: the worker's bytes in flight across requests (a fresh one of
            ``settings.max_image_fetch_bytes`` when not given).

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
        return {}
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
                    tasks = await _fetch_all(client, urls, settings.max_image_bytes, policy,
                                             resolver, tally)
            except TimeoutError as exc:
                log.info("image fetch failed: %s: %s", type(exc).__name__, exc)
                raise ApiError(400, FAILED) from None
    except BaseException:
        gc.collect()  # stopped early: free the read-ahead of those before (module docstring)
        raise
    finally:
        tally.close()
    return {u: t.result() for u, t in zip(urls, tasks, strict=True)}


async def _fetch_all(client: httpx.AsyncClient, urls: list[str], max_bytes: int,
                     policy: ImageHostPolicy, resolver: Resolver, tally: _Tally
                     ) -> list[asyncio.Task[bytes]]:
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the others at once
            return [group.create_task(_fetch_one(client, u, max_bytes, policy, resolver, tally))
                    for u in urls]
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
