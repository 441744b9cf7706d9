"""Fetches the ``http(s)`` images of a chat request, with a size, a time and a host limit.

Runs before tokenization (which is pure and synchronous): every remote image URL in the body is
fetched concurrently; the bytes are handed to :func:`openai_request.prompts.build_prompt`
through its ``fetch`` callable.

Each hop resolves the host once (:data:`Resolver`), checks every address against the
:class:`~workers.http.image_policy.ImageHostPolicy`, and connects to the first address by IP,
with the original name in the ``Host`` header and as the TLS server name. Redirects are
followed by hand, at most :data:`MAX_REDIRECTS`, each hop checked anew. The answer must be an
image by its magic bytes.

A refused or failed fetch is a 400 that says only "image URL not allowed" or "image fetch
failed": neither the target's status nor its content, nor which check failed, reaches the
caller (the log has the details).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from openai_request.bodies import ApiError
from workers.http.image_policy import ImageHostPolicy, IpAddress, image_format
from workers.settings import WorkerSettings

__all__ = ["MAX_REDIRECTS", "Resolver", "fetch_remote_images", "remote_image_urls",
           "system_resolver"]

log = logging.getLogger(__name__)

#: Resolves ``(host, port)`` to IP address strings; the fetch connects to one of them.
Resolver = Callable[[str, int], Awaitable[list[str]]]
MAX_REDIRECTS = 5
NOT_ALLOWED = "image URL not allowed"
FAILED = "image fetch failed"


class _Refused(Exception):
    """The URL or one of its redirects points where the policy forbids."""


class _Failed(Exception):
    """The fetch did not give an image (status, size, format, network)."""


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve ``host`` with the system resolver (``getaddrinfo``)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def remote_image_urls(body: dict[str, Any]) -> list[str]:
    """The distinct ``http(s)`` image URLs of a chat body, in order."""
    urls: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str) and url.startswith(("http://", "https://")) \
                    and url not in urls:
                urls.append(url)
    return urls


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
                     policy: ImageHostPolicy, resolver: Resolver) -> bytes:
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
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise _Failed(f"{target} is over {max_bytes} bytes")
        finally:
            await response.aclose()
        if image_format(bytes(data)) is None:
            raise _Failed(f"{target} is not an image")
        return bytes(data)
    raise _Failed(f"{url} redirects more than {MAX_REDIRECTS} times")


async def fetch_remote_images(body: dict[str, Any], settings: WorkerSettings, *,
                              resolver: Resolver = system_resolver) -> dict[str, bytes]:
    """Fetch every remote image of ``body``; returns url -> bytes.

    Args:
        body: the chat request.
        settings: the worker's settings (size and time limits, allowed hosts).
        resolver: resolves host names; the system's by default.

    Raises:
        ApiError: 400 "image URL not allowed" when a URL or a redirect points at an address
            the policy refuses; 400 "image fetch failed" when an image could not be fetched
            in time, answered an error, is too large or is not an image.
    """
    urls = remote_image_urls(body)
    if not urls:
        return {}
    policy = ImageHostPolicy.parse(settings.allow_image_hosts)
    timeout = httpx.Timeout(settings.image_fetch_timeout)
    # trust_env=False: a proxy from the environment would connect by name, past the checks.
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False,
                                 trust_env=False) as client:
        try:
            async with asyncio.timeout(settings.image_fetch_timeout):
                found = await asyncio.gather(*(
                    _fetch_one(client, u, settings.max_image_bytes, policy, resolver)
                    for u in urls))
        except _Refused as exc:
            log.warning("refused an image URL: %s", exc)
            raise ApiError(400, NOT_ALLOWED) from None
        except (_Failed, TimeoutError, httpx.HTTPError, httpx.InvalidURL) as exc:
            log.info("image fetch failed: %s: %s", type(exc).__name__, exc)
            raise ApiError(400, FAILED) from None
    return dict(zip(urls, found, strict=True))
