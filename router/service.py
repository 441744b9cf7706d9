"""The router's state and its one question: for this request, which worker?

:class:`RouterService` owns the index, the load books, the predicted residency and the
registry, and answers :meth:`RouterService.decide` (tokenize, hash, match, score). Sending is
the app's business (:mod:`router.app` with :mod:`router.proxy`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from indexer.events import Cleared, Event
from indexer.index import PrefixIndex
from indexer.openai_api import ApiError
from indexer.prompts import PromptTokens, build_prompt
from indexer.tokenizer import Tokenizer, load_tokenizer
from router.load import LoadTracker
from router.pressure import (
    AUTO_QUEUE_CAP_BLOCKS,
    ROUTER_PRESSURE_RULE,
    EvictionPressure,
    queue_terms_for,
    queue_weight_for,
)
from router.prompt_path import HashingTerms, request_hashes
from router.registry import Registry, WorkerEntry
from router.residency import PredictedResidency
from router.scheduler import Candidate, Decision, choose
from router.sessions import Continuation, SessionTracker
from router.settings import RouterSettings

__all__ = ["Route", "RouterService"]


@dataclass(slots=True)
class Route:
    """A decided request: what it is, where it goes, and what the router expects there."""

    request_id: str
    prompt: PromptTokens
    hashes: list[int]
    decision: Decision
    entries: dict[int, WorkerEntry]
    decided_at: float
    decision_seconds: float
    #: The session this request continues (consumed when it is first dispatched).
    continued: Continuation | None = None

    @property
    def worker(self) -> WorkerEntry:
        """The chosen worker."""
        return self.entries[self.decision.worker]

    def fallbacks(self) -> list[WorkerEntry]:
        """The other candidates, next-best first."""
        return [self.entries[c.worker] for c in self.decision.costs
                if c.worker != self.decision.worker]


class RouterService:
    """Everything the router knows, and the routing decision.

    Args:
        settings: frozen settings.
        http: the client for control calls to workers.
    """

    def __init__(self, settings: RouterSettings, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.tokenizer: Tokenizer = load_tokenizer(settings.tokenizer)
        self.index = PrefixIndex(settings.block_size)
        self.load = LoadTracker()
        self.predicted = PredictedResidency(settings.predict_ttl)
        self.approximate = PredictedResidency(settings.approximate_ttl, max_blocks=1 << 22)
        # The queue weight: fixed when set, else by eviction pressure (router.pressure).
        self.pressure = EvictionPressure(settings.pressure_window)
        self.pressure_rule = ROUTER_PRESSURE_RULE
        fixed, cap = settings.queue_weight, settings.queue_cap_blocks
        if cap is None:  # the rule's cap under auto; none with a fixed weight
            cap = AUTO_QUEUE_CAP_BLOCKS if fixed is None else math.inf
        self.scheduler = settings.scheduler_config(
            queue_weight=queue_weight_for(0.0, self.pressure_rule, warming=True)
            if fixed is None else fixed,
            queue_cap_blocks=cap)
        self.rng = random.Random(settings.seed)
        self.sessions = SessionTracker() if settings.sessions else None
        self.registry = Registry(settings, self.index, self.load, self.tokenizer.identity,
                                 self.forget, http, on_events=self._observe)
        self.counters: dict[str, float] = {}
        # Request ids: unique per process without a syscall per request (uuid4 reads urandom).
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._id_prefix = os.urandom(4).hex()

    def forget(self, worker: int) -> None:
        """Drop every prediction about ``worker`` (its entries were cleared). A worker still
        registered (restarted, or unhealthy) keeps its peak as the pressure's capacity; a
        removed one leaves the pressure entirely."""
        self.predicted.forget(worker)
        self.approximate.forget(worker)
        if self.sessions is not None:
            self.sessions.forget(worker)
        if self.registry.get(worker) is None:
            self.pressure.forget(worker)
        else:
            self.pressure.observe(worker, [Cleared()], time.monotonic())

    def _observe(self, worker: int, events: list[Event]) -> None:
        self.pressure.observe(worker, events, time.monotonic())

    def queue_weight(self, now: float) -> float:
        """The queue weight a decision at ``now`` uses (fixed, or by eviction pressure)."""
        return self.queue_terms(now)[0]

    def queue_terms(self, now: float) -> tuple[float, bool]:
        """The queue weight a decision at ``now`` uses, and whether its discount stops at the
        request's cached blocks (under ``auto``, while the caches warm up; the scheduler's
        ``queue_discount_cached_only``)."""
        if self.settings.queue_weight is not None:
            return self.settings.queue_weight, False
        rule, warming = self.pressure_rule, False
        if rule.warmup_weight is not None:
            capacity = sum(e.info.num_blocks for e in self.registry.entries() if e.info)
            warming = self.pressure.warming(capacity, rule.warmup_fill)
        return queue_terms_for(self.pressure.pressure(now), rule, warming=warming)

    def models(self) -> list[str]:
        """Models served by healthy workers."""
        names = set()
        for e in self.registry.candidates():
            if e.info:
                names.update((e.info.model, *e.info.lora_adapters))
        return sorted(names)

    def tokenize(self, body: Any, kind: str) -> PromptTokens:
        """Turn a request body into its prompt tokens, as the workers will. Reads only the
        tokenizer and settings, so it may run in a worker thread for a large body.

        Raises:
            ApiError: the body is invalid (400).
        """
        try:
            return build_prompt(body, kind, self.tokenizer,  # type: ignore[arg-type]
                                mm_tokens_per_image=self.registry.mm_tokens_per_image or 1,
                                max_image_bytes=self.settings.max_image_bytes, fetch=None,
                                check_token_ids=False)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def decide(self, body: Any, kind: str, prompt: PromptTokens | None = None) -> Route:
        """Tokenize (unless ``prompt`` is given, from :meth:`tokenize`), hash, match and score
        one request body.

        Raises:
            ApiError: the body is invalid (400), names an unknown model (404), or no worker
                can take it (503).
        """
        started = time.perf_counter()
        entries = self.registry.candidates()
        if not entries:
            raise ApiError(503, "no worker is available", "service_unavailable")
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None:
            entries = [e for e in entries if e.info and e.info.serves(model)]
            if not entries:
                raise ApiError(404, f"the model {model!r} does not exist", "invalid_request_error",
                               "model", "model_not_found")
        if prompt is None:
            prompt = self.tokenize(body, kind)
        # Only workers the prompt fits are candidates; 400 when it fits none.
        size = len(prompt.token_ids)
        fits = [e for e in entries if not (e.info and e.info.max_model_len)
                or size <= e.info.max_model_len]
        if not fits:
            longest = max(e.info.max_model_len for e in entries if e.info)
            raise ApiError(400, f"the prompt has {size} tokens, more than the model's "
                           f"{longest}", param="prompt", code="context_length_exceeded")
        entries = fits
        first = entries[0].info
        assert first is not None, "a candidate always has model info"
        terms = HashingTerms(self.settings.block_size, by_uuid=first.image_routing_version == 1,
                             salt_hashing=first.salt_hashing, salt_key=self.settings.salt_key)
        lora = model if model is not None and model != first.model else None
        try:
            hashes = request_hashes(prompt, terms, lora)
        except ValueError as exc:  # token ids that are not ints in [0, 2**64)
            raise ApiError(400, f"the prompt's token ids are invalid: {exc}", param="prompt"
                           ) from None
        now = time.monotonic()
        weight, cached_only = self.queue_terms(now)
        if (weight, cached_only) != (self.scheduler.queue_weight,
                                     self.scheduler.queue_discount_cached_only):
            self.scheduler = dataclasses.replace(self.scheduler, queue_weight=weight,
                                                 queue_discount_cached_only=cached_only)
        sessions = self.sessions
        continued = home = None
        rate = 0.0
        if sessions is not None:
            continued = sessions.continuation(hashes, now, len(prompt.token_ids))
            rate = sessions.continue_rate
            if continued is not None and self.settings.session_queue_blocks is not None:
                home = continued.worker
        decision = choose(len(hashes), self._candidates(entries, hashes, now), self.scheduler,
                          self.rng, home=home, continue_rate=rate)
        if self.settings.policy != "kv":
            decision = self._baseline(decision, entries)
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        return Route(request_id, prompt, hashes, decision, {e.id: e for e in entries}, now,
                     time.perf_counter() - started, continued)

    def _baseline(self, decision: Decision, entries: list[WorkerEntry]) -> Decision:
        # Cache-blind baselines: the costs stay (for /debug/route and fallbacks), the choice
        # ignores them.
        if self.settings.policy == "round_robin":
            worker = entries[next(self._turns) % len(entries)].id
        else:
            worker = self.rng.choice(entries).id
        return Decision(worker, decision.costs, decision.overlap_weight)

    def _candidates(self, entries: list[WorkerEntry], hashes: list[int], now: float
                    ) -> list[Candidate]:
        matches = self.index.match(hashes) if hashes else {}
        admission = self.scheduler.admission_weight > 0
        sessions = self.sessions
        out = []
        for e in entries:
            matched, device = matches.get(e.id, (0, 0))
            residency = self.approximate if e.approximate else self.predicted
            extended = residency.extend(e.id, hashes, matched, now)
            device += extended - matched
            load = self.load.load(e.id)
            live = sessions.live(e.id) if sessions is not None else 0
            if not admission:
                out.append(Candidate(e.id, extended, device, load.pending_prefill_blocks,
                                     load.decode_blocks, load.active_requests, sessions=live))
                continue
            # The admission term's slot half (router.scheduler): blocks in flight per request
            # from the books, the engine's sequence limit from /model_info. Its KV half stays
            # off (capacity 0): the books sum prompts, so shared prefixes count once per
            # request and the term would fire on KV that is not held.
            limit = e.info.max_num_seqs if e.info else 0
            held = (load.decode_blocks + self.load.waiting_blocks(e.id)
                    if 0 < limit <= load.active_requests else 0.0)  # read only when full
            out.append(Candidate(e.id, extended, device, load.pending_prefill_blocks,
                                 load.decode_blocks, load.active_requests, held, 0.0, 0.0,
                                 limit, live))
        return out

    def dispatched(self, route: Route, worker: WorkerEntry) -> None:
        """Book a request as sent to ``worker``: load, predicted residency, and its session
        (now living on ``worker``; a fallback moves it again, without counting it twice)."""
        cost = next(c for c in route.decision.costs if c.worker == worker.id)
        blocks = len(route.hashes)
        self.load.routed(route.request_id, worker.id, blocks - cost.credited_blocks,
                         max(blocks, 1))
        residency = self.approximate if worker.approximate else self.predicted
        now = time.monotonic()
        residency.expire(now)  # amortised: only the expired front is looked at
        residency.predict(worker.id, route.hashes, now)
        if self.sessions is not None:
            self.sessions.routed(route.hashes, worker.id, now, route.continued,
                                 len(route.prompt.token_ids))
            route.continued = None

    def undispatched(self, route: Route, worker: WorkerEntry | None = None) -> None:
        """The send failed before the worker took the request: release its load and, given
        the ``worker``, the blocks predicted there for it."""
        self.load.finished(route.request_id)
        if worker is not None:
            self.refused(route, worker)

    def refused(self, route: Route, worker: WorkerEntry) -> None:
        """``worker`` refused the request: withdraw the blocks predicted there for it."""
        residency = self.approximate if worker.approximate else self.predicted
        residency.withdraw(worker.id, route.hashes)
