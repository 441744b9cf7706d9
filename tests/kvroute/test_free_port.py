"""``free_port``: ports below the kernel's ephemeral range, never one in use, never one twice
(a port from the ephemeral range can be taken by an outgoing connection before a child binds
it), from the span ``KVROUTE_FREE_PORTS`` names when it is set (a bad one is refused)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvroute import up


@pytest.fixture(autouse=True)
def _default_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default span, whatever the runner's (pytest-xdist runners each have one)."""
    monkeypatch.delenv("KVROUTE_FREE_PORTS", raising=False)


class Scripted:
    """Stands in for the module's RNG: returns the given ports in order."""

    def __init__(self, ports: list[int]) -> None:
        self._ports: Iterator[int] = iter(ports)

    def randrange(self, start: int, stop: int) -> int:
        port = next(self._ports)
        assert start <= port < stop
        return port


def _unused_port_in_span(*besides: int) -> int:
    for port in range(up.PORTS_FROM, up._ephemeral_start()):
        if port not in up._handed_out and port not in besides and up._bindable(port):
            return port
    raise AssertionError("no free port below the ephemeral range")


def test_ports_come_from_below_the_ephemeral_range_and_never_repeat() -> None:
    ports = [up.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(up.PORTS_FROM <= p < up._ephemeral_start() for p in ports)
    with socket.socket() as s:  # free: a server can bind it
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = up.free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", _unused_port_in_span(seen)))
        busy.listen()
        in_use = busy.getsockname()[1]
        spare = _unused_port_in_span(seen, in_use)
        monkeypatch.setattr(up, "_rng", Scripted([in_use, seen, spare]))
        assert up.free_port() == spare


def test_with_no_span_below_the_ephemeral_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    low = up._ephemeral_start()
    monkeypatch.setattr(up, "_ephemeral_start", lambda: up.PORTS_FROM + 10)
    monkeypatch.setattr(up, "_rng", Scripted([]))  # never drawn from
    assert up.free_port() >= low


def test_ports_come_from_the_named_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_FREE_PORTS", "24000-25000")
    ports = [up.free_port() for _ in range(20)]
    assert all(24000 <= p < 25000 for p in ports)
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize("text", ["24000", "25000-24000", "abc-def", "80-2000", "24000-70000"])
def test_a_bad_span_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                   text: str) -> None:
    monkeypatch.setenv("KVROUTE_FREE_PORTS", text)
    with pytest.raises(ValueError, match="KVROUTE_FREE_PORTS must be LOW-HIGH"):
        up.free_port()


def test_a_cluster_never_gives_a_worker_the_port_its_router_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The router binds after the workers, so its port is still free while their ports are
    # drawn: the draw must skip it, or the router fails to bind (uvicorn's exit status 3).
    router = _unused_port_in_span()
    cluster = up.Cluster(workers=1, port=router)
    spare = [_unused_port_in_span(router)]
    for _ in range(2):
        spare.append(_unused_port_in_span(router, *spare))
    monkeypatch.setattr(up, "_rng", Scripted([router, *spare]))  # the router's port first
    assert cluster._ports() == spare


def test_a_cluster_with_a_worker_port_range_leaves_out_the_routers_port() -> None:
    low = _unused_port_in_span()
    cluster = up.Cluster(workers=1, port=low, worker_ports=range(low, low + 6))
    assert low not in cluster._ports()
