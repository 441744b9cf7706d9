"""Workers' addresses, looked up once and kept: a new upstream connection costs no DNS query
while its host's answer is fresh, and a look-up that fails for a host answered before falls
back on that answer.

Why kept: a worker's name (a compose service, a Kubernetes headless service) changes address
only when the worker does, and the router opens connections to the same few hosts all day.
Why stale on failure: a resolver that answers nothing for a moment (podman's DNS while the
network of a killed container is torn down; a CoreDNS pod restarting) would otherwise fail
every new connection to healthy workers at once; an address that worked a moment ago is the
better guess, and a wrong one fails the connection as any dead worker does.

Names are kept ``ttl`` seconds (10, aiohttp's default too); at most ``MAX_HOSTS`` of them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["MAX_HOSTS", "Address", "Resolver"]

log = logging.getLogger(__name__)

#: Hosts whose answers are kept at most; past it the oldest answer is dropped.
MAX_HOSTS = 4096

#: ``(family, host address)``: enough to connect.
Address = tuple[int, str]

Lookup = Callable[[str, int], Awaitable[list[Any]]]


async def _getaddrinfo(host: str, port: int) -> list[Any]:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


class Resolver:
    """Addresses per host name, kept ``ttl`` seconds (module docstring).

    Args:
        ttl: seconds an answer is fresh.
        clock: the clock answers age by.
        lookup: ``(host, port) -> getaddrinfo's list`` (the event loop's by default).
    """

    def __init__(self, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 lookup: Lookup = _getaddrinfo) -> None:
        self.ttl = ttl
        self._clock = clock
        self._lookup = lookup
        self._answers: dict[str, tuple[float, list[Address]]] = {}
        #: Look-ups that failed and were answered from a kept (stale) answer.
        self.stale_answers = 0

    async def resolve(self, host: str, port: int) -> list[Address]:
        """``host``'s addresses: an IP address as it is, else the kept answer while fresh,
        else a new look-up (the kept answer if that fails and there is one).

        Raises:
            OSError: the look-up failed (``socket.gaierror``) and nothing was kept.
        """
        literal = _literal(host)
        if literal is not None:
            return [literal]
        now = self._clock()
        kept = self._answers.get(host)
        if kept is not None and now - kept[0] < self.ttl:
            return kept[1]
        try:
            infos = await self._lookup(host, port)
            addresses = list(dict.fromkeys((info[0], info[4][0]) for info in infos))
            if not addresses:
                raise socket.gaierror(socket.EAI_NONAME, f"no address for {host}")
        except OSError as exc:
            if kept is None:
                raise
            self.stale_answers += 1
            log.warning("looking up %s failed (%s): using its last known address %s",
                        host, exc, kept[1][0][1])
            self._answers[host] = (now, kept[1])  # tried again after another ttl
            return kept[1]
        if host not in self._answers and len(self._answers) >= MAX_HOSTS:
            del self._answers[next(iter(self._answers))]
        self._answers[host] = (now, addresses)
        return addresses


def _literal(host: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip))
