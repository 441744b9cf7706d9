"""``kvroute up`` as a user meets it: the router port from KVROUTE_PORT, the workers' ports
from a range, Ctrl-C during start-up, and a worker that dies restarted with backoff."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvroute.restarts import RestartSchedule
from kvroute.up import Cluster, _bindable, free_port, router_port
from tests.kvroute.test_processes import children_of


def test_the_router_port_is_the_flag_then_kvroute_port_then_8000() -> None:
    assert router_port(30094, {"KVROUTE_PORT": "1"}) == 30094
    assert router_port(None, {"KVROUTE_PORT": "30094"}) == 30094
    assert router_port(None, {}) == 8000
    with pytest.raises(ValueError, match="KVROUTE_PORT='eighty' is not a port"):
        router_port(None, {"KVROUTE_PORT": "eighty"})


def test_worker_ports_come_from_the_range_in_order_skipping_ports_in_use() -> None:
    low = free_port()
    ports = range(low, low + 12)
    cluster = Cluster(3, worker_ports=ports)
    got = cluster._ports()
    assert got == [p for p in ports if _bindable(p)][:9] and len(got) == 9
    with pytest.raises(ValueError, match="holds 5 ports; 2 workers need 6"):
        Cluster(2, worker_ports=range(low, low + 5))


def test_restarts_back_off_and_stop_at_the_bound() -> None:
    schedule = RestartSchedule(limit=4, first=1.0, cap=3.0)
    assert [schedule.exited("worker-0", 100.0) for _ in range(5)] == [100.0, 101.0, 102.0,
                                                                     103.0, None]
    assert schedule.exited("worker-1", 7.0) == 7.0  # per worker
    assert schedule.restarts("worker-0") == 4


def _up(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvroute.cli", "up", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@pytest.mark.process
def test_ctrl_c_during_start_up_stops_at_once() -> None:
    # The router's block size differs from the workers': it never becomes ready, and
    # kvroute up would wait its whole --timeout.
    proc = _up("--workers", "1", "--port", str(free_port()), "--timeout", "600",
               "--router-arg=--block-size=16")
    try:
        for _ in range(600):  # until the router child is spawned
            if len(children_of(proc.pid)) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "stopping..." in err
    finally:
        _stop(proc)


def _workers(pid: int) -> dict[int, bytes]:
    """The worker processes under ``pid``, with their command lines."""
    found = {}
    for child in children_of(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:  # it ended meanwhile
            continue
        if b"\0worker\0" in argv:
            found[child] = argv
    return found


@pytest.mark.process
def test_a_worker_that_dies_is_restarted_on_its_ports() -> None:
    port = free_port()
    proc = _up("--workers", "1", "--port", str(port), "--status-interval", "0.5")
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("kvroute is up"):
                break
        killed = _workers(proc.pid)
        assert len(killed) == 1
        (pid, argv), = killed.items()
        os.kill(pid, signal.SIGKILL)
        # The restart can come back before a status line shows the worker down, so wait for
        # the state instead: a new worker process with the same command line (its ports),
        # then a status line that sees it healthy.
        seen = []
        for line in proc.stdout:
            seen.append(line)
            now = _workers(proc.pid)
            if "workers 1/1 healthy" in line and list(now.values()) == [argv] and pid not in now:
                break
            assert len(seen) < 400, seen
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert "worker-0 exited with -9; restarting it in 0s (restart 1 of 5)" in err
        assert proc.returncode == 0
    finally:
        _stop(proc)


@pytest.mark.process
def test_the_router_is_replaced_over_the_same_workers() -> None:
    cluster = Cluster(2, router_args=["--policy", "kv"])
    try:
        cluster.start(timeout=60)
        workers = [c.process.pid for c in cluster.children if c.name.startswith("worker-")]
        old = next(c for c in cluster.children if c.name == "router")
        cluster.replace_router(["--policy", "round_robin"], timeout=60)
        new = next(c for c in cluster.children if c.name == "router")
        assert old.process.poll() is not None and new.process.poll() is None
        assert new.args[-2:] == ["--policy", "round_robin"] and new.url == cluster.url
        assert [c.process.pid for c in cluster.children
                if c.name.startswith("worker-")] == workers
        assert new.args.count("--worker") == 2
    finally:
        cluster.stop()
