"""Prefill leases: each granted once, then claimed or expired, in the order granted."""

from __future__ import annotations

import pytest

from workers.engine.leases import PrefillLeases


def test_leases_end_by_claim_or_in_grant_order_when_their_time_is_up() -> None:
    leases = PrefillLeases(10.0)
    leases.grant("a", 0.0)
    leases.grant("b", 1.0)
    leases.grant("c", 2.0)
    assert leases.claim("b") and not leases.claim("b") and not leases.claim("zzz")
    assert leases.expired(9.9) == []
    assert leases.expired(12.0) == ["a", "c"]
    assert len(leases) == 0 and not leases.claim("a")


def test_a_lease_is_granted_once_and_lasts_a_positive_time() -> None:
    leases = PrefillLeases(1.0)
    leases.grant("a", 0.0)
    with pytest.raises(ValueError, match="held already"):
        leases.grant("a", 0.5)
    with pytest.raises(ValueError, match="positive"):
        PrefillLeases(0.0)
