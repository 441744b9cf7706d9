"""Fixtures shared by every test package: golden vectors, benchmark data, waiting."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.eventually import DEFAULT_TIMEOUT, eventually

REPO = Path(__file__).resolve().parent.parent


DATA = REPO / "tests" / "data"
BENCH_DATA = REPO / "bench" / "data"


@pytest.fixture(scope="session")
def golden_payloads() -> list[dict[str, Any]]:
    return json.loads((DATA / "wire" / "payloads.json").read_text())


@pytest.fixture(scope="session")
def golden_frames() -> dict[str, Any]:
    return json.loads((DATA / "wire" / "frames.json").read_text())


class NoticeLog:
    """Collects values pushed by a callback and lets a test await a condition over them."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._changed = asyncio.Event()

    def __call__(self, item: Any) -> None:
        self.items.append(item)
        self._changed.set()

    def of(self, kind: type) -> list[Any]:
        return [i for i in self.items if isinstance(i, kind)]

    async def wait_for(self, predicate: Callable[[list[Any]], bool],
                       timeout: float = DEFAULT_TIMEOUT, what: str = "condition") -> None:
        """Wait until ``predicate(items)`` holds, woken by each new item (:func:`eventually`)."""
        await eventually(lambda: self.items, what, timeout, until=predicate, wake=self._changed)


@pytest.fixture
def notice_log() -> Callable[[], NoticeLog]:
    """A factory of :class:`NoticeLog` collectors."""
    return NoticeLog
