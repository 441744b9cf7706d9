"""Prefill leases: the KV a prefill worker holds for a decode worker that has not taken it yet.

Under disaggregated serving a prefill worker keeps a prompt's blocks referenced after its
prefill ends, so that they are still there when the decode worker pulls them; vLLM's
NixlConnector frees them when the decode side has read them, or when a lease of 30 s
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) ends without a read. This table is that lease, with no
clock of its own: times come in as arguments.

Notes:
    1. A lease is granted once, then either claimed (the decode worker took the KV) or
       expired; :meth:`PrefillLeases.claim` and :meth:`PrefillLeases.expired` hand each lease
       out at most once between them.
    2. Leases expire in the order they were granted (one duration for all).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["DEFAULT_LEASE_S", "PrefillLeases"]

#: vLLM's NixlConnector lease on a prefill's blocks.
DEFAULT_LEASE_S = 30.0


class PrefillLeases:
    """Leases by id, each ending ``duration_s`` after it was granted.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """

    def __init__(self, duration_s: float = DEFAULT_LEASE_S) -> None:
        if not duration_s > 0:
            raise ValueError(f"a lease must last a positive time, got {duration_s}")
        self.duration_s = duration_s
        self._ends: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ends)

    def grant(self, lease_id: str, now: float) -> None:
        """Start a lease.

        Raises:
            ValueError: ``lease_id`` is held already.
        """
        if lease_id in self._ends:
            raise ValueError(f"lease {lease_id!r} is held already")
        self._ends[lease_id] = now + self.duration_s

    def claim(self, lease_id: str) -> bool:
        """End a lease because its KV was taken; False: unknown or already ended."""
        return self._ends.pop(lease_id, None) is not None

    def expired(self, now: float) -> list[str]:
        """End and return the leases whose time is up at ``now``, oldest first."""
        out = []
        while self._ends:
            lease_id, end = next(iter(self._ends.items()))
            if end > now:
                break
            del self._ends[lease_id]
            out.append(lease_id)
        return out
