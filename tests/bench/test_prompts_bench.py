"""bench.prompts' own pieces: the paced upload and the worker's time read from its answer."""

from __future__ import annotations

import httpx
import pytest

from bench.prompts import UPLOAD_PIECE, _paced, _worker_seconds


def test_a_paced_upload_is_the_body_in_pieces_and_an_unpaced_one_the_body() -> None:
    raw = bytes(range(256)) * 200  # 51,200 bytes: three whole pieces and a part
    assert _paced(raw, 0) is raw
    pieces = list(_paced(raw, 1e6))
    assert b"".join(pieces) == raw
    assert [len(p) for p in pieces] == [UPLOAD_PIECE] * 3 + [len(raw) - 3 * UPLOAD_PIECE]


def test_the_workers_time_is_read_from_server_timing_and_its_absence_is_an_error() -> None:
    timed = httpx.Response(200, headers={"server-timing": "worker;dur=12.500"})
    assert _worker_seconds(timed) == pytest.approx(0.0125)
    with pytest.raises(RuntimeError, match="Server-Timing"):
        _worker_seconds(httpx.Response(200))
