"""Fixtures the router's HTTP-path tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from router.http.proxy import Proxy


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    """A started upstream proxy, closed after the test."""
    p = Proxy()
    await p.start()
    yield p
    await p.close()
