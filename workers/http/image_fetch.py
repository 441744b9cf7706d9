"""Fetches the ``http(s)`` images of a chat request, with a size and a time limit.

Runs before tokenization (which is pure and synchronous): every remote image URL in the body is
fetched concurrently; the bytes are handed to :func:`indexer.prompts.build_prompt` through its
``fetch`` callable. A URL that fails maps to no bytes, and the request is then refused with a
400 naming the reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from indexer.openai_api import ApiError
from workers.settings import WorkerSettings

__all__ = ["fetch_remote_images", "remote_image_urls"]


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


async def _fetch(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise ApiError(400, f"image {url} answered HTTP {response.status_code}")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > max_bytes:
                raise ApiError(413, f"image {url} is over {max_bytes} bytes")
        return bytes(data)


async def fetch_remote_images(body: dict[str, Any], settings: WorkerSettings
                              ) -> dict[str, bytes]:
    """Fetch every remote image of ``body``; returns url -> bytes.

    Raises:
        ApiError: an image could not be fetched in time, answered an error, or is too large.
    """
    urls = remote_image_urls(body)
    if not urls:
        return {}
    timeout = httpx.Timeout(settings.image_fetch_timeout)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client:
        try:
            async with asyncio.timeout(settings.image_fetch_timeout):
                found = await asyncio.gather(*(_fetch(client, u, settings.max_image_bytes)
                                               for u in urls))
        except TimeoutError:
            raise ApiError(400, f"fetching images took over {settings.image_fetch_timeout}s"
                           ) from None
        except httpx.HTTPError as exc:
            raise ApiError(400, f"an image could not be fetched: {exc}") from None
    return dict(zip(urls, found, strict=True))
