"""Continuous batching by iteration: which requests compute which tokens in the next forward pass.

The batcher is the engine's scheduler. It owns the request queue and drives the
:class:`~workers.cache.cache_manager.CacheManager`; it does no I/O and reads no clock. Once per
iteration the engine calls :meth:`Batcher.schedule`, hands the :class:`IterationPlan` to an
executor (simulated or real), and gives the sampled tokens back to :meth:`Batcher.complete`.

The rules, in the order one :meth:`~Batcher.schedule` applies them:

1. Decode first: every running request whose prompt is computed gets one token (its last
   sampled one, appended to the cache now; its KV is computed this iteration).
2. When the cache has no block for that growth, the most recently admitted running request is
   preempted: its blocks are freed and it goes back to the *front* of the waiting queue, to be
   recomputed from scratch (prompt plus the tokens it already produced; a prefix hit may spare
   most of that). Its outputs so far stand; the client never sees a token twice. The oldest
   running request is never preempted for a younger one, so it always progresses.
3. Running requests still prefilling get the next chunk of their prompt, oldest first.
4. Unless something was preempted this iteration, waiting requests are admitted first come,
   first served, while :meth:`CacheManager.allocate` finds blocks for the whole prompt and
   fewer than ``max_num_seqs`` run. A cached prefix is not recomputed: prefill starts after it.
5. The tokens of one iteration (one per decode, the chunk sizes) never exceed
   ``max_num_batched_tokens``, so a long prompt spans several iterations (chunked prefill).
6. The context one iteration touches (each decode step's context, each chunk's start plus its
   new tokens) stays under ``max_iteration_context`` when set: the most the engine profiled
   (:mod:`workers.torch.memory`). A step or chunk that would pass it waits for the next
   iteration; a waiting request is admitted only if its whole prompt fits what is left.

   With ``short_prefill`` set (S tokens), rules 3 and 4 change so that a prefill with little
   left goes ahead of a long one: running prefills with at most S tokens left get their
   chunk first, fewest left first (the oldest on a tie); then the longer running prefills
   (oldest first), which leave ``min(S, max_num_batched_tokens / 4)`` of the budget to
   admission while requests wait, when the first waiting one is short (at most S tokens) or
   fits the cache's empty blocks (admitted, it evicts no cached prefix) and does not continue
   a running prefill's prompt past what that computed (admitted now, it would recompute what
   that prefill is about to cache); then admission as in rule 4. When a chunk that ends its
   prompt (a first token) is in the iteration, or a request is admitted early, the longer
   prefills' chunks together stay under ``short_pass_tokens`` (when set), so that an
   iteration a client waits on is short.

7. When an iteration fails (:meth:`Batcher.recover`: the device ran out of memory, say), its
   requests are preempted as in rule 2 and the next iterations are capped at half its tokens
   and requests, until :data:`RECOVERY_ITERATIONS` iterations have passed; a request whose
   iteration held it alone, at the smallest size (a decode step, or a chunk of at most one
   block), fails instead: it cannot run even alone.

:meth:`~Batcher.add` refuses a request that could not run even alone in the cache, so rule 2
always ends with a request that fits: there is no deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.cache.block_keys import U64_MAX, Prompt
from workers.cache.block_pool import BlockCopy
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import BlockTransfer, DecodeStep, IterationPlan, PrefillChunk

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "RECOVERY_ITERATIONS",
    "Batcher",
    "BatcherStats",
    "EngineRequest",
    "Output",
]

#: Finish reason: the request produced ``max_tokens`` tokens.
FINISH_LENGTH = "length"
#: Finish reason: the request sampled its end-of-sequence token.
FINISH_STOP = "stop"
#: Iterations after a failed one that keep its halved caps (rule 7), then each doubles them.
RECOVERY_ITERATIONS = 32


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine sees it.

    Attributes:
        request_id: unique among the requests the engine holds.
        prompt: the prompt (tokens, images, reuse scope).
        max_tokens: how many tokens to generate at most (at least 1).
        eos_token_id: the token that ends generation (finish reason "stop"), or ``None``.
        ignore_eos: generate ``max_tokens`` tokens even past ``eos_token_id``.
    """

    request_id: str
    prompt: Prompt
    max_tokens: int
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(self.prompt, Prompt):
            raise ValueError(f"prompt must be a Prompt, got {type(self.prompt).__name__}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class Output:
    """One sampled token of a request.

    Attributes:
        request_id: whose token.
        token_id: the token (an end-of-sequence token is delivered too, as vLLM does).
        index: its position in the request's output, from 0.
        finished: the request is done; it holds no blocks any more.
        finish_reason: ``"length"`` or ``"stop"`` when finished, else ``None``.
    """

    request_id: str
    token_id: int
    index: int
    finished: bool = False
    finish_reason: str | None = None

    @property
    def first(self) -> bool:
        """Whether this is the request's first token (time to first token ends here)."""
        return self.index == 0


@dataclass(frozen=True, slots=True)
class BatcherStats:
    """Counters since start (``iterations`` ... ``aborted``) and the queue now."""

    iterations: int
    admissions: int
    preemptions: int
    finished: int
    aborted: int
    running: int
    waiting: int
    pending_prefill_tokens: int
    decode_blocks: int
    failed_iterations_recovered: int = 0
    failure_preemptions: int = 0
    failed_requests: int = 0


@dataclass(slots=True, eq=False)
class _Sequence:
    request: EngineRequest
    prompt: Prompt  # what admission allocates: the original prompt, plus outputs on recompute
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading positions whose KV is written (while running)
    num_cached_tokens: int | None = None  # cache hit at the first admission

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt.token_ids)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Batcher:
    """A continuous-batching scheduler over a :class:`CacheManager` (rules in the module doc).

    Args:
        cache: the cache manager; the batcher allocates, grows and frees its requests.
        max_num_batched_tokens: most tokens one iteration computes.
        max_num_seqs: most requests running (holding blocks) at once.
        max_model_len: most positions a request may reach (prompt plus ``max_tokens``);
            by default what the whole cache holds.
        max_iteration_context: most context tokens one iteration may touch (rule 6), at
            least ``max_model_len``; ``None`` for no limit.
        short_prefill: prefills with at most this many tokens left go first, fewest first,
            and the longer ones leave some of the budget to admission while requests wait
            (the paragraph under rule 6); 0 for first come, first served.
        short_pass_tokens: with ``short_prefill``, the most tokens the longer prefills take
            in an iteration that ends another prompt's prefill or admits; 0 for no limit.

    Notes:
        1. A request is in exactly one place: waiting (holds no blocks) or running (holds
           its blocks in ``cache``); finished and aborted requests are forgotten.
        2. Waiting requests are served first come, first served; a preempted one goes back to
           the front.
        3. At most one plan is in flight: :meth:`schedule` refuses to run before the previous
           plan was passed to :meth:`complete`.
        4. A running request's ``num_computed`` only grows, and only in :meth:`complete`: KV
           is committed to the cache after it was computed, never when scheduled.
        5. Every method either succeeds or raises ``ValueError`` before changing anything.
    """

    def __init__(
        self,
        cache: CacheManager,
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_iteration_context: int | None = None,
        short_prefill: int = 0,
        short_pass_tokens: int = 0,
    ) -> None:
        capacity = cache.pool.num_blocks * cache.block_size
        if max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}"
            )
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = capacity if max_model_len is None else max_model_len
        if max_iteration_context is not None and max_iteration_context < self.max_model_len:
            raise ValueError(
                f"max_iteration_context ({max_iteration_context}) must hold one request of "
                f"max_model_len ({self.max_model_len})")
        self.max_iteration_context = max_iteration_context
        if short_prefill < 0 or short_pass_tokens < 0:
            raise ValueError(
                f"short_prefill and short_pass_tokens must be at least 0, got {short_prefill} "
                f"and {short_pass_tokens}")
        self.short_prefill = short_prefill
        self.short_pass_tokens = short_pass_tokens
        self._cap_tokens = max_num_batched_tokens  # rule 7's caps
        self._cap_requests = max_num_seqs
        self._calm = 0  # successful iterations since the last failure
        self._recovered = 0
        self._failure_preemptions = 0
        self._failed_requests = 0
        self._requests: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[str, _Sequence] = {}  # in admission order
        self._in_flight: IterationPlan | None = None
        self._iterations = 0
        self._admissions = 0
        self._preemptions = 0
        self._finished = 0
        self._aborted = 0

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        """Every request held, waiting or running."""
        return list(self._requests)

    def num_cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the request found cached at its first admission (``None`` before)."""
        return self._get(request_id).num_cached_tokens

    @property
    def in_flight(self) -> IterationPlan | None:
        """The plan scheduled and not yet completed, if any."""
        return self._in_flight

    @property
    def running(self) -> int:
        """Requests holding blocks."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self._waiting)

    @property
    def preemptions(self) -> int:
        """Requests preempted since start."""
        return self._preemptions

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt positions still to compute: the rest of running prefills, whole waiting ones."""
        running = sum(
            len(s.prompt.token_ids) - s.num_computed for s in self._running.values() if s.prefilling
        )
        return running + sum(len(s.prompt.token_ids) for s in self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt positions of the requests waiting for admission: what they will allocate
        (a running request took its whole prompt's blocks when it was admitted)."""
        return sum(len(s.prompt.token_ids) for s in self._waiting)

    @property
    def decode_blocks(self) -> int:
        """Blocks held by running requests past their prefill (the router's decode load)."""
        return sum(
            len(self.cache.block_ids(rid)) for rid, s in self._running.items() if not s.prefilling
        )

    def stats(self) -> BatcherStats:
        """Return the counters and the queue now."""
        return BatcherStats(
            iterations=self._iterations,
            admissions=self._admissions,
            preemptions=self._preemptions,
            finished=self._finished,
            aborted=self._aborted,
            running=self.running,
            waiting=self.waiting,
            pending_prefill_tokens=self.pending_prefill_tokens,
            decode_blocks=self.decode_blocks,
            failed_iterations_recovered=self._recovered,
            failure_preemptions=self._failure_preemptions,
            failed_requests=self._failed_requests,
        )

    # -- changes ---------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a request at the back of the waiting queue.

        Raises:
            ValueError: a request with that id is held, or the request is too long for the
                model or for the cache; the message can go to an HTTP client as is.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        n = len(request.prompt.token_ids)
        total = n + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({n} in the prompt, {request.max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion."
            )
        # The last sampled token is never appended, so the cache holds at most total - 1.
        need = _cdiv(total - 1, self.cache.block_size)
        if need > self.cache.pool.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV cache blocks ({n} prompt tokens + "
                f"{request.max_tokens} max_tokens), but the cache has "
                f"{self.cache.pool.num_blocks}; reduce the prompt or max_tokens"
            )
        seq = _Sequence(request, request.prompt)
        self._requests[request.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Forget a request wherever it is and free its blocks (the client went away).

        A request of the plan in flight is skipped when that plan completes.

        Raises:
            ValueError: unknown request.
        """
        seq = self._get(request_id)
        del self._requests[request_id]
        if request_id in self._running:
            del self._running[request_id]
            self.cache.free(request_id)
        else:
            self._waiting.remove(seq)
        self._aborted += 1

    def schedule(self) -> IterationPlan | None:
        """Plan the next iteration (rules in the module docstring).

        Returns:
            The plan, or ``None`` when no request is held.

        Raises:
            ValueError: the previous plan was not completed.
        """
        if self._in_flight is not None:
            raise ValueError(
                f"plan {self._in_flight.serial} is still in flight; complete it "
                f"before scheduling again"
            )
        budget = min(self.max_num_batched_tokens, self._cap_tokens)
        context = self.max_iteration_context  # what is left of rule 6's budget, or None
        slots = self._cap_requests  # requests this iteration may still take (rule 7)
        prefill: list[PrefillChunk] = []
        decode: list[DecodeStep] = []
        transfers: list[BlockTransfer] = []
        admitted: list[str] = []
        preempted = False

        for rid, seq in list(self._running.items()):
            if budget == 0 or slots == 0:
                break
            if rid not in self._running or seq.prefilling:
                continue  # preempted for an older request's growth, or not decoding yet
            if context is not None:
                if self.cache.num_tokens(rid) + 1 > context:
                    continue  # over rule 6's budget: it decodes next iteration
                context -= self.cache.num_tokens(rid) + 1
            growth = self.cache.append_tokens(rid, [seq.outputs[-1]])
            while growth is None:
                victim = next(reversed(self._running.values()))
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                growth = self.cache.append_tokens(rid, [seq.outputs[-1]])
            if growth is None:
                break  # seq preempted itself: it was the youngest, nothing is left to decode
            if growth.offload:
                transfers.append(BlockTransfer(growth.offload, ()))
            decode.append(
                DecodeStep(
                    request_id=rid,
                    block_ids=self.cache.block_ids(rid),
                    context_len=self.cache.num_tokens(rid),
                    token_id=seq.outputs[-1],
                    output_index=len(seq.outputs),
                    prompt=seq.request.prompt,
                )
            )
            budget -= 1
            slots -= 1

        prefilling = [s for s in self._running.values() if s.prefilling]
        longs = prefilling
        longs_cap = budget
        if self.short_prefill:
            short = self.short_prefill
            left = {id(s): len(s.prompt.token_ids) - s.num_computed for s in prefilling}
            longs = [s for s in prefilling if left[id(s)] > short]
            for seq in sorted((s for s in prefilling if left[id(s)] <= short),
                              key=lambda s: left[id(s)]):  # stable: the oldest on a tie
                if budget == 0 or slots == 0:
                    break
                chunk = self._chunk(seq, seq.num_computed, budget, ())
                touched = chunk.start + chunk.num_new_tokens
                if context is not None:
                    if touched > context:
                        continue  # rule 6: it continues next iteration
                    context -= touched
                prefill.append(chunk)
                budget -= chunk.num_new_tokens
                slots -= 1
            longs_cap = budget
            admitting = (bool(self._waiting) and len(self._running) < self.max_num_seqs
                         and self._may_admit_early(self._waiting[0], prefilling))
            if admitting:
                longs_cap = max(0, budget - min(short, self.max_num_batched_tokens // 4))
            if self.short_pass_tokens and (admitting or any(c.samples for c in prefill)):
                longs_cap = min(longs_cap, self.short_pass_tokens)
        for seq in longs:
            if longs_cap == 0 or slots == 0:
                break
            chunk = self._chunk(seq, seq.num_computed, longs_cap, ())
            touched = chunk.start + chunk.num_new_tokens
            if context is not None:
                if touched > context:
                    continue  # rule 6: it continues next iteration
                context -= touched
            prefill.append(chunk)
            budget -= chunk.num_new_tokens
            longs_cap -= chunk.num_new_tokens
            slots -= 1

        while (not preempted and budget and slots and self._waiting
               and len(self._running) < self.max_num_seqs):
            seq = self._waiting[0]
            rid = seq.request.request_id
            if context is not None and len(seq.prompt.token_ids) > context:
                break  # rule 6: its first chunk may touch the whole prompt
            alloc = self.cache.allocate(rid, seq.prompt)
            if alloc is None:
                break
            self._waiting.popleft()
            self._running[rid] = seq
            self._admissions += 1
            seq.num_computed = alloc.num_cached_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = alloc.num_cached_tokens
            admitted.append(rid)
            if alloc.offload or alloc.onboard:
                transfers.append(BlockTransfer(alloc.offload, alloc.onboard))
            chunk = self._chunk(seq, alloc.num_cached_tokens, budget, alloc.onboard)
            prefill.append(chunk)
            budget -= chunk.num_new_tokens
            slots -= 1
            if context is not None:
                context -= chunk.start + chunk.num_new_tokens

        if not prefill and not decode:
            assert not self._requests, (
                f"nothing scheduled with {len(self._running)} running and "
                f"{len(self._waiting)} waiting: admission checks let in a request that "
                f"cannot fit"
            )
            return None
        plan = IterationPlan(
            self._iterations, tuple(prefill), tuple(decode), tuple(transfers), tuple(admitted)
        )
        self._iterations += 1
        self._in_flight = plan
        return plan

    def complete(self, plan: IterationPlan, sampled: dict[str, int]) -> list[Output]:
        """Apply a computed plan: commit the KV it wrote and take one token per sampling request.

        Requests aborted while the plan was in flight are skipped. A finished request is
        freed (its full blocks committed first, so its output is reusable too).

        Args:
            plan: the plan from the last :meth:`schedule`.
            sampled: request id -> token, for every chunk that ``samples`` and every decode
                step (extra entries are ignored).

        Returns:
            One output per token taken, in plan order (prefill chunks, then decode steps).

        Raises:
            ValueError: ``plan`` is not the plan in flight, or a token is missing or not in
                [0, 2**64 - 1].
        """
        if plan is not self._in_flight:
            raise ValueError(f"plan {plan.serial} is not the plan in flight")
        # A request aborted in flight cannot be running again yet: re-added, it waits.
        live = [c for c in plan.prefill if c.request_id in self._running]
        live_decode = [d for d in plan.decode if d.request_id in self._running]
        for rid in [c.request_id for c in live if c.samples] + [d.request_id for d in live_decode]:
            token = sampled.get(rid)
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= U64_MAX:
                raise ValueError(f"no valid sampled token for request {rid!r}: {token!r}")
        self._in_flight = None

        outputs: list[Output] = []
        for chunk in live:
            seq = self._running[chunk.request_id]
            seq.num_computed = chunk.start + chunk.num_new_tokens
            self.cache.commit_computed(chunk.request_id, seq.num_computed)
            if chunk.samples:
                outputs.append(self._take_token(seq, sampled[chunk.request_id]))
        for step in live_decode:
            seq = self._running[step.request_id]
            seq.num_computed += 1
            outputs.append(self._take_token(seq, sampled[step.request_id]))
        self._calm += 1
        if self._calm >= RECOVERY_ITERATIONS:  # rule 7: the caps grow back
            self._cap_tokens = min(self.max_num_batched_tokens, 2 * self._cap_tokens)
            self._cap_requests = min(self.max_num_seqs, 2 * self._cap_requests)
        return outputs

    def recover(self, plan: IterationPlan) -> list[str]:
        """The plan in flight failed (nothing of it was computed): preempt its requests for
        recompute and cap the next iterations, or fail a request that cannot run even alone
        (rule 7). The failed requests are forgotten, their blocks freed.

        Returns:
            The ids of the requests that failed (the caller tells their clients).

        Raises:
            ValueError: ``plan`` is not the plan in flight.
        """
        if plan is not self._in_flight:
            raise ValueError(f"plan {plan.serial} is not the plan in flight")
        self._in_flight = None
        ids = list(dict.fromkeys([c.request_id for c in plan.prefill]
                                 + [d.request_id for d in plan.decode]))
        live = [rid for rid in ids if rid in self._running]
        self._recovered += 1
        self._calm = 0
        smallest = bool(plan.decode) or plan.num_tokens <= self.cache.block_size
        if len(ids) == 1 and smallest:
            for rid in live:
                del self._running[rid]
                del self._requests[rid]
                self.cache.free(rid)
                self._failed_requests += 1
            return live
        self._cap_tokens = max(self.cache.block_size, plan.num_tokens // 2)
        self._cap_requests = max(1, len(ids) // 2)
        for rid in reversed(live):  # each goes to the front: the plan's order is kept
            self._preempt(self._running[rid], counted=False)
            self._failure_preemptions += 1
        return []

    # -- internals -------------------------------------------------------------------------

    def _chunk(
        self, seq: _Sequence, start: int, budget: int, onboard: tuple[BlockCopy, ...]
    ) -> PrefillChunk:
        tokens = seq.prompt.token_ids
        n = min(len(tokens) - start, budget)
        assert n > 0, f"empty chunk for {seq.request.request_id!r}: prefill is not pending"
        return PrefillChunk(
            request_id=seq.request.request_id,
            block_ids=self.cache.block_ids(seq.request.request_id),
            start=start,
            num_new_tokens=n,
            token_ids=tokens[start : start + n],
            onboard=onboard,
            samples=start + n == len(tokens),
            output_index=len(seq.outputs),
            prompt=seq.request.prompt,
        )

    def _may_admit_early(self, seq: _Sequence, prefilling: list[_Sequence]) -> bool:
        """Whether the longer prefills leave budget to admit ``seq`` (the paragraph under
        rule 6): its prompt is short, or its blocks fit the empty ones (admitted, it evicts no
        cached prefix); and it does not continue a running prefill's prompt past what that computed
        (admitted now, it would recompute what that prefill is about to cache)."""
        tokens = seq.prompt.token_ids
        blocks = _cdiv(len(tokens), self.cache.block_size)
        pool = self.cache.pool
        if blocks > pool.num_free_blocks or (len(tokens) > self.short_prefill
                                             and blocks > pool.num_empty_blocks):
            return False  # it could not be admitted, or would evict cached prefixes
        for other in prefilling:
            n = other.num_computed + 1
            if len(tokens) >= n and tokens[:n] == other.prompt.token_ids[:n]:
                return False
        return True

    def _preempt(self, seq: _Sequence, *, counted: bool = True) -> None:
        rid = seq.request.request_id
        del self._running[rid]
        self.cache.free(rid)
        original = seq.request.prompt
        seq.prompt = Prompt(
            original.token_ids + tuple(seq.outputs), original.images, original.scope
        )
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self._preemptions += counted

    def _take_token(self, seq: _Sequence, token: int) -> Output:
        request = seq.request
        seq.outputs.append(token)
        reason = None
        if token == request.eos_token_id and not request.ignore_eos:
            reason = FINISH_STOP
        elif len(seq.outputs) == request.max_tokens:
            reason = FINISH_LENGTH
        if reason is not None:
            rid = request.request_id
            self.cache.commit_computed(rid, seq.num_computed)
            self.cache.free(rid)
            del self._running[rid]
            del self._requests[rid]
            self._finished += 1
        return Output(request.request_id, token, len(seq.outputs) - 1, reason is not None, reason)

    def _get(self, request_id: str) -> _Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request {request_id!r}")
        return seq
