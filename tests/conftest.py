"""Fixtures shared by every test package: where ``shared/`` lives, golden vectors, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """``shared/`` beside the checkout (``$KVROUTE_SHARED`` overrides)."""
    return Path(os.environ.get("KVROUTE_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared() -> Path:
    path = shared_dir()
    if not path.is_dir():
        pytest.fail(f"shared/ not found at {path}; set KVROUTE_SHARED")
    return path


@pytest.fixture(scope="session")
def golden_payloads(shared: Path) -> list[dict[str, Any]]:
    return json.loads((shared / "wire" / "payloads.json").read_text())


@pytest.fixture(scope="session")
def golden_frames(shared: Path) -> dict[str, Any]:
    return json.loads((shared / "wire" / "frames.json").read_text())


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

    async def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float = 5.0,
                       what: str = "condition") -> None:
        """Wait until ``predicate(items)`` holds, woken by each new item; fail after timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(self.items):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"got {len(self.items)} items")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


@pytest.fixture
def notice_log() -> Callable[[], NoticeLog]:
    """A factory of :class:`NoticeLog` collectors."""
    return NoticeLog
