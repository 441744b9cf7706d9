"""Which peers a server believes: a set of networks, matched against a connection's address.

A setting names them as comma-separated addresses or CIDR blocks (``10.0.0.0/8,fd00::/8``),
or one of two words: ``any`` (every peer) and ``none`` (no peer). The address matched is the
TCP peer's, as the ASGI scope's ``client`` gives it (the servers here take no
``X-Forwarded-For``); an IPv4 peer on a dual-stack socket (``::ffff:10.0.0.1``) is matched as
its IPv4 address, and a connection without an address (a Unix socket) is trusted by ``any``
only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LOOPBACK", "TrustedPeers"]

#: The loopback networks, IPv4 and IPv6.
LOOPBACK = "127.0.0.0/8,::1"

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
#: Peer addresses whose answer is kept.
_MAX_SEEN = 4096


@dataclass(frozen=True, slots=True)
class TrustedPeers:
    """The networks whose peers are trusted (``everyone``: all of them)."""

    networks: tuple[_Network, ...] = ()
    everyone: bool = False
    #: Each peer address seen, and whether it is trusted (at most ``_MAX_SEEN`` kept).
    _seen: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> TrustedPeers:
        """Read a setting (module docstring).

        Raises:
            ValueError: an entry is not an address or a network, or ``any``/``none`` is not
                alone.
        """
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        words = [p for p in parts if p.lower() in ("any", "none")]
        if words and len(parts) > 1:
            raise ValueError(f"{words[0]!r} stands alone, not beside {spec!r}")
        if words:
            return cls(everyone=words[0].lower() == "any")
        networks = []
        for part in parts:
            try:
                networks.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"{part!r} is not an address or a CIDR block") from None
        return cls(tuple(networks))

    def trusts(self, peer: Sequence[object] | None) -> bool:
        """Whether the peer ``(host, port)`` (an ASGI scope's ``client``) is trusted."""
        if self.everyone:
            return True
        if not peer or not self.networks:
            return False
        host = str(peer[0])
        known = self._seen.get(host)
        if known is None:
            # Parsing an address costs microseconds a request; a router sees few peers.
            if len(self._seen) >= _MAX_SEEN:
                self._seen.clear()
            known = self._seen[host] = self._contains(host)
        return known

    def _contains(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)
