"""A discrete-event simulation of a routed cluster, in virtual time: no sockets, no sleeping.

Each of N workers is the real worker core: a
:class:`~workers.cache.cache_manager.CacheManager` and a :class:`~workers.engine.batcher.Batcher`,
whose every iteration lasts what :meth:`~workers.engine.executor.SimExecutor.modeled_seconds`
says (``SimConfig.timing``: by default :mod:`workers.engine.timing`'s default model).
After each iteration the worker's cache facts go through the real
:class:`~workers.cache.event_sink.EventSink`; for policies that read the index
(:attr:`~bench.policies.base.Policy.needs_index`) the batch is delivered to the real
:class:`~indexer.index.PrefixIndex` ``event_lag_s`` later, either over the wire
(``encode_batch`` -> bytes -> ``decode_batch`` -> ``apply_batch``, the default) or directly (the
sink's structs converted to normalised events in process; same index content, no msgpack). The
policy decides at each arrival, and hears each request's first token and end when they happen,
and each applied batch's normalised events (:meth:`~bench.policies.base.Policy.index_events`).

Events at one instant are processed in this order: event deliveries, then iteration ends,
then arrivals; among equals, first scheduled first. The run is deterministic for a seed.

Regret (:class:`Regret`): at each arrival the simulation also looks at the cluster as it
really is, not as the policy sees it: how many of the prompt's leading blocks each worker
holds (either tier) and how many prompt tokens it still has to prefill, and from those an
estimate of each worker's time to first token (the timing model's cost a token of its queued
prefill, plus the request's own prefill over what it holds, attention included). A
decision *lost a hit* when another worker held more blocks with no more queued; it *lost
time* when its estimate exceeded the least by more than :data:`TIME_LOST_MARGIN` of itself
(the error allowed a prediction). The same judge for every policy. It also counts the
second copies decisions make: the prompt tokens of the leading run another worker held
beyond the chosen one's, copied there by a peer fetch or recomputed there.

Disaggregated serving (``SimConfig.roles``): a worker may be ``prefill``, ``decode`` or
``both``. For a request the policy gives a prefill worker (:meth:`Policy.prefill_for
<bench.policies.base.Policy.prefill_for>`), the prefill worker runs it with one output token,
as vLLM's ``kv_transfer_params`` flow has it; when that ends, its KV travels to the decode
worker for ``tokens * kv_bytes_per_token / kv_transfer_bytes_per_s`` seconds (the tokens of the
prompt's full blocks the decode worker does not hold yet), enters the decode worker's cache as
committed blocks (published on its event stream, as vLLM's decode server publishes what it
received), and the request then runs there whole: it finds those blocks cached, computes its
last block and decodes. The transfer overlaps the decode worker's iterations (a copy engine,
not the forward pass). A request's TTFT is its decode worker's first token; its hit rate is what
the prefill worker found cached. Inter-token latency is each gap between two consecutive output
tokens of a request, so a decode step that shared its forward pass with a prefill chunk (the
timing model prices one pass of both, :meth:`~workers.engine.timing.TimingModel.iteration_ms`)
shows in it: the interference disaggregation removes from decode workers.

Peer fetch (``SimConfig.peer_fetch``): every worker serves block reads and receives fetch
instructions, as ``kv_fetch`` in a kvroute worker's ``/model_info`` says. For a request the
policy tells to fetch (:meth:`Policy.fetch_for <bench.policies.base.Policy.fetch_for>`: a
source and the blocks it believes the source holds), the driver looks at the source's cache
as it is: the leading run of the prompt's blocks it holds on its device, up to those blocks.
The ones past what the receiving worker holds travel for ``blocks * block_size *
kv_bytes_per_token / kv_transfer_bytes_per_s`` seconds plus :data:`FETCH_READ_S`, overlapping
the receiver's iterations (the worker fetches before it runs the request, beside its engine);
they then enter its cache as committed blocks (published on its event stream) and the request
runs there, finding them cached. The source spends a read share: its iterations are
stretched by the transfer's seconds, at most :data:`READ_SHARE` of each, until repaid. A
source that holds none of them by then fails the fetch (the request recomputes); the policy
hears each result (:meth:`Policy.fetch_result <bench.policies.base.Policy.fetch_result>`),
as a router reads ``x-kvroute-fetch-result``. A request's hit rate counts the fetched blocks
as found cached, as the worker's engine does; the bytes fetched are reported apart
(``SimResult.fetch_bytes``).

Output tokens are the workload's (:meth:`~bench.workloads.WorkloadRequest.output_tokens`), so
generated blocks are cached and reused exactly as a multi-turn workload expects.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.policies.base import HELD, PREFILL_SUFFIX, SHED, Policy, RouteRequest, WorkerMetrics
from bench.workloads import WorkloadRequest
from indexer.decode import DecodeStats, decode_batch
from indexer.events import Cleared, MmItem, Removed, Stored
from indexer.index import PrefixIndex
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from workers.cache.block_keys import Prompt, RequestBlocks
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.executor import IterationPlan, SimExecutor
from workers.engine.timing import DEFAULT_TIMING, TIMING_MODELS, TimingModel

__all__ = ["EVENT_PATHS", "FETCH_READ_S", "READ_SHARE", "ROLES", "TIME_LOST_MARGIN", "Regret",
           "RequestRecord", "SimConfig", "SimResult", "simulate"]

#: A decision lost time when its worker's estimated TTFT exceeded the least by more than this
#: share of its own (the prediction error allowed, :class:`Regret`).
TIME_LOST_MARGIN = 0.25

#: How events reach the index: over the wire format, or as structs in process.
EVENT_PATHS = ("wire", "direct")

_DELIVER, _DONE, _TRANSFERRED, _FETCHED, _ARRIVE = 0, 1, 2, 3, 4

#: Seconds a peer fetch costs besides its blocks (the router's ``FETCH_READ_S``: a request
#: to the source and its lookup).
FETCH_READ_S = 0.002
#: The most of each of a source's iterations its reads may take (they copy blocks out of
#: its device memory beside its forward passes).
READ_SHARE = 0.1

#: A worker's role under disaggregated serving (``both``: prefills and decodes its own).
ROLES = ("prefill", "decode", "both")



@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated cluster.

    Attributes:
        workers: engine workers.
        capacity_tokens: KV cache per worker, in tokens (rounded down to whole blocks).
        block_size: tokens per KV block, on workers and in the index.
        max_num_batched_tokens: tokens per engine iteration (chunked prefill budget).
        max_num_seqs: running requests per worker at most.
        event_lag_s: delay from an iteration's end to its events reaching the index.
        event_path: ``"wire"`` or ``"direct"`` (module docstring).
        max_pending_stored: the event sink's cap on stored blocks per batch.
        timing: the engine's cost model.
        roles: each worker's role (:data:`ROLES`); empty: every worker is ``both``.
        kv_transfer_bytes_per_s: the prefill-to-decode KV link, bytes a second (25 GB/s: the
            worker's ``--kv-transfer-bandwidth`` default, a 200 Gb/s RDMA link); a peer
            fetch's link too.
        peer_fetch: every worker serves and receives peer fetches (module docstring).
    """

    workers: int = 8
    capacity_tokens: int = 500_000
    block_size: int = 32
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    event_lag_s: float = 0.0
    event_path: str = "wire"
    max_pending_stored: int = 4096
    timing: TimingModel = TIMING_MODELS[DEFAULT_TIMING]
    roles: tuple[str, ...] = ()
    kv_transfer_bytes_per_s: float = 25e9
    peer_fetch: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.capacity_tokens < self.block_size:
            raise ValueError("capacity_tokens must hold at least one block")
        if self.event_lag_s < 0:
            raise ValueError(f"event_lag_s must be >= 0, got {self.event_lag_s}")
        if self.event_path not in EVENT_PATHS:
            raise ValueError(f"event_path must be one of {EVENT_PATHS}, got {self.event_path!r}")
        if self.roles and len(self.roles) != self.workers:
            raise ValueError(f"roles names {len(self.roles)} workers, not {self.workers}")
        if any(r not in ROLES for r in self.roles):
            raise ValueError(f"roles must each be one of {ROLES}, got {self.roles}")
        if not self.kv_transfer_bytes_per_s > 0:
            raise ValueError("kv_transfer_bytes_per_s must be positive")

    @property
    def disaggregated(self) -> bool:
        """Whether some worker only prefills or only decodes."""
        return any(r != "both" for r in self.roles)

    @property
    def num_blocks(self) -> int:
        """Device blocks per worker."""
        return self.capacity_tokens // self.block_size


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in virtual seconds from the run's start)."""

    request_id: str
    arrival_s: float
    worker: int
    prompt_tokens: int
    output_length: int
    cached_tokens: int = -1  # prompt tokens found cached at first admission
    first_token_s: float = -1.0
    finish_s: float = -1.0
    tokens_out: int = 0
    #: The worker that prefilled it for its decode worker (-1: it prefilled where it ran).
    prefill_worker: int = -1
    #: Refused by the policy's flow control (never served).
    shed: bool = False

    @property
    def ttft_s(self) -> float:
        """Time to first token."""
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """Time from arrival to the last token."""
        return self.finish_s - self.arrival_s


@dataclass(slots=True)
class SimResult:
    """One policy's run.

    Attributes:
        policy: the policy's name.
        records: one per request, in arrival order.
        busy_s: per worker, virtual seconds spent computing iterations.
        decision_s: per request, wall seconds the policy took to decide (hashing included).
        makespan_s: virtual seconds from the first arrival to the last token.
        wall_s: wall seconds the simulation took.
        preemptions: requests preempted, all workers.
        iterations: engine iterations, all workers.
        event_batches: event batches delivered to the index.
        event_bytes: their encoded size (wire path).
        event_wall_s: wall seconds in the event path: ``sink`` (capture and batch), ``encode``,
            ``decode`` and ``apply``.
        decode_stats: what the decoder skipped (all zero for a healthy run).
        decode_context_s: per worker, the decode context (tokens a decode step attends over,
            summed over the iteration's sequences) times the iteration's seconds, summed;
            over ``busy_s`` it is the context an iteration carried on average, which sets
            how long an iteration takes (``workers.engine.timing``).
    """

    policy: str
    records: list[RequestRecord]
    busy_s: list[float]
    decision_s: list[float]
    makespan_s: float
    wall_s: float
    preemptions: int
    iterations: int
    event_batches: int = 0
    event_bytes: int = 0
    event_wall_s: dict[str, float] = field(default_factory=dict)
    decode_stats: dict[str, int] = field(default_factory=dict)
    decode_context_s: list[float] = field(default_factory=list)
    regret: Regret = field(default_factory=lambda: Regret())
    #: Each first token's predicted and delivered seconds, from a policy that predicts them.
    predictions: list[tuple[float, float]] | None = None
    #: Every gap between two consecutive output tokens of a request (inter-token latency).
    token_gaps_s: list[float] = field(default_factory=list)
    #: Prompt tokens moved from prefill to decode workers, and the transfers.
    transferred_tokens: int = 0
    transfers: int = 0
    #: Peer fetches: instructed, those that inserted blocks, the prompt tokens and bytes
    #: they moved.
    fetches: int = 0
    fetched: int = 0
    fetched_tokens: int = 0
    fetch_bytes: int = 0


@dataclass(slots=True)
class Regret:
    """Decisions judged against the cluster as it was (module docstring)."""

    decisions: int = 0
    #: Another worker held more of the prompt with no more prefill queued.
    hit_lost: int = 0
    #: The chosen worker's estimated TTFT exceeded the least by more than the margin.
    time_lost: int = 0
    #: Prompt tokens of the leading run another worker held beyond the chosen one's (either
    #: tier): copied there by a peer fetch, or recomputed there (a second copy made).
    copied_by_fetch: int = 0
    copied_by_recompute: int = 0


class _Worker:
    __slots__ = ("batcher", "busy_s", "cache", "context_s", "plan", "plan_end_s",
                 "plan_start_s", "read_s", "sink", "wid")

    def __init__(self, wid: int, config: SimConfig, events: bool) -> None:
        self.wid = wid
        self.cache = CacheManager(config.num_blocks, config.block_size)
        self.batcher = Batcher(self.cache, max_num_batched_tokens=config.max_num_batched_tokens,
                               max_num_seqs=config.max_num_seqs)
        self.sink = EventSink(max_pending_stored=config.max_pending_stored) if events else None
        self.plan: IterationPlan | None = None
        # When the iteration in flight (``plan``) started and when it ends.
        self.plan_start_s = self.plan_end_s = 0.0
        self.busy_s = 0.0
        self.context_s = 0.0
        self.read_s = 0.0  # seconds of peer reads its iterations still owe


class _Cluster:
    """The :class:`~bench.policies.base.ClusterView` the policy sees."""

    def __init__(self, workers: list[_Worker], block_size: int, index: PrefixIndex | None,
                 rng: random.Random, roles: tuple[str, ...] = (), peer_fetch: bool = False,
                 kv_bytes_per_token: int = 0) -> None:
        self._workers = workers
        self.roles = roles or ("both",) * len(workers)
        self.num_workers = len(workers)
        self.block_size = block_size
        self.index = index
        self.rng = rng
        self.max_num_seqs = workers[0].batcher.max_num_seqs if workers else 0
        self.capacity_blocks = workers[0].cache.pool.num_blocks if workers else 0
        self.peer_fetch = peer_fetch
        self.kv_bytes_per_token = kv_bytes_per_token

    def worker_metrics(self, worker: int) -> WorkerMetrics:
        w = self._workers[worker]
        pool = w.cache.pool
        return WorkerMetrics(w.batcher.running, w.batcher.waiting,
                             pool.num_held_blocks / pool.num_blocks)


def _normalised(batch: KVEventBatch) -> list[Stored | Removed | Cleared]:
    """The events ``decode_batch(encode_batch(batch))`` yields, without the bytes."""
    out: list[Stored | Removed | Cleared] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            mm = None if e.mm_keys is None else [
                [MmItem(k.hash, k.start_offset, k.uuid) for k in per] for per in e.mm_keys]
            out.append(Stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                              e.medium, e.lora_name, e.lora_id, e.extra_keys, e.group_idx,
                              e.kv_cache_spec_kind, mm, e.trtllm_image_routing))
        elif isinstance(e, BlockRemoved):
            out.append(Removed(e.block_hashes, e.medium, e.group_idx))
        else:
            assert isinstance(e, AllBlocksCleared), f"unknown wire event {e!r}"
            out.append(Cleared())
    return out


def _judge(workers: list[_Worker], prompt: Prompt, timing: TimingModel, block_size: int,
           chosen: int, regret: Regret, fetches: bool = False) -> None:
    """Count one decision's regret (module docstring), and the second copy it makes of
    blocks another worker holds (by a fetch when ``fetches``)."""
    blocks = RequestBlocks(prompt, block_size)
    full = (blocks.num_tokens - 1) // block_size
    keys = [blocks.block(i).key for i in range(full)]
    held, queued, estimate = [], [], []
    for w in workers:
        pool, n = w.cache.pool, 0
        for key in keys:
            if pool.cached_block(key) is None and pool.host_block(key) is None:
                break
            n += 1
        ahead = w.batcher.pending_prefill_tokens
        cached = n * block_size
        held.append(n)
        queued.append(ahead)
        estimate.append(timing.prefill_per_token_ms * ahead
                        + timing.prefill_ms(blocks.num_tokens - cached, cached))
    regret.decisions += 1
    mine = held[chosen]
    if any(h > mine and q <= queued[chosen] for h, q in zip(held, queued, strict=True)):
        regret.hit_lost += 1
    if estimate[chosen] - min(estimate) > TIME_LOST_MARGIN * estimate[chosen]:
        regret.time_lost += 1
    copied = (max(held) - mine) * block_size
    if fetches:
        regret.copied_by_fetch += copied
    else:
        regret.copied_by_recompute += copied


def simulate(requests: Sequence[WorkloadRequest], policy: Policy, config: SimConfig,
             seed: int = 0, progress: Any = None) -> SimResult:
    """Run one policy over a workload on a fresh cluster.

    Args:
        requests: the workload, in arrival order.
        policy: a policy; :meth:`~bench.policies.base.Policy.start` is called here.
        config: the cluster.
        seed: seeds the policy's random choices.
        progress: a tqdm-like object with ``update(n)`` called per finished request, or None.

    Returns:
        Every request's record and the run's counters.

    Raises:
        ValueError: a request cannot fit one worker's cache.
    """
    if config.disaggregated and not policy.disaggregates:
        raise ValueError(f"policy {policy.name} does not route for prefill and decode roles")
    started = time.perf_counter()
    uses_events = policy.needs_index
    workers = [_Worker(w, config, uses_events) for w in range(config.workers)]
    index = PrefixIndex(config.block_size) if uses_events else None
    policy.start(_Cluster(workers, config.block_size, index, random.Random(seed), config.roles,
                          config.peer_fetch, config.timing.kv_bytes_per_token))
    executor = SimExecutor(config.timing, block_size=config.block_size)
    heap: list[tuple[float, int, int, int, Any]] = []
    serial = 0
    for i, r in enumerate(requests):
        heap.append((r.arrival_s, _ARRIVE, serial, i, None))
        serial += 1
    heapq.heapify(heap)

    records: list[RequestRecord] = []
    by_id: dict[str, RequestRecord] = {}
    outputs: dict[str, tuple[int, ...]] = {}
    decision_s: list[float] = []
    idle = [True] * config.workers
    lag = config.event_lag_s
    wire = config.event_path == "wire"
    stats = DecodeStats()
    ev_wall = {"sink": 0.0, "encode": 0.0, "decode": 0.0, "apply": 0.0}
    ev_batches = ev_bytes = 0
    iterations = 0
    last_t = 0.0
    perf = time.perf_counter
    regret = Regret()

    def start_iteration(w: _Worker, now: float) -> None:
        nonlocal serial, iterations
        plan = w.batcher.schedule()
        if plan is None:
            idle[w.wid] = True
            return
        idle[w.wid] = False
        dt = executor.modeled_seconds(plan)
        if w.read_s > 0:  # a peer's reads share its device: at most READ_SHARE of a pass
            extra = min(w.read_s, READ_SHARE * dt)
            w.read_s -= extra
            dt += extra
        w.busy_s += dt
        if plan.decode:
            w.context_s += dt * sum(d.context_len for d in plan.decode)
        w.plan = plan
        w.plan_start_s, w.plan_end_s = now, now + dt
        iterations += 1
        heapq.heappush(heap, (now + dt, _DONE, serial, w.wid, None))
        serial += 1

    held: dict[str, tuple[Prompt, int]] = {}
    #: Remote prefills in flight, by their prefill request's id: the request, its prompt.
    remote: dict[str, tuple[str, Prompt]] = {}
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    moved = [0, 0]  # tokens transferred, transfers
    fetch = [0, 0, 0, 0]  # instructed, fetched, blocks, bytes
    #: Peer fetches in flight, by request id: the source, the blocks that travel, seconds.
    fetching: dict[str, tuple[int, int, int, int, float]] = {}

    def held_run(w: _Worker, blocks: RequestBlocks, limit: int, device: bool) -> int:
        """The leading run of the prompt's blocks ``w`` holds (on its device only, or on
        either tier), at most ``limit``."""
        pool, n = w.cache.pool, 0
        while n < limit:
            key = blocks.block(n).key
            if pool.cached_block(key) is None and (device or pool.host_block(key) is None):
                break
            n += 1
        return n

    def start_fetch(request_id: str, prompt: Prompt, worker: int, source: int, told: int,
                    now: float) -> bool:
        """Begin the fetch a policy told ``worker`` to make; False when there is nothing to
        fetch (the request runs at once)."""
        nonlocal serial
        if source == worker or not 0 <= source < config.workers:
            raise ValueError(f"policy {policy.name} told worker {worker} to fetch from "
                             f"{source}")
        fetch[0] += 1
        bs = config.block_size
        blocks = RequestBlocks(prompt, bs)
        usable = min(told, (blocks.num_tokens - 1) // bs)
        have = held_run(workers[source], blocks, usable, device=True)
        own = held_run(workers[worker], blocks, usable, device=False)
        if have <= own:  # the source lost them: the worker recomputes
            policy.fetch_result(request_id, 0, 0, 0.0, now)
            return False
        nbytes = (have - own) * bs * config.timing.kv_bytes_per_token
        seconds = FETCH_READ_S + nbytes / config.kv_transfer_bytes_per_s
        workers[source].read_s += nbytes / config.kv_transfer_bytes_per_s
        fetching[request_id] = (source, have, have - own, nbytes, seconds)
        heapq.heappush(heap, (now + seconds, _FETCHED, serial, worker, request_id))
        serial += 1
        return True

    def fetched(worker: int, request_id: str, now: float) -> None:
        """A fetch arrived: its blocks enter ``worker``'s cache committed (as a receive
        does), the policy hears the result, and the request runs."""
        _, have, travelled, nbytes, seconds = fetching.pop(request_id)
        rec = by_id[request_id]
        prompt = pending_fetch.pop(request_id)
        cache = workers[worker].cache
        step = request_id + "/fetch"
        if cache.allocate(step, prompt) is not None:
            cache.commit_computed(step, have * config.block_size)
            cache.free(step)
            fetch[1] += 1
            fetch[2] += travelled
            fetch[3] += nbytes
            policy.fetch_result(request_id, travelled, nbytes, seconds, now)
        else:  # no room for them: it recomputes
            policy.fetch_result(request_id, 0, 0, 0.0, now)
        admit(worker, request_id, prompt, rec.output_length, now)

    pending_fetch: dict[str, Prompt] = {}

    def admit(worker: int, request_id: str, prompt: Prompt, output_length: int,
              now: float) -> None:
        w = workers[worker]
        w.batcher.add(EngineRequest(request_id, prompt, output_length))
        if idle[worker]:
            start_iteration(w, now)

    def send(request_id: str, prompt: Prompt, output_length: int, worker: int,
             now: float) -> None:
        for chosen in (worker, prefill := policy.prefill_for(request_id)):
            if chosen is not None and not 0 <= chosen < config.workers:
                raise ValueError(f"policy {policy.name} chose worker {chosen}")
        rec = by_id[request_id]
        rec.worker = worker
        told = policy.fetch_for(request_id) if config.peer_fetch and prefill is None else None
        if not config.disaggregated:
            _judge(workers, prompt, config.timing, config.block_size, worker, regret,
                   told is not None)
        if prefill is None:
            if told is not None and start_fetch(request_id, prompt, worker, told[0], told[1],
                                                now):
                pending_fetch[request_id] = prompt
                return
            admit(worker, request_id, prompt, output_length, now)
            return
        rec.prefill_worker = prefill
        step = request_id + PREFILL_SUFFIX
        remote[step] = (request_id, prompt)
        outputs[step] = outputs[request_id][:1]
        admit(prefill, step, prompt, 1, now)

    def prefilled(step: str, now: float) -> None:
        """A remote prefill ended: its KV leaves for the decode worker (module docstring)."""
        nonlocal serial
        request_id, prompt = remote[step]
        rec = by_id[request_id]
        pool, bs = workers[rec.worker].cache.pool, config.block_size
        blocks = RequestBlocks(prompt, bs)
        usable = (blocks.num_tokens - 1) // bs
        have = 0
        while have < usable and pool.cached_block(blocks.block(have).key) is not None:
            have += 1
        tokens = (usable - have) * bs
        moved[0] += tokens
        moved[1] += 1
        seconds = tokens * config.timing.kv_bytes_per_token / config.kv_transfer_bytes_per_s
        heapq.heappush(heap, (now + seconds, _TRANSFERRED, serial, rec.worker, step))
        serial += 1

    def transferred(worker: int, step: str, now: float) -> None:
        """The KV of ``step`` arrived on ``worker``: its blocks enter the cache as committed
        (as :meth:`workers.engine.loop.Engine.receive_blocks` does), then the request runs."""
        request_id, prompt = remote.pop(step)
        cache, bs = workers[worker].cache, config.block_size
        usable = (len(prompt.token_ids) - 1) // bs * bs
        if usable > 0 and cache.allocate(step, prompt) is not None:
            cache.commit_computed(step, usable)
            cache.free(step)
        admit(worker, request_id, prompt, by_id[request_id].output_length, now)

    def release(now: float) -> None:
        """Send the held requests the policy lets go; mark those it shed."""
        if not held:
            return
        sent, dropped = policy.dispatch(now)
        for request_id, worker in sent:
            prompt, output_length = held.pop(request_id)
            send(request_id, prompt, output_length, worker, now)
        for request_id in dropped:
            held.pop(request_id)
            by_id[request_id].shed = True
            del outputs[request_id]

    while heap:
        now, kind, _, a, payload = heapq.heappop(heap)
        if kind == _ARRIVE:
            r = requests[a]
            tokens = r.token_ids()
            t0 = perf()
            worker = policy.route(RouteRequest(r.request_id, tokens, r.images,
                                               config.block_size), now)
            decision_s.append(perf() - t0)
            rec = RequestRecord(r.request_id, r.arrival_s, worker, len(tokens), r.output_length)
            records.append(rec)
            by_id[r.request_id] = rec
            prompt = Prompt(tokens, r.images)
            if worker == SHED:
                rec.shed = True
            else:
                outputs[r.request_id] = r.output_tokens()
                if worker == HELD:
                    held[r.request_id] = (prompt, r.output_length)
                else:
                    send(r.request_id, prompt, r.output_length, worker, now)
            release(now)
        elif kind == _DONE:
            w = workers[a]
            plan = w.plan
            assert plan is not None, f"worker {a} finished an iteration it never started"
            w.plan = None
            sampled: dict[str, int] = {}
            for c in plan.prefill:
                if plan.admitted and c.request_id in plan.admitted:
                    rec = by_id[remote[c.request_id][0] if c.request_id in remote
                                else c.request_id]
                    if rec.cached_tokens < 0:
                        rec.cached_tokens = c.start
                if c.samples:
                    sampled[c.request_id] = outputs[c.request_id][c.output_index]
            for d in plan.decode:
                sampled[d.request_id] = outputs[d.request_id][d.output_index]
            for out in w.batcher.complete(plan, sampled):
                if out.request_id in remote:  # a remote prefill: its one token is not output
                    del outputs[out.request_id]
                    policy.first_token(out.request_id, now)
                    policy.finished(out.request_id, now)
                    prefilled(out.request_id, now)
                    continue
                rec = by_id[out.request_id]
                rec.tokens_out += 1
                if out.index == 0:
                    rec.first_token_s = now
                    policy.first_token(out.request_id, now)
                else:
                    gaps.append(now - last_token[out.request_id])
                last_token[out.request_id] = now
                if out.finished:
                    rec.finish_s = now
                    last_t = now
                    del outputs[out.request_id], last_token[out.request_id]
                    policy.finished(out.request_id, now)
                    if progress is not None:
                        progress.update(1)
            facts = w.cache.take_events()
            if w.sink is not None:
                t0 = perf()
                w.sink.capture(facts)
                batch = w.sink.next_batch(now, w.wid)
                t1 = perf()
                ev_wall["sink"] += t1 - t0
                if batch is not None:
                    if wire:
                        data: Any = encode_batch(batch)
                        ev_bytes += len(data)
                        ev_wall["encode"] += perf() - t1
                    else:
                        data = batch
                    heapq.heappush(heap, (now + lag, _DELIVER, serial, w.wid, data))
                    serial += 1
            start_iteration(w, now)
            release(now)
        elif kind == _TRANSFERRED:
            transferred(a, payload, now)
        elif kind == _FETCHED:
            fetched(a, payload, now)
        else:
            assert index is not None
            t0 = perf()
            events = decode_batch(payload, stats).events if wire else _normalised(payload)
            t1 = perf()
            index.apply_batch(a, events)
            ev_wall["decode"] += t1 - t0
            ev_wall["apply"] += perf() - t1
            policy.index_events(a, events, now)
            ev_batches += 1

    if held:
        release(last_t)
    assert not held, f"policy {policy.name} held {len(held)} requests to the end"
    for rec in records:
        if rec.shed:
            continue
        assert rec.finish_s >= 0 and rec.tokens_out == rec.output_length, (
            f"request {rec.request_id} did not finish: simulation lost it")
    first = requests[0].arrival_s if requests else 0.0
    return SimResult(
        policy=policy.name,
        records=records,
        busy_s=[w.busy_s for w in workers],
        decision_s=decision_s,
        makespan_s=last_t - first,
        wall_s=time.perf_counter() - started,
        preemptions=sum(w.batcher.preemptions for w in workers),
        iterations=iterations,
        event_batches=ev_batches,
        event_bytes=ev_bytes,
        event_wall_s=ev_wall if uses_events else {},
        decode_stats=stats.as_dict() if uses_events and wire else {},
        decode_context_s=[w.context_s for w in workers],
        regret=regret,
        predictions=policy.predictions(),
        token_gaps_s=gaps,
        transferred_tokens=moved[0],
        transfers=moved[1],
        fetches=fetch[0],
        fetched=fetch[1],
        fetched_tokens=fetch[2] * config.block_size,
        fetch_bytes=fetch[3],
    )
