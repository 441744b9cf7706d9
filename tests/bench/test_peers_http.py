"""bench.peers_http: its nginx backend passes for a vLLM server with kvroute (the router
routes to it and forwards a completion), the process group's CPU reading counts every process
in the group, and the table cells say a range only when rounds differ."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest

from bench import peers_http
from bench.http_load import stop, wait_ready
from kvroute.up import free_port
from tests.support.eventually import eventually_blocking

needs_nginx = pytest.mark.skipif(
    not os.path.exists(peers_http.NGINX) or not shutil.which("taskset"),
    reason="nginx or taskset is not installed")


@pytest.mark.process
@needs_nginx
def test_kvroute_routes_to_the_nginx_backend_as_to_a_vllm_server() -> None:
    ports = [free_port(), free_port()]
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    with peers_http.nginx(ports, cpus):
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute.cli", "router", "--port", str(port),
               "--log-level", "warning"]
        for p in ports:
            cmd += ["--worker", f"http://127.0.0.1:{p},engine=vllm"]
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            wait_ready(router, f"http://127.0.0.1:{port}/ready", "kvroute router", 60)
            body = json.dumps({"model": peers_http.MODEL, "prompt": "x" * 1000,
                               "max_tokens": 1}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                             data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200
                assert answer.headers["x-kvroute-worker"] in {
                    f"http://127.0.0.1:{p}" for p in ports}
                assert json.loads(answer.read())["choices"][0]["text"] == " fixed"
        finally:
            stop(router)


@pytest.mark.process
def test_the_group_cpu_reading_counts_every_process_of_the_group() -> None:
    # A leader and its child each spend 0.3 s of CPU, then wait: only both together pass 0.5.
    spin = ("import time\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\ntime.sleep(60)\n")
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys\n"
         f"subprocess.Popen([sys.executable, '-c', {spin!r}])\n{spin}"],
        start_new_session=True)
    try:
        read = eventually_blocking(lambda: peers_http._group_cpu_seconds(leader.pid),
                                   "the group's CPU time past 0.5 s",
                                   until=lambda seconds: seconds >= 0.5, timeout=30)
        assert read >= 0.5
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_cell_gives_the_median_and_a_range_only_when_rounds_differ() -> None:
    assert peers_http._cell([100, 101, 102], ",.0f") == "101"
    assert peers_http._cell([100, 150, 200], ",.0f") == "150 (100-200)"
    assert peers_http._cell([], ".2f") == "-"


def test_paired_ratios_are_each_rounds_figure_over_the_first_checkouts_sorted() -> None:
    assert peers_http.paired_ratios([400, 200, 300], [360, 190, 240]) == [0.8, 0.9, 0.95]
    with pytest.raises(ValueError):  # a round missing from one of them
        peers_http.paired_ratios([400, 200], [360])


def test_paired_wants_two_checkouts() -> None:
    with pytest.raises(SystemExit, match="two or more"):
        peers_http.main(["--paired", "--kvroute", "."])
