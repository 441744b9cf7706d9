"""Which hosts a worker may fetch images from, and which bytes count as an image.

A chat request names image URLs and the worker fetches them, so without limits a caller could
make the worker reach anything it can reach: loopback services, the cloud metadata address
(169.254.169.254), the cluster's private network. The answer (or its ``cached_tokens``) would
then confirm guesses at internal content. So:

1. Every address a host name resolves to is checked, and the fetch connects to a checked
   address (never resolving the name a second time), so a DNS answer that changes between the
   check and the connection cannot slip through. Redirects are checked hop by hop the same way.
2. Refused by default: loopback, private (RFC 1918, IPv6 unique-local), link-local, multicast,
   unspecified and reserved addresses, IPv4-mapped IPv6 forms included.
3. :class:`ImageHostPolicy` lets an operator opt in, per CIDR block or per host name
   (``--allow-image-hosts 10.2.0.0/16,images.internal``). A name on the list allows whatever
   it resolves to.
4. Fetched bytes must start with the magic bytes of an image format (:func:`image_format`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from openai_request.images import image_format

__all__ = ["ImageHostPolicy", "IpAddress", "image_format"]

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _internal(address: IpAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_loopback or address.is_private or address.is_link_local
            or address.is_multicast or address.is_unspecified or address.is_reserved)


@dataclass(frozen=True, slots=True)
class ImageHostPolicy:
    """Decides whether a host and its resolved addresses may be fetched from.

    Attributes:
        networks: CIDR blocks allowed even though they are internal.
        names: host names (lower case) allowed whatever they resolve to.
    """

    networks: tuple[_Network, ...] = ()
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> ImageHostPolicy:
        """Build a policy from ``--allow-image-hosts`` entries: CIDR blocks, addresses or
        host names.

        Raises:
            ValueError: an entry is neither an address, a CIDR block nor a host name.
        """
        networks: list[_Network] = []
        names: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            label = entry.lower().rstrip(".")
            if "/" in label or not all(c.isalnum() or c in "-." for c in label):
                raise ValueError(f"{entry!r} is not a CIDR block, an address or a host name")
            names.add(label)
        return cls(tuple(networks), frozenset(names))

    def allows_name(self, host: str) -> bool:
        """Whether ``host`` is on the list by name."""
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IpAddress) -> bool:
        """Whether ``address`` may be connected to: public, or inside an allowed block."""
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        for candidate in (address, mapped):
            if candidate is not None and any(candidate in n for n in self.networks):
                return True
        return not _internal(address)
