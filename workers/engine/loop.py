"""The engine: the async shell that runs the batcher, the executor and the event stream.

One task loops over iterations::

    plan = batcher.schedule()             # idle: sleep until a request arrives
    sampled = await executor.execute(plan)
    outputs = batcher.complete(plan, sampled)
    sink.capture(cache.take_events()); batch = sink.next_batch(ts, rank)
    await publisher.publish(batch)        # the router learns of new blocks ...
    deliver outputs to request handles    # ... before the client sees the tokens

Everything that decides lives in the pure cores (:mod:`workers.engine.batcher`,
:mod:`workers.cache.cache_manager`, :mod:`workers.cache.event_sink`); this module only awaits,
reads the clock and hands values between them. It is what the worker's HTTP layer calls:
:meth:`Engine.submit` returns a :class:`RequestHandle` to iterate over, :meth:`Engine.load` and
:meth:`Engine.stats` report, :meth:`Engine.snapshot` and :meth:`Engine.reset_prefix_cache`
serve the event stream's side channels.

Batches are closed and published under one lock, so sequence numbers follow the order in which
the sink closed the batches, whoever (the loop or a reset) closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from indexer.wire import KVEventBatch, WireEvent
from workers.cache.block_keys import BlockKey, Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.cache.publisher import EventPublisher
from workers.engine.batcher import Batcher, EngineRequest, Output
from workers.engine.executor import BlockTransfer, Executor, IterationPlan

__all__ = ["Engine", "RequestFailed", "RequestHandle", "WriteBlocks"]

#: Writes received KV into device blocks: (the prompt's first block index, device block ids).
WriteBlocks = Callable[[int, tuple[int, ...]], None]

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine could not finish a request: it stopped, or an iteration failed."""


class RequestHandle:
    """A submitted request's outputs, as an async iterator of :class:`Output`.

    Iteration ends after the output marked ``finished``, or at once after :meth:`cancel`;
    it raises :class:`RequestFailed` when the engine stops or fails the request.

    Attributes:
        request_id: the request's id.
        prompt_tokens: positions in its prompt.
        num_cached_tokens: prompt tokens found in the KV cache at admission (``None`` until
            admitted; always set before the first output).
    """

    def __init__(self, request: EngineRequest, on_cancel: Callable[[RequestHandle], None]) -> None:
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt.token_ids)
        self.num_cached_tokens: int | None = None
        self._images = request.prompt.images
        self._on_cancel = on_cancel
        self._queue: asyncio.Queue[Output | RequestFailed | None] = asyncio.Queue()
        self._admitted = asyncio.Event()
        self._closed = False  # nothing more will be queued
        self._ended = False  # iteration is over

    async def admitted(self) -> int:
        """Wait until the request is admitted and return :attr:`num_cached_tokens`.

        Raises:
            RequestFailed: the request ended (failed or cancelled) before admission.
        """
        await self._admitted.wait()
        if self.num_cached_tokens is None:
            raise RequestFailed(f"request {self.request_id!r} ended before admission")
        return self.num_cached_tokens

    def cancel(self) -> None:
        """Abort the request and free its blocks; iteration ends. Safe to call twice."""
        if not self._closed:
            self._on_cancel(self)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Output:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, RequestFailed):
            self._ended = True
            raise item
        self._ended = item.finished
        return item

    # -- the engine's side -----------------------------------------------------------------

    def _admit(self, num_cached_tokens: int) -> None:
        self.num_cached_tokens = num_cached_tokens
        self._admitted.set()

    def _put(self, output: Output) -> None:
        assert not self._closed, f"output for closed request {self.request_id!r}"
        self._queue.put_nowait(output)
        self._closed = output.finished

    def _close(self, error: RequestFailed | None) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(error)
            self._admitted.set()


class Engine:
    """Runs continuous batching over a cache manager and publishes its KV events.

    Args:
        cache: the cache manager (the one ``batcher`` drives).
        batcher: the scheduler.
        executor: computes iterations (:class:`~workers.engine.executor.SimExecutor` or a GPU one).
        sink: turns cache facts into event batches.
        publisher: sends the batches; ``None`` publishes nothing. The caller starts and closes
            it: the engine only publishes.
        rank: the data-parallel rank stamped on batches.
        clock: seconds since the epoch, for batch timestamps.

    Notes:
        1. Every request held by the batcher has exactly one handle here, and a handle stays
           registered until its last output is delivered, so a request id cannot be reused
           while outputs for it are on their way.
        2. After :meth:`stop` no task is left and every handle has ended.
    """

    def __init__(
        self,
        cache: CacheManager,
        batcher: Batcher,
        executor: Executor,
        sink: EventSink,
        publisher: EventPublisher | None,
        *,
        rank: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if batcher.cache is not cache:
            raise ValueError("the batcher must drive the engine's cache manager")
        self.cache = cache
        self.batcher = batcher
        self.executor = executor
        self.sink = sink
        self.publisher = publisher
        self.rank = rank
        self._clock = clock
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._publish_lock = asyncio.Lock()
        # Held from scheduling an iteration to its end, and while received KV is written: the
        # cache's allocations and the device's blocks change under one holder at a time.
        self._device = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._busy_seconds = 0.0
        self._failed_iterations = 0
        self._publish_errors = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the iteration loop.

        Raises:
            RuntimeError: already started, or stopped.
        """
        if self._task is not None or self._stopped:
            raise RuntimeError("engine already started or stopped")
        self._task = asyncio.create_task(self._run(), name=f"kv-engine rank {self.rank}")

    async def stop(self) -> None:
        """Stop the loop, abort every request and end every handle; safe to call twice."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        plan = self.batcher.in_flight
        for rid in self.batcher.request_ids():
            self.batcher.abort(rid)
        if plan is not None:
            self.batcher.complete(plan, {})  # every request in it is aborted: a no-op
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle._close(RequestFailed("engine stopped"))

    # -- requests --------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> RequestHandle:
        """Queue a request.

        Returns:
            Its handle.

        Raises:
            ValueError: the request is invalid (too long, duplicate id); nothing changed.
            RuntimeError: the engine is stopped.
        """
        if self._stopped:
            raise RuntimeError("engine is stopped")
        if request.request_id in self._handles:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        self.batcher.add(request)
        handle = RequestHandle(request, self._cancel)
        self._handles[request.request_id] = handle
        self._wake.set()
        return handle

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block and publish ``AllBlocksCleared`` now.

        Returns:
            ``True`` once the batch is published; ``False``, changing nothing, while running
            requests hold blocks.
        """
        async with self._publish_lock:
            if not self.cache.reset_prefix_cache():
                return False
            await self._publish_pending()
        return True

    async def receive_blocks(self, prompt: Prompt, num_tokens: int,
                             write: WriteBlocks | None = None) -> int:
        """Take KV computed elsewhere (a prefill worker's) for ``prompt``'s first
        ``num_tokens`` positions into the cache, as committed blocks, and publish them: the
        request that follows finds them cached, and a router learns of them from the events.

        ``write(first, block_ids)`` puts the KV of the prompt's blocks ``first, first + 1,
        ...`` into the device blocks ``block_ids`` (the torch engine's received bytes; the
        sim engine has none to write). It runs in a thread while no iteration runs, after the
        allocation's own copies; blocks this cache held already are not written again. When
        it raises, nothing is committed and the error propagates.

        Returns:
            The tokens received that this cache did not hold already: whole blocks, up to
            every full block but the one holding the prompt's last token (which the request
            computes itself); 0 when too few blocks are free (the request then prefills
            itself).
        """
        bs = self.cache.block_size
        usable = min(num_tokens, (len(prompt.token_ids) - 1) // bs * bs)
        if usable <= 0:
            return 0
        transfer = f"transfer-{id(prompt)}-{time.monotonic_ns()}"
        async with self._device:
            alloc = self.cache.allocate(transfer, prompt)
            if alloc is None:
                return 0
            try:
                copy = getattr(self.executor, "copy_blocks", None)
                if (alloc.offload or alloc.onboard) and callable(copy):
                    await _to_thread(copy, (BlockTransfer(alloc.offload, alloc.onboard),))
                first = alloc.num_cached_tokens // bs
                if write is not None and usable // bs > first:
                    await _to_thread(write, first, alloc.block_ids[first:usable // bs])
            except BaseException:
                self.cache.free(transfer)
                self._wake.set()
                raise
            async with self._publish_lock:
                self.cache.commit_computed(transfer, usable)
                self.cache.free(transfer)
                await self._publish_pending()
        return max(0, usable - alloc.num_cached_tokens)

    def hold_blocks(self, hold_id: str, prompt: Prompt) -> tuple[int, ...]:
        """Keep ``prompt``'s leading cached blocks referenced (a prefill's KV, held for its
        decode worker, :mod:`workers.engine.leases`) until :meth:`release_blocks`; nothing is
        taken, evicted or copied for it.

        Returns:
            The held device block ids, in prompt order; empty when the prompt's first block
            is not cached (nothing is held then).

        Raises:
            ValueError: ``hold_id`` is held already.
        """
        held = self.cache.hold_cached(hold_id, prompt)
        if not held:
            self.cache.free(hold_id)
        return held

    def held_blocks(self, hold_id: str) -> tuple[int, ...]:
        """The device blocks :meth:`hold_blocks` holds under ``hold_id`` (empty: none)."""
        return self.cache.block_ids(hold_id) if hold_id in self.cache else ()

    def release_blocks(self, hold_id: str) -> None:
        """Let go of what :meth:`hold_blocks` held: the blocks stay cached, now evictable."""
        if hold_id in self.cache:
            self.cache.free(hold_id)
            self._wake.set()  # freed blocks may admit a waiting request

    def pin_blocks(self, pin_id: str, keys: Sequence[BlockKey], keep_free: int = 0
                   ) -> tuple[int, ...]:
        """Keep the leading run of ``keys`` cached on the device referenced until
        :meth:`unpin_blocks` (a peer's read, :mod:`workers.http.kv_read`); nothing is taken,
        evicted or copied, and at least ``keep_free`` blocks stay free for requests
        (:meth:`~workers.cache.cache_manager.CacheManager.pin_cached_keys`).

        Returns:
            The pinned device block ids, in key order (empty: nothing pinned).
        """
        return self.cache.pin_cached_keys(pin_id, keys, keep_free)

    def unpin_blocks(self, pin_id: str) -> None:
        """Let go of what :meth:`pin_blocks` pinned; safe to call twice."""
        if self.cache.unpin(pin_id):
            self._wake.set()  # freed blocks may admit a waiting request

    def drop_next_batches(self, n: int) -> None:
        """Withhold the next ``n`` batches from the live stream (fault injection).

        Raises:
            ValueError: ``n`` is negative.
            RuntimeError: the engine has no publisher.
        """
        if self.publisher is None:
            raise RuntimeError("the engine has no publisher")
        self.publisher.drop_next(n)

    # -- reports ---------------------------------------------------------------------------

    def snapshot(self) -> tuple[int, KVEventBatch]:
        """Return the last published seq (-1 if none) and a batch re-stating what it published.

        The two agree: a consumer that applies the batch can continue at seq + 1.
        """
        seq = self.publisher.next_seq - 1 if self.publisher is not None else -1
        events: list[WireEvent] = list(self.sink.snapshot_events())
        return seq, KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=self.rank)

    def load(self) -> dict[str, int | float]:
        """Return what the router weighs: queue, pending prefill, decode blocks, KV usage."""
        pool = self.cache.pool
        return {
            "running": self.batcher.running,
            "waiting": self.batcher.waiting,
            "pending_prefill_tokens": self.batcher.pending_prefill_tokens,
            "decode_blocks": self.batcher.decode_blocks,
            "kv_usage": pool.num_held_blocks / pool.num_blocks,
            "num_blocks": pool.num_blocks,
        }

    def stats(self) -> dict[str, int | float]:
        """Return every counter, flat: the batcher's as named in
        :class:`~workers.engine.batcher.BatcherStats`, then ``cache_*``, ``events_*`` and
        ``publisher_*``."""
        out: dict[str, int | float] = dict(dataclasses.asdict(self.batcher.stats()))
        out["busy_seconds"] = self._busy_seconds
        out["failed_iterations"] = self._failed_iterations
        executor_stats = getattr(self.executor, "stats", None)
        if callable(executor_stats):  # a real device's memory and failures
            out.update(executor_stats())
        for name, value in dataclasses.asdict(self.cache.stats()).items():
            out[f"cache_{name}"] = value
        sink = self.sink.stats
        for name in ("batches", "stored", "removed", "cleared", "coalesced"):
            out[f"events_{name}"] = getattr(sink, name)
        for reason, n in sink.dropped.items():
            out[f"events_dropped_{reason}"] = n
        if self.publisher is not None:
            out["publisher_next_seq"] = self.publisher.next_seq
            out["publisher_sent"] = self.publisher.sent
            out["publisher_withheld"] = self.publisher.withheld
            out["publisher_replays_served"] = self.publisher.replays_served
            out["publisher_errors"] = self._publish_errors
        return out

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            outputs: list[Output] = []
            async with self._device:
                plan = self.batcher.schedule()
                if plan is not None:
                    self._admit(plan)
                    try:
                        sampled, seconds = await self.executor.execute(plan)
                        outputs = self.batcher.complete(plan, sampled)
                        self._busy_seconds += seconds
                    except Exception as exc:  # its requests are recomputed in smaller passes
                        log.exception("iteration %d failed", plan.serial)
                        self._recover(plan, exc)
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                async with self._publish_lock:
                    await self._publish_pending()
            except Exception:  # a lost batch shows as a gap to consumers; keep serving
                self._publish_errors += 1
                log.exception("publishing KV events failed")
            self._deliver(outputs)

    async def _publish_pending(self) -> None:
        # Hold the lock. No await between closing the batch and numbering it (``publish``
        # numbers it before its first await), so ``snapshot`` always sees the two agree.
        self.sink.capture(self.cache.take_events())
        batch = self.sink.next_batch(self._clock(), self.rank)
        if batch is not None and self.publisher is not None:
            await self.publisher.publish(batch)

    def _admit(self, plan: IterationPlan) -> None:
        for rid in plan.admitted:
            handle = self._handles[rid]
            if handle.num_cached_tokens is None:  # a recompute after preemption is not news
                cached = self.batcher.num_cached_tokens(rid)
                assert cached is not None, f"admitted request {rid!r} has no cache hit count"
                handle._admit(cached)
                self.sink.observe_images(handle._images)

    def _deliver(self, outputs: list[Output]) -> None:
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue  # cancelled while the iteration's batch was being published
            handle._put(output)
            if output.finished:
                del self._handles[output.request_id]

    def _recover(self, plan: IterationPlan, exc: Exception) -> None:
        # The batcher preempts the plan's requests for recompute in smaller iterations; only
        # one that failed alone at the smallest size is failed (Batcher.recover).
        self._failed_iterations += 1
        for rid in self.batcher.recover(plan):
            self._handles.pop(rid)._close(
                RequestFailed(f"request {rid!r} failed even alone in an iteration: {exc}"))

    def _cancel(self, handle: RequestHandle) -> None:
        rid = handle.request_id
        if self._handles.get(rid) is handle:
            del self._handles[rid]
            if rid in self.batcher:
                self.batcher.abort(rid)
        handle._close(None)


async def _to_thread(fn: Callable[..., object], *args: object) -> None:
    """Run ``fn`` in a thread; when the caller is cancelled meanwhile, wait for the thread to
    end before the cancellation goes on (the blocks it writes are freed after it)."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise
