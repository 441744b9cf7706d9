"""The kept list of healthy workers: one list object between changes, rebuilt after one."""

from __future__ import annotations

from dataclasses import dataclass

from router.fleet.healthy import HealthyWorkers
from router.fleet.worker_table import WorkerState


@dataclass
class _Entry:
    id: int
    state: WorkerState


def test_the_list_is_kept_until_a_change_and_follows_it() -> None:
    entries = {i: _Entry(i, WorkerState.HEALTHY) for i in range(3)}
    healthy = HealthyWorkers(entries)
    first = healthy.list()
    assert [e.id for e in first] == [0, 1, 2]
    assert healthy.list() is first
    entries[1].state = WorkerState.UNHEALTHY
    healthy.changed()
    assert [e.id for e in healthy.list()] == [0, 2]
    entries[3] = _Entry(3, WorkerState.HEALTHY)
    entries[1].state = WorkerState.HEALTHY
    del entries[0]
    healthy.changed()
    assert [e.id for e in healthy.list()] == [1, 2, 3]
    entries[2].state = WorkerState.INCOMPATIBLE
    healthy.changed()
    assert [e.id for e in healthy.list()] == [1, 3]
