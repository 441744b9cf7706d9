"""When ``kvroute up`` restarts a worker that died: at once the first time, then after delays
doubling up to ``cap`` seconds, and at most ``limit`` times in all; past that the worker is
reported and left down (the router routes around it). A pure schedule: the caller gives the
times and does the restarting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RestartSchedule"]


@dataclass
class RestartSchedule:
    """Restarts per child name, bounded, with backoff.

    Args:
        limit: restarts allowed per child.
        first: seconds before the second restart (the first is at once).
        cap: longest delay.
    """

    limit: int = 5
    first: float = 1.0
    cap: float = 30.0
    _restarts: dict[str, int] = field(default_factory=dict)

    def exited(self, name: str, now: float) -> float | None:
        """``name`` exited at ``now``: when to restart it, or None for never again."""
        done = self._restarts.get(name, 0)
        if done >= self.limit:
            return None
        self._restarts[name] = done + 1
        return now if done == 0 else now + min(self.cap, self.first * 2 ** (done - 1))

    def restarts(self, name: str) -> int:
        """How often ``name`` was restarted (or is about to be)."""
        return self._restarts.get(name, 0)
