"""Conversations the router has seen, and the worker each one lives on. Pure: the clock is
passed in.

A chat turn, or an agent's next step, sends the whole conversation so far: the previous
request's prompt, its reply, and something new. So the previous prompt's last full block is
among the new prompt's blocks (block hashes chain, so equal blocks mean equal prefixes). The
tracker keeps each routed request's last full block as a *head*, with the worker it went to
and the prompt's length; a later request that holds a live head before its own last block,
or as its last block with more tokens after it (a follow-up too short to fill a block),
*continues* that session, and its own last block becomes the session's head, wherever it is
routed. The same prompt again (a retry) continues nothing.

What the router does with it: shows it (``/debug/route`` names the session a request continues,
``/metrics`` the live sessions per worker and the continue rate). The rule does not price it
(:mod:`router.routing.scheduler`): a continuation's history is a prefix its worker holds, which
the time to first token already counts, and a forecast of turns to come must not outweigh a
certain hit.

A head not continued within ``expiry_gaps`` times the mean gap between a session's requests
(routing to routing; ``initial_expiry_s`` until a gap has been seen; never under
``min_expiry_s``, so back-to-back requests do not end every session at once) has ended: it is
dropped and counted as not continued. ``max_heads`` bounds memory (the oldest heads go first;
about 240 bytes a head, so 63 MB at the default bound of 262,144 live heads).
``docs/benchmarks.md`` ("Sessions") has the measurements that set the defaults.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Continuation", "SessionTracker"]


@dataclass(frozen=True, slots=True)
class Continuation:
    """A request's session: the head it holds, the worker the session lives on, and when that
    head was routed."""

    key: int
    worker: int
    routed_at: float


class SessionTracker:
    """Live session heads per worker (module docstring).

    Args:
        expiry_gaps: a head lives this many mean gaps between a session's requests.
        initial_expiry_s: how long a head lives before any gap has been seen.
        min_expiry_s: the shortest a head lives.
        max_heads: the most heads kept; past it the oldest are dropped as if expired.
        gap_smoothing: the weight of each new gap in the mean (an exponential average).
        rate_window: outcomes (continued or expired) the continuation rate remembers: past
            it both counts are halved, so the rate follows a workload that changes.
    """

    def __init__(self, expiry_gaps: float = 8.0, initial_expiry_s: float = 10.0,
                 min_expiry_s: float = 1.0, max_heads: int = 1 << 18,
                 gap_smoothing: float = 0.05, rate_window: int = 1 << 16) -> None:
        if not expiry_gaps > 0 or not initial_expiry_s > 0 or not min_expiry_s >= 0:
            raise ValueError("expiry_gaps and initial_expiry_s must be positive, "
                             "min_expiry_s not negative")
        if max_heads < 1 or rate_window < 2 or not 0 < gap_smoothing <= 1:
            raise ValueError("max_heads >= 1, rate_window >= 2, gap_smoothing in (0, 1]")
        self.expiry_gaps = expiry_gaps
        self.initial_expiry_s = initial_expiry_s
        self.min_expiry_s = min_expiry_s
        self.max_heads = max_heads
        self.gap_smoothing = gap_smoothing
        self.rate_window = rate_window
        self._heads: dict[int, tuple[int, float, int]] = {}  # key -> worker, routed_at, tokens
        self._order: deque[tuple[float, int]] = deque()  # (routed_at, key), oldest first
        self._live: dict[int, int] = {}
        self._gap: float | None = None
        self._expiry_s = initial_expiry_s  # expiry_s, kept as the gap changes
        self._continued = 0.0
        self._ended = 0.0
        #: The share of heads continued rather than expired (0 before any outcome).
        self.continue_rate = 0.0

    @property
    def mean_gap(self) -> float | None:
        """The mean seconds between a session's requests, once one has been seen."""
        return self._gap

    @property
    def expiry_s(self) -> float:
        """How long a head lives now."""
        return self._expiry_s


    def live(self, worker: int) -> int:
        """Live heads (sessions) on ``worker``."""
        return self._live.get(worker, 0)

    def __len__(self) -> int:
        return len(self._heads)

    def continuation(self, hashes: Sequence[int], now: float, tokens: int = 0
                     ) -> Continuation | None:
        """Expire old heads, then return the session a prompt of ``hashes`` (``tokens`` long)
        continues: the longest live head among its blocks (its last block only when the
        prompt is longer than that head's), or None."""
        order = self._order
        if order and order[0][0] < now - self._expiry_s:
            self._expire(now)
        if not hashes:
            return None
        heads = self._heads
        head = heads.get(hashes[-1])
        if head is not None and tokens > head[2]:
            return Continuation(hashes[-1], head[0], head[1])
        # The scan runs in C (filter over a builtin): a new chat's whole prompt is scanned.
        key = next(filter(heads.__contains__, reversed(hashes[:-1])), None)
        if key is None:
            return None
        worker, routed_at, _ = heads[key]
        return Continuation(key, worker, routed_at)

    def routed(self, hashes: Sequence[int], worker: int, now: float,
               continued: Continuation | None = None, tokens: int = 0) -> None:
        """Record a request of ``hashes`` (``tokens`` long) sent to ``worker``: the head it
        continued (from :meth:`continuation`) is consumed, and its last block becomes a head on
        ``worker``."""
        if continued is not None:
            head = self._heads.get(continued.key)
            if head is not None and head[1] == continued.routed_at:
                del self._heads[continued.key]
                self._live[head[0]] -= 1
            gap = now - continued.routed_at
            self._gap = gap if self._gap is None else (
                (1 - self.gap_smoothing) * self._gap + self.gap_smoothing * gap)
            self._expiry_s = max(self.expiry_gaps * self._gap, self.min_expiry_s)
            self._outcome(continued=True)
        if not hashes:
            return
        key = hashes[-1]
        old = self._heads.get(key)
        if old is not None:  # the same prompt again: one head, now here
            self._live[old[0]] -= 1
        self._heads[key] = (worker, now, tokens)
        self._live[worker] = self._live.get(worker, 0) + 1
        self._order.append((now, key))
        while len(self._heads) > self.max_heads:
            self._drop_oldest()

    def forget(self, worker: int) -> None:
        """Drop every head on ``worker`` (removed, or its cache cleared): its sessions'
        next requests are new ones."""
        keys = [k for k, head in self._heads.items() if head[0] == worker]
        for k in keys:
            del self._heads[k]
        self._live.pop(worker, None)

    def _expire(self, now: float) -> None:
        cutoff = now - self._expiry_s
        order = self._order
        while order and order[0][0] < cutoff:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        routed_at, key = self._order.popleft()
        head = self._heads.get(key)
        if head is not None and head[1] == routed_at:  # else continued or replaced since
            del self._heads[key]
            self._live[head[0]] -= 1
            self._outcome(continued=False)

    def _outcome(self, continued: bool) -> None:
        if continued:
            self._continued += 1
        else:
            self._ended += 1
        if self._continued + self._ended > self.rate_window:
            self._continued /= 2
            self._ended /= 2
        self.continue_rate = self._continued / (self._continued + self._ended)
