"""The upstream client's kept addresses: one look-up per host while fresh, a new one after,
the last answer when a look-up fails, IP addresses never looked up, and a bounded table."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from router.http import resolver as resolver_module
from router.http.resolver import Resolver


class Lookups:
    """A scripted getaddrinfo: each host's answer, or an error while ``failing``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failing = False

    async def __call__(self, host: str, port: int) -> list[Any]:
        self.calls.append(host)
        if self.failing:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        last = sum(map(ord, host)) % 250
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{last}", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{last}", port))]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_an_answer_is_kept_while_fresh_then_looked_up_again() -> None:
    lookups, clock = Lookups(), Clock()
    resolver = Resolver(ttl=10.0, clock=clock, lookup=lookups)
    first = await resolver.resolve("worker-0", 8100)
    assert first == [(socket.AF_INET, first[0][1])]  # duplicates folded
    clock.now += 9.9
    assert await resolver.resolve("worker-0", 8100) == first
    assert lookups.calls == ["worker-0"]
    clock.now += 0.2
    await resolver.resolve("worker-0", 8100)
    assert lookups.calls == ["worker-0", "worker-0"]


async def test_a_failed_look_up_answers_the_last_known_address() -> None:
    lookups, clock = Lookups(), Clock()
    resolver = Resolver(ttl=10.0, clock=clock, lookup=lookups)
    known = await resolver.resolve("worker-1", 8100)
    lookups.failing = True
    clock.now += 11
    assert await resolver.resolve("worker-1", 8100) == known
    assert resolver.stale_answers == 1
    # a host never answered has nothing to fall back on
    with pytest.raises(socket.gaierror):
        await resolver.resolve("worker-2", 8100)


@pytest.mark.parametrize(("host", "family"), [("127.0.0.1", socket.AF_INET),
                                              ("::1", socket.AF_INET6),
                                              ("[::1]", socket.AF_INET6)])
async def test_an_ip_address_is_not_looked_up(host: str, family: int) -> None:
    lookups = Lookups()
    resolver = Resolver(lookup=lookups)
    assert await resolver.resolve(host, 80) == [(family, host.strip("[]"))]
    assert lookups.calls == []


async def test_the_table_of_answers_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolver_module, "MAX_HOSTS", 3)
    lookups = Lookups()
    resolver = Resolver(lookup=lookups)
    for name in ("a", "b", "c", "d"):
        await resolver.resolve(name, 80)
    await resolver.resolve("a", 80)  # the oldest was dropped: looked up again
    await resolver.resolve("d", 80)  # still kept
    assert lookups.calls == ["a", "b", "c", "d", "a"]
