"""The prefix index in pure Python: the executable specification of the compiled core.

For every router-local block hash the index knows which workers hold that block and on which
tier. Because a local hash names its whole prefix (:mod:`indexer.hashing`), the radix tree of
prompts collapses into one map from hash to holders, and "how many leading blocks of this
prompt does worker w hold" is a walk down the prompt's hashes that stops at the first miss.
``native/_core.pyx`` implements the same class, name for name, with C-level tables; the
differential tests feed both the same event streams.

Notes:
    1. Residency is counted per (block, worker, tier). Each engine hash a worker stored adds
       one reference on its tier to its local hash (two engine hashes can name one local
       hash); :meth:`PrefixIndex.store_hashes` sets a direct flag instead (no engine hash).
       A tier holds the block while it has a reference or the flag.
    2. Per worker, engine hash -> (local hash, tiers), so that removals, which carry only
       engine hashes, apply. A store whose engine hash is already mapped to another local
       hash drops the old mapping (all tiers) first.
    3. A store is skipped and counted when its block size differs from the index's (with a
       warning on each worker's 1st, 10th, 100th... occurrence: no clocks here, and one
       misconfigured worker does not silence the warning for the next), when its token count
       is not blocks x block size, when its parent is unknown for that worker, when image
       positions come without items, or when a token is out of range; checked in that order.
    4. A removal of an engine hash the worker does not hold on that tier is a counted no-op.
    5. Workers are ints in ``[0, 2**31)``; nothing is allocated per possible worker.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from indexer.events import U64_MASK, Cleared, Removed, Stored, Tier, tier_of
from indexer.hashing import GLOBAL_SEED, UnhashableStore, block_hashes, event_hash_input

__all__ = ["STAT_NAMES", "PrefixIndex", "warn_block_size_mismatch"]

log = logging.getLogger(__name__)

#: The counters :meth:`PrefixIndex.stats` returns, in order.
STAT_NAMES = (
    "stored_blocks",
    "removed_blocks",
    "unknown_parent",
    "unknown_removal",
    "block_size_mismatch",
    "malformed_stores",
    "unhashable_images",
    "bad_tokens",
    "clears",
)

_TIERS = (Tier.DEVICE, Tier.HOST)


def _check_worker(worker: object) -> int:
    if type(worker) is not int or not 0 <= worker < 2**31:
        raise ValueError(f"a worker id is an int in [0, 2**31), not {worker!r}")
    return worker


def _check_tier(tier: object) -> int:
    if tier not in _TIERS or type(tier) is not int:
        raise ValueError(f"tier must be Tier.DEVICE (0) or Tier.HOST (1), not {tier!r}")
    return tier


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MASK  # type: ignore[operator]


def _check_hashes(hashes: Sequence[int]) -> list[int]:
    for h in hashes:
        if not _is_u64(h):
            raise ValueError(f"a block hash is an int in [0, 2**64), not {h!r}")
    return list(hashes)


def warn_block_size_mismatch(worker: int, got: int, expected: int, count: int) -> None:
    """Warn about ``worker``'s ``count``-th block-size mismatch if it is the 1st, 10th, 100th..."""
    if str(count).rstrip("0") == "1":
        log.warning(
            "worker %d stores blocks of %d tokens but the index uses %d: skipped (%d so far"
            " from this worker);"
            " overlap with this worker will stay 0 until the block sizes agree",
            worker, got, expected, count,
        )


class _Holding:
    """One worker's residency of one block: references per tier and the direct flags."""

    __slots__ = ("direct", "refs")

    def __init__(self) -> None:
        self.refs = [0, 0]
        self.direct = [False, False]

    def on(self, tier: int) -> bool:
        return self.refs[tier] > 0 or self.direct[tier]

    def empty(self) -> bool:
        return not (self.on(Tier.DEVICE) or self.on(Tier.HOST))


class _Worker:
    """What the index knows of one worker: its engine hashes and its per-tier block counts."""

    __slots__ = ("blocks", "direct", "engine")

    def __init__(self) -> None:
        self.engine: dict[int, tuple[int, int]] = {}  # engine hash -> (local hash, tier mask)
        self.direct: dict[int, int] = {}  # local hash -> tier mask, from store_hashes
        self.blocks = [0, 0]  # distinct local hashes resident per tier


class PrefixIndex:
    """Which workers hold which prefix blocks, on which tier.

    Args:
        block_size: tokens per block; stores with another block size are skipped.

    Raises:
        ValueError: ``block_size`` is not a positive int.
    """

    def __init__(self, block_size: int) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, not {block_size!r}")
        self.block_size = block_size
        self._blocks: dict[int, dict[int, _Holding]] = {}
        self._workers: dict[int, _Worker] = {}
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._mismatches: dict[int, int] = {}  # worker -> block-size mismatches, for warnings

    # -- residency bookkeeping -------------------------------------------------------------

    def _holding(self, worker: int, local: int) -> _Holding:
        holders = self._blocks.setdefault(local, {})
        holding = holders.get(worker)
        if holding is None:
            holding = holders[worker] = _Holding()
        return holding

    def _changed(self, worker: int, state: _Worker, local: int, holding: _Holding,
                 tier: int, was_on: bool) -> None:
        state.blocks[tier] += holding.on(tier) - was_on
        if holding.empty():
            holders = self._blocks[local]
            del holders[worker]
            if not holders:
                del self._blocks[local]

    def _add_ref(self, worker: int, state: _Worker, local: int, tier: int, delta: int) -> None:
        holding = self._holding(worker, local)
        was_on = holding.on(tier)
        holding.refs[tier] += delta
        assert holding.refs[tier] >= 0, "an engine hash was dropped twice: tier mask is stale"
        self._changed(worker, state, local, holding, tier, was_on)

    def _set_direct(self, worker: int, state: _Worker, local: int, tier: int,
                    flag: bool) -> None:
        holding = self._holding(worker, local)
        was_on = holding.on(tier)
        holding.direct[tier] = flag
        self._changed(worker, state, local, holding, tier, was_on)

    def _store_engine(self, worker: int, state: _Worker, engine: int, local: int,
                      tier: int) -> None:
        old = state.engine.get(engine)
        if old is not None and old[0] != local:
            self._drop_engine(worker, state, engine, old, (Tier.DEVICE, Tier.HOST))
            old = None
        mask = 0 if old is None else old[1]
        if not mask >> tier & 1:
            state.engine[engine] = (local, mask | 1 << tier)
            self._add_ref(worker, state, local, tier, 1)

    def _drop_engine(self, worker: int, state: _Worker, engine: int, entry: tuple[int, int],
                     tiers: Sequence[int]) -> int:
        local, mask = entry
        dropped = 0
        for tier in tiers:
            if mask >> tier & 1:
                mask &= ~(1 << tier)
                self._add_ref(worker, state, local, tier, -1)
                dropped += 1
        if mask:
            state.engine[engine] = (local, mask)
        else:
            del state.engine[engine]
        return dropped

    # -- events -------------------------------------------------------------------------

    def apply(self, worker: int, event: Stored | Removed | Cleared) -> None:
        """Apply one normalised event from ``worker``'s stream.

        Bad stream input is counted in :meth:`stats` and skipped, never raised.

        Args:
            worker: the publishing worker.
            event: a :class:`~indexer.events.Stored`, ``Removed`` or ``Cleared``.

        Raises:
            ValueError: ``worker`` is out of range or ``event`` is not one of those types.
        """
        _check_worker(worker)
        if type(event) is Stored:
            self._apply_stored(worker, event)
        elif type(event) is Removed:
            self._apply_removed(worker, event)
        elif type(event) is Cleared:
            self._stats["clears"] += 1
            self.clear(worker)
        else:
            raise ValueError(f"not a KV event: {type(event).__name__}")

    def apply_batch(self, worker: int, events: Sequence[Stored | Removed | Cleared]) -> None:
        """Apply a batch of ``worker``'s events in order; see :meth:`apply`.

        Raises:
            ValueError: as :meth:`apply`; the events before the bad one stay applied.
        """
        for event in events:
            self.apply(worker, event)

    def _apply_stored(self, worker: int, event: Stored) -> None:
        stats = self._stats
        blocks = len(event.block_hashes)
        if event.block_size != self.block_size:
            stats["block_size_mismatch"] += 1
            count = self._mismatches[worker] = self._mismatches.get(worker, 0) + 1
            warn_block_size_mismatch(worker, event.block_size, self.block_size, count)
            return
        if (len(event.token_ids) != blocks * self.block_size
                or not all(_is_u64(h) for h in event.block_hashes)
                or not (event.parent_block_hash is None or _is_u64(event.parent_block_hash))):
            stats["malformed_stores"] += 1
            return
        state = self._workers.get(worker)
        parent = None
        if event.parent_block_hash is not None:
            entry = state.engine.get(event.parent_block_hash) if state is not None else None
            if entry is None:
                stats["unknown_parent"] += 1
                return
            parent = entry[0]
        try:
            seed, mm = event_hash_input(event)
        except UnhashableStore:
            stats["unhashable_images"] += 1
            return
        try:
            local = block_hashes(event.token_ids, self.block_size, parent=parent, mm=mm,
                                 seed=GLOBAL_SEED if seed is None else seed)
        except ValueError:
            stats["bad_tokens"] += 1
            return
        if state is None:
            state = self._workers[worker] = _Worker()
        tier = tier_of(event.medium)
        for engine, h in zip(event.block_hashes, local, strict=True):
            self._store_engine(worker, state, engine, h, tier)
        stats["stored_blocks"] += blocks

    def _apply_removed(self, worker: int, event: Removed) -> None:
        tier = tier_of(event.medium)
        state = self._workers.get(worker)
        for engine in event.block_hashes:
            entry = state.engine.get(engine) if state is not None and _is_u64(engine) else None
            if entry is None or not entry[1] >> tier & 1:
                self._stats["unknown_removal"] += 1
                continue
            self._drop_engine(worker, state, engine, entry, (tier,))  # type: ignore[arg-type]
            self._stats["removed_blocks"] += 1

    # -- direct operations --------------------------------------------------------------

    def store_hashes(self, worker: int, local_hashes: Sequence[int],
                     tier: int = Tier.DEVICE) -> None:
        """Mark local hashes resident on ``worker``'s tier without an engine hash.

        For predicted residency and for routing without events. Idempotent per hash.

        Raises:
            ValueError: the worker, a hash or the tier is out of range.
        """
        _check_worker(worker)
        _check_tier(tier)
        hashes = _check_hashes(local_hashes)
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _Worker()
        for h in hashes:
            mask = state.direct.get(h, 0)
            if not mask >> tier & 1:
                state.direct[h] = mask | 1 << tier
                self._set_direct(worker, state, h, tier, True)

    def remove_hashes(self, worker: int, local_hashes: Sequence[int],
                      tier: int = Tier.DEVICE) -> None:
        """Undo :meth:`store_hashes` for these hashes on ``worker``'s tier.

        Residency that came from events stays. Hashes not stored directly are ignored.

        Raises:
            ValueError: the worker, a hash or the tier is out of range.
        """
        _check_worker(worker)
        _check_tier(tier)
        hashes = _check_hashes(local_hashes)
        state = self._workers.get(worker)
        if state is None:
            return
        for h in hashes:
            mask = state.direct.get(h, 0)
            if mask >> tier & 1:
                mask &= ~(1 << tier)
                if mask:
                    state.direct[h] = mask
                else:
                    del state.direct[h]
                self._set_direct(worker, state, h, tier, False)

    def clear(self, worker: int) -> None:
        """Forget every block ``worker`` holds (its cache was cleared); it stays known.

        Raises:
            ValueError: ``worker`` is out of range.
        """
        _check_worker(worker)
        state = self._workers.get(worker)
        if state is None:
            return
        for engine, entry in list(state.engine.items()):
            self._drop_engine(worker, state, engine, entry, _TIERS)
        for h, mask in list(state.direct.items()):
            for tier in _TIERS:
                if mask >> tier & 1:
                    self._set_direct(worker, state, h, tier, False)
        state.direct.clear()
        assert state.blocks == [0, 0], "per-worker block counts drifted from the holdings"

    def remove_worker(self, worker: int) -> None:
        """Forget ``worker`` entirely (it left the deployment).

        Raises:
            ValueError: ``worker`` is out of range.
        """
        self.clear(worker)
        self._workers.pop(worker, None)
        self._mismatches.pop(worker, None)

    # -- queries --------------------------------------------------------------------------

    def match(self, local_hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Return, per worker, how many leading blocks of a prompt it holds.

        Args:
            local_hashes: the prompt's chained local hashes (:func:`block_hashes`).

        Returns:
            ``{worker: (matched_blocks, device_matched_blocks)}``: the leading run held on any
            tier and the leading run held on the device tier, for workers with a run > 0.

        Raises:
            ValueError: a hash is not an int in ``[0, 2**64)``.
        """
        hashes = _check_hashes(local_hashes)
        runs: dict[int, list[int]] = {}  # worker -> [any run, device run]
        live: list[int] = []
        for i, h in enumerate(hashes):
            holders = self._blocks.get(h)
            if holders is None:
                break
            if i == 0:
                live = list(holders)
                for w, holding in holders.items():
                    runs[w] = [1, int(holding.on(Tier.DEVICE))]
                continue
            still = []
            for w in live:
                held = holders.get(w)
                if held is None:
                    continue
                holding = held
                run = runs[w]
                run[0] = i + 1
                if run[1] == i and holding.on(Tier.DEVICE):
                    run[1] = i + 1
                still.append(w)
            live = still
            if not live:
                break
        return {w: (run[0], run[1]) for w, run in runs.items()}

    def engine_hashes(self, worker: int) -> dict[int, int]:
        """Return ``worker``'s engine hashes and their tiers (bit 0 device, bit 1 host)."""
        state = self._workers.get(_check_worker(worker))
        return {} if state is None else {e: mask for e, (_, mask) in state.engine.items()}

    def num_blocks(self) -> int:
        """Return the number of distinct local hashes resident on any worker."""
        return len(self._blocks)

    def worker_blocks(self, worker: int) -> tuple[int, int]:
        """Return how many distinct blocks ``worker`` holds on (device, host)."""
        state = self._workers.get(_check_worker(worker))
        return (0, 0) if state is None else (state.blocks[0], state.blocks[1])

    def workers(self) -> list[int]:
        """Return the workers the index knows, in ascending order."""
        return sorted(self._workers)

    def memory_bytes(self) -> int:
        """Return an estimate of the memory the index holds (walks every entry: slow)."""
        size = sys.getsizeof(self._blocks) + sys.getsizeof(self._workers)
        for holders in self._blocks.values():
            size += sys.getsizeof(holders) + len(holders) * (
                sys.getsizeof(_Holding()) + 2 * sys.getsizeof([0, 0]))
        for state in self._workers.values():
            size += sys.getsizeof(state.engine) + sys.getsizeof(state.direct)
            size += len(state.engine) * (sys.getsizeof((0, 0)) + 2 * sys.getsizeof(U64_MASK))
        return size

    def stats(self) -> dict[str, int]:
        """Return the event counters (:data:`STAT_NAMES`)."""
        return dict(self._stats)
