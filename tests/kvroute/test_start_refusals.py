"""Flags that cannot work are refused at start: the command exits 2 with one line naming the
setting, and no traceback, instead of starting a server that can never do its job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvroute.up import free_port

pytestmark = pytest.mark.process  # starts child processes


@pytest.mark.parametrize("args, fragment", [
    (["router", "--worker", "http://[::1"], "worker 'http://[::1'"),
    (["router", "--worker", "http://127.0.0.1:99999"], "port"),
    (["router", "--worker", "http://:8000"], "no host"),
    (["router", "--worker", ""], "workers from flag: a worker entry is empty"),
    (["router", "--predict-ttl", "inf"], "predict_ttl must be a finite number"),
    (["router", "--ttft-slo", "-1"], "ttft_slo must be positive"),
    (["router", "--rates", "prefill=nan"], "rate prefill_s must be a finite number"),
    (["router", "--health-timeout", "inf"], "health_timeout must be a finite number"),
    (["router", "--admin-token", "   "], "admin_token is blank"),
    (["worker", "--events-port", "70000"], "events_port must be in 0..65535"),
    (["worker", "--replay-port", "65535", "--data-parallel-rank", "1"],
     "replay_port 65535 + data_parallel_rank 1 must be in 0..65535"),
    (["worker", "--admin-token", " "], "admin_token is blank"),
    (["worker", "--data-parallel-size", "0"], "data_parallel_size must be positive"),
    (["worker", "--data-parallel-size", "2", "--data-parallel-rank", "1"],
     "serves ranks 0..N-1 itself"),
    (["worker", "--data-parallel-size", "2", "--engine", "torch"], "sim engines only"),
    (["router", "--body-timeout", "0"], "body_timeout must be positive"),
    (["worker", "--max-header-bytes", "100"], "max_header_bytes must be at least 1024"),
    (["worker", "--max-image-read-ahead-bytes", "1000000"],
     "max_image_read_ahead_bytes must hold one whole image (max_image_bytes 20971520)"),
])
def test_a_flag_that_cannot_work_exits_2_with_one_line_naming_it(args: list[str],
                                                                 fragment: str) -> None:
    port = ["--port", str(free_port())]
    try:
        result = subprocess.run([sys.executable, "-m", "kvroute.cli", *args, *port],
                                capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} started a server instead of refusing")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
