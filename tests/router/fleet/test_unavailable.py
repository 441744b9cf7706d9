"""The one-line reason no worker can take a request: causes counted by state, each as short
as an operator needs it."""

from __future__ import annotations

from router.fleet.entry import WorkerEntry
from router.fleet.unavailable import NO_WORKER_CONFIGURED, cause_of, unavailable_reason
from router.fleet.worker_table import WorkerState


def test_errors_reduce_to_their_cause() -> None:
    assert cause_of("http://w:1/model_info: ConnectError: All connection attempts failed") == (
        "connection refused")
    assert cause_of("load poll failed: no answer within 1.0s") == "no answer in time"
    assert cause_of("/health answered 500") == "status 500"
    assert cause_of("worker http://w:1 uses block size 16 but the router uses 32: its events "
                    "could never match a request") == "uses block size 16 but the router uses 32"
    assert cause_of(None) == "not checked yet"
    assert len(cause_of("x" * 500)) == 80


def test_the_reason_counts_workers_by_state_and_cause() -> None:
    def entry(i: int, state: WorkerState, error: str) -> WorkerEntry:
        return WorkerEntry(i, f"http://w{i}:1", state, last_error=error)

    refused = "http://w:1/model_info: ConnectError: [Errno 111] Connection refused"
    entries = [entry(0, WorkerState.UNHEALTHY, refused),
               entry(1, WorkerState.UNHEALTHY, refused),
               entry(2, WorkerState.INCOMPATIBLE,
                     "worker http://w2:1 tokenizes with 'a' but the router with 'b': ...")]
    assert unavailable_reason(entries) == (
        "2 unhealthy (connection refused), 1 incompatible (tokenizes with 'a' but the router "
        "with 'b')")
    entries.append(entry(3, WorkerState.UNHEALTHY, "/health answered 503"))
    assert unavailable_reason(entries).startswith(
        "3 unhealthy (2 connection refused, 1 status 503), ")
    assert unavailable_reason([]) == NO_WORKER_CONFIGURED
