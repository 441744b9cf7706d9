"""The service benchmarks' process CPU reading agrees with the kernel's own accounting."""

from __future__ import annotations

import os

from bench.http_load import process_cpu_seconds


def test_process_cpu_seconds_reads_user_plus_system_time_of_the_process() -> None:
    sum(i * i for i in range(200_000))  # some CPU time of our own to read
    before = os.times()
    read = process_cpu_seconds(os.getpid())
    after = os.times()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before.user + before.system - tick <= read <= after.user + after.system + tick
    assert read > 0
