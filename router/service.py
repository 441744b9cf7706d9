"""The router's state and its one question: for this request, which worker?

:class:`RouterService` owns the index, the registry and the routing core
(:class:`router.routing.core.RoutingCore`: load books, predicted residency, sessions, eviction
pressure), and answers :meth:`RouterService.decide`: parse, tokenize and hash the request,
match it in the index, and ask the core. Sending is the app's business (:mod:`router.http.app`
with :mod:`router.http.proxy`).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from httpapi.body import TOKENIZE_OFF_LOOP_BYTES
from indexer.events import Event
from indexer.index import PrefixIndex
from openai_request import tokenize_api
from openai_request.bodies import ApiError
from openai_request.prompts import PromptTokens, PromptWalk, build_prompt, walk_prompt
from openai_request.segment_cache import SegmentedTokenizer
from openai_request.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from router.fleet.entry import Target, WorkerEntry
from router.fleet.facts import FleetFacts
from router.fleet.registry import Registry
from router.fleet.unavailable import unavailable_reason
from router.fleet.worker_table import WorkerInfo
from router.routing.core import Prediction, RoutingCore
from router.routing.disaggregation import choose_prefill, decode_terms
from router.routing.dispatch_gate import CapacityListener, Deaf, QueueStay
from router.routing.fetch_links import FETCH_STATE_FAILURES, FetchAbility, fetch_failure_reason
from router.routing.load import ReportedLoad
from router.routing.policy import Policy
from router.routing.prompt_path import HashingTerms, PrefixReach, request_hashes
from router.routing.scheduler import Decision
from router.routing.sessions import Continuation
from router.settings import RouterSettings

__all__ = ["FETCH_HEADERS", "Route", "RouteRequest", "RouterService", "parse_fetch_result"]

log = logging.getLogger(__name__)

#: The fetch instruction's request headers and the result's answer header
#: (docs/peer_fetch.md); a client's own are never forwarded.
FETCH_SOURCE = "x-kvroute-fetch-source"
FETCH_BLOCKS = "x-kvroute-fetch-blocks"
TRANSFER_TOKEN = "x-kvroute-transfer-token"
FETCH_RESULT = "x-kvroute-fetch-result"
FETCH_HEADERS = (FETCH_SOURCE, FETCH_BLOCKS, TRANSFER_TOKEN)


def parse_fetch_result(value: str) -> tuple[int, float, float] | None:
    """A worker's ``x-kvroute-fetch-result``: ``(blocks, bytes, seconds)`` of a fetch that
    inserted blocks, or None for a failure (``failed;reason=...``).

    Raises:
        ValueError: neither form, or a figure that is not a finite number >= 0.
    """
    parts = [p.strip() for p in value.split(";")]
    if parts and parts[0] == "failed":
        return None
    fields: dict[str, str] = {}
    for part in parts:
        name, sep, number = part.partition("=")
        if not sep:
            raise ValueError(f"{FETCH_RESULT}: {part!r} is not NAME=VALUE")
        fields[name.strip()] = number.strip()
    try:
        blocks, nbytes, seconds = (int(fields["blocks"]), float(fields["bytes"]),
                                   float(fields["seconds"]))
    except (KeyError, ValueError):
        raise ValueError(f"{FETCH_RESULT}: {value[:80]!r} is neither "
                         "blocks=N;bytes=B;seconds=S nor failed;reason=R") from None
    if blocks < 0 or not (0 <= nbytes < float("inf")) or not (0 <= seconds < float("inf")):
        raise ValueError(f"{FETCH_RESULT}: {value[:80]!r} has a figure out of range")
    return blocks, nbytes, seconds

PromptKind = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a decision was asked: the body, the endpoint's kind (``completions`` or
    ``chat``), and whether a peer fetch may be chosen. A route carries it, so the request can
    be decided again (:meth:`RouterService.decide_again`) from the route alone."""

    body: Any
    kind: str
    fetch: bool = True


@dataclass(slots=True)
class Route:
    """A decided request: what it is, where it goes, and what the router expects there."""

    request_id: str
    prompt: PromptTokens
    hashes: list[int]
    decision: Decision
    entries: dict[int, Target]
    decided_at: float
    decision_seconds: float
    #: The session this request continues (consumed when it is first dispatched).
    continued: Continuation | None = None
    #: Disaggregated serving: the prefill worker chosen to compute the prompt's KV for the
    #: decode worker (``worker``), and its decision; None: the decode worker prefills.
    prefill: Target | None = None
    prefill_decision: Decision | None = None
    #: The predicted time to first token through ``prefill`` (its queue and prefill, the
    #: transfer, the decode worker's wait; :func:`router.routing.disaggregation.
    #: remote_prefill_ttft`), in seconds; None without a remote prefill.
    remote_ttft_s: float | None = None
    #: The decision's ``cost`` is a predicted time to first token in seconds (the rule in
    #: seconds, ``--policy kv``); the other policies' costs are not times.
    predicts_ttft: bool = False
    #: Its stay in flow control's queue (None: it did not wait).
    queued: QueueStay | None = None
    #: What was decided (None only for a route made by hand, as tests make them).
    request: RouteRequest | None = None

    @property
    def worker(self) -> Target:
        """The chosen worker."""
        return self.entries[self.decision.worker]

    def fetch_from(self, worker: Target) -> tuple[Target, int] | None:
        """The source and blocks ``worker`` is told to fetch (None: it recomputes what it
        lacks): the decision's fetch on the worker's terms, without a remote prefill."""
        if self.prefill is not None or worker.id not in self.entries:
            return None
        terms = self.decision.terms(worker.id)
        source = self.entries.get(terms.fetch_source) if terms.fetch_source is not None \
            else None
        if source is None or source is worker:
            return None
        return source, terms.fetch_blocks

    @property
    def predicted_ttft_s(self) -> float:
        """The predicted time to first token on the chosen worker: through the remote
        prefill while there is one, else the decision's cost."""
        if self.prefill is not None and self.remote_ttft_s is not None:
            return self.remote_ttft_s
        return self.decision.chosen.cost

    def fallbacks(self) -> list[Target]:
        """The other candidates, next-best first."""
        return [self.entries[c.worker] for c in self.decision.costs
                if c.worker != self.decision.worker]

    def ranked(self) -> Iterator[Target]:
        """The chosen worker, then :meth:`fallbacks`, which are priced only when asked for
        (pricing every candidate walks the prompt's blocks on each: a request its first worker
        takes never pays for it)."""
        yield self.worker
        yield from self.fallbacks()


def _hashing_terms(entry: Target, settings: RouterSettings) -> HashingTerms:
    """How ``entry`` names blocks, as the router hashes a prompt for it."""
    info = entry.info
    assert info is not None, "a candidate always has model info"
    return HashingTerms(settings.block_size, by_uuid=info.image_routing_version == 1,
                        salt_hashing=info.salt_hashing, salt_key=settings.salt_key)


class _Fleet:
    """The candidates for one model, and what a decision reads of them."""

    __slots__ = ("bound", "by_id", "entries", "ids", "max_model_len", "min_model_len",
                 "only_model", "prefill", "terms")

    def __init__(self, entries: list[Target], settings: RouterSettings) -> None:
        names = {n for e in entries if e.info for n in (e.info.model, *e.info.lora_adapters)}
        #: The one model name every candidate serves (no adapter besides), or ``None``.
        self.only_model = (next(iter(names)) if len(names) == 1 and all(e.info for e in entries)
                           else None)
        # Disaggregated serving: prefill workers only prefill for the others; a fleet of
        # prefill workers alone serves whole requests on them.
        prefill = [e for e in entries if e.role == "prefill"]
        serving = [e for e in entries if e.role != "prefill"]
        #: The prefill workers, when some worker can decode what they prefill.
        self.prefill = prefill if serving else []
        entries = serving or prefill
        self.entries = entries
        self.ids = [e.id for e in entries]
        self.by_id = {e.id: e for e in entries}
        #: How the first candidate names blocks (a request's hashes follow it).
        self.terms = _hashing_terms(entries[0], settings)
        # A prompt no longer than the shortest limit fits every worker (0: none is known);
        # a longer one goes to the workers it fits, up to the longest.
        limits = [e.info.max_model_len for e in entries if e.info and e.info.max_model_len]
        self.min_model_len = min(limits, default=0)
        self.max_model_len = max(limits, default=0)
        #: The longest prompt any candidate takes; 0 when one has no known limit.
        self.bound = self.max_model_len if len(limits) == len(entries) else 0


class _CoreFacts(FleetFacts):
    """The fleet's facts, stamped with the clock and passed down to the routing core (and
    a change of model info to the service's cache of candidates)."""

    def __init__(self, core: RoutingCore, described: Callable[[], None],
                 capacity: Callable[[], CapacityListener], settings: RouterSettings) -> None:
        self._core = core
        self._described = described
        self._capacity = capacity
        self._settings = settings
        self._rule = core.settings.rule
        self._unreachable: set[str] = set()  # worker URLs logged as no fetch peer

    def joined(self, worker: int, engine: str, info: WorkerInfo | None) -> None:
        self._core.worker_joined(worker, engine=engine, approximate=_approximate(info),
                                 capacity_blocks=_capacity(info), fetch=self._fetch(info))

    def described(self, worker: int, info: WorkerInfo) -> None:
        self._described()
        self._core.worker_described(worker, approximate=_approximate(info),
                                    capacity_blocks=_capacity(info), fetch=self._fetch(info))

    def _fetch(self, info: WorkerInfo | None) -> FetchAbility | None:
        """What the router may use of a worker's peer fetch: what it advertises, unless
        fetch is off, it serves data-parallel ranks behind one URL, or it is off loopback
        with no shared secret (logged once per worker)."""
        settings = self._settings
        if (info is None or settings.kv_fetch == "off" or not self._rule.prices_fetch
                or not (info.kv_fetch_serve or info.kv_fetch_receive)
                or info.data_parallel_size > 1):
            return None
        if not settings.fetch_reachable(info.url):
            if info.url not in self._unreachable:
                self._unreachable.add(info.url)
                log.info("peer fetch: not priced to or from %s: it is off loopback and the "
                         "router has no --kv-transfer-secret-file", info.url)
            return None
        return FetchAbility(info.kv_fetch_serve, info.kv_fetch_receive,
                            info.kv_bytes_per_token, info.kv_fetch_device,
                            info.kv_fetch_http_bandwidth)

    def left(self, worker: int) -> None:
        self._described()
        self._core.worker_left(worker)
        self._capacity().forget(worker)

    def cleared(self, worker: int) -> None:
        self._described()  # a restart may bring other model info
        self._core.cache_cleared(worker, time.monotonic())
        self._capacity().forget(worker)

    def reported(self, worker: int, load: ReportedLoad) -> None:
        self._core.load_reported(worker, load)
        self._capacity().reported(worker, load.running, load.waiting)

    def events_applied(self, worker: int, events: list[Event]) -> None:
        self._core.events_applied(worker, events, time.monotonic())
        self._capacity().wake()


def _approximate(info: WorkerInfo | None) -> bool:
    """A worker that publishes no events (as :attr:`Target.approximate` says)."""
    return info is not None and info.events_endpoint is None


def _capacity(info: WorkerInfo | None) -> float:
    return float(info.num_blocks) if info is not None else 0.0


class RouterService:
    """Everything the router knows, and the routing decision.

    Args:
        settings: frozen settings.
        http: the client for control calls to workers.
    """

    def __init__(self, settings: RouterSettings, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.tokenizer: Tokenizer = load_tokenizer(settings.tokenizer)
        if settings.tokenize == "match" and isinstance(self.tokenizer, HFTokenizer):
            self.tokenizer = SegmentedTokenizer(self.tokenizer)
            self.tokenizer.log_mode()
        self.index = PrefixIndex(settings.block_size)
        #: The routing core; the fleet's facts flow into it (:class:`_CoreFacts`), requests'
        #: facts through the verbs below.
        self.core = RoutingCore(settings.core_settings())
        #: The routing policy, chosen once from ``--policy``.
        self.policy: Policy = self.core.settings.rule
        self._prefill_link = settings.prefill_link()
        self.rng = random.Random(settings.seed)
        #: Told of what frees capacity (flow control sets itself here).
        self.capacity: CapacityListener = Deaf()
        self.registry = Registry(settings.fleet_settings(), self.index,
                                 _CoreFacts(self.core, self._candidates_changed,
                                            lambda: self.capacity, settings),
                                 self.tokenizer.identity, http)
        self.counters: dict[str, float] = {}
        # Request ids: unique per process without a syscall per request (uuid4 reads urandom).
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._fleet_key: list[Target] | None = None
        self._fleets: dict[str | None, _Fleet] = {}
        if settings.kv_fetch == "off":
            log.info("peer fetch: off (--kv-fetch off)")
        elif not self.policy.prices_fetch:
            log.info("peer fetch: off: it is priced by the kv policy only, not %s",
                     settings.policy)
        elif settings.kv_transfer_secret is None:
            log.info("peer fetch: no --kv-transfer-secret-file, so a fetch is priced only "
                     "between workers on loopback that advertise it")


    def _candidates_changed(self) -> None:
        """A worker's model info may have changed: work out the fleets again."""
        self._fleet_key = None

    # -- the fleet and the tokenizer, as the HTTP and EPP shells read them ------------------

    async def start(self) -> None:
        """Start following the fleet (the registry's polls, discovery, event streams)."""
        await self.registry.start()

    async def stop(self) -> None:
        """Stop following the fleet."""
        await self.registry.stop()

    def workers(self) -> list[WorkerEntry]:
        """Every registered worker, healthy or not."""
        return self.registry.entries()

    def healthy(self) -> list[WorkerEntry]:
        """The healthy workers."""
        return self.registry.healthy()

    def candidates(self) -> list[Target]:
        """What a request may be routed to: each healthy worker, or each of its
        data-parallel ranks."""
        return self.registry.candidates()

    def unavailable(self) -> str:
        """Why no worker is available, in a few words (:mod:`router.fleet.unavailable`)."""
        return unavailable_reason(self.registry.entries())

    @property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of text one token of the router's tokenizer covers (None:
        not known)."""
        return self.tokenizer.max_bytes_per_token

    def shortest_model_len(self) -> int:
        """The shortest model length among the registered workers that state one (0: none
        does)."""
        lengths = [e.info.max_model_len for e in self.registry.entries() if e.info]
        return min((n for n in lengths if n), default=0)

    def tokenize_answer(self, body: Any, max_model_len: int) -> dict[str, Any]:
        """The answer to vLLM's ``POST /tokenize`` with the router's tokenizer (the ids it
        routes on); safe off the event loop.

        Raises:
            ValueError: a body that is not a ``/tokenize`` request.
        """
        return tokenize_api.tokenize(body, self.tokenizer, max_model_len)

    def models(self) -> list[str]:
        """Models served by healthy workers."""
        names: set[str] = set()
        for e in self.registry.candidates():
            if e.info:
                names.update((e.info.model, *e.info.lora_adapters))
        return sorted(names)

    def tokenize(self, body: Any, kind: str) -> PromptTokens:
        """Turn a request body into its prompt tokens, as the workers will. It reads only the
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

    def _walked(self, body: Any, kind: str, reach: PrefixReach) -> PromptTokens:
        """:meth:`tokenize`, a text prompt only as far as some worker holds it: its walk goes
        a step further while every full block hashed so far is held (:meth:`_held`).

        Raises:
            ApiError: the body is invalid (400).
        """
        try:
            walk = walk_prompt(body, kind, self.tokenizer,  # type: ignore[arg-type]
                               mm_tokens_per_image=self.registry.mm_tokens_per_image or 1,
                               max_image_bytes=self.settings.max_image_bytes, fetch=None,
                               check_token_ids=False)
            if not isinstance(walk, PromptWalk):
                return walk
            while walk.advance():
                hashes = reach.extend(walk.ids, walk.cache_salt)
                if hashes and self._held(hashes) < len(hashes):
                    break
            return walk.prompt()
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def tokenizes_off_loop(self, body_bytes: int) -> bool:
        """Whether a body of ``body_bytes`` should be tokenized in a thread (:meth:`tokenize`)
        before :meth:`decide`: only a large one, and never under ``--tokenize match``, whose
        walk needs the index (on the event loop) and bounds its own work there."""
        if isinstance(self.tokenizer, SegmentedTokenizer) and self.settings.tokenize == "match":
            return False
        return body_bytes > TOKENIZE_OFF_LOOP_BYTES

    @property
    def decides_early(self) -> bool:
        """Whether a body may be decided before its end (:meth:`settles`): only under
        ``--tokenize match``, which stops tokenizing where the match ends."""
        return self.settings.tokenize == "match" and isinstance(self.tokenizer,
                                                                 SegmentedTokenizer)

    def only_model(self) -> str | None:
        """The one model name the candidates serve, when they serve one and no adapter (else,
        or with no candidate, ``None``): a body that has not named its model yet may be
        decided early as if it named this one (:mod:`openai_request.early_body`)."""
        try:
            return self._fleet(self.registry.candidates(), None).only_model
        except ApiError:
            return None

    def settles(self, partial: Any, kind: str) -> bool:
        """Whether ``partial``, a body as far as it has arrived (its prompt cut where the
        bytes end), already settles the match: tokenized as :meth:`decide` tokenizes it, its
        prompt was walked only part way (``estimated_tokens``), so no later byte can lengthen
        the match. Nothing is decided or counted. A body the router refuses as it stands is
        not settled (its end may mend it; the buffered path answers it)."""
        model = partial.get("model") if isinstance(partial, dict) else None
        try:
            prompt, _ = self._tokenized(partial, kind, self._fleet(self.registry.candidates(),
                                                                   model), model)
        except ApiError:
            return False
        return bool(prompt.estimated_tokens)

    def decide(self, body: Any, kind: str, prompt: PromptTokens | None = None, *,
               fetch: bool = True) -> Route:
        """Tokenize (unless ``prompt`` is given, from :meth:`tokenize`), hash, match and score
        one request body (``kind``: ``completions`` or ``chat``, the endpoint it came to);
        ``fetch``: a peer fetch may be chosen (off for a caller that cannot send the
        instruction, as the endpoint picker, whose gateway forwards).

        Raises:
            ApiError: the body is invalid (400), names an unknown model (404), or no worker
                can take it (503).
        """
        started = time.perf_counter()
        if kind not in ("completions", "chat"):
            raise ValueError(f"kind must be 'completions' or 'chat', not {kind!r}")
        model = body.get("model") if isinstance(body, dict) else None
        fleet = self._fleet(self.registry.candidates(), model)
        entries, ids, by_id = fleet.entries, fleet.ids, fleet.by_id
        reach: PrefixReach | None = None
        if prompt is None:
            prompt, reach = self._tokenized(body, kind, fleet, model)
        # Only workers the prompt fits are candidates; 400 when it fits none (told by the
        # exact count: an estimate past the limit was tokenized in full).
        size = prompt.total_tokens
        if fleet.min_model_len and size > fleet.min_model_len:
            entries = [e for e in entries if not (e.info and e.info.max_model_len)
                       or size <= e.info.max_model_len]
            if not entries:
                raise ApiError(400, f"the prompt has {size} tokens, more than the model's "
                               f"{fleet.max_model_len}", param="prompt",
                               code="context_length_exceeded")
            ids, by_id = [e.id for e in entries], {e.id: e for e in entries}
        first = entries[0]
        terms = fleet.terms if first is fleet.entries[0] else _hashing_terms(first, self.settings)
        assert first.info is not None, "a candidate always has model info"
        lora = model if model is not None and model != first.info.model else None
        try:
            if reach is not None and reach.walked and terms is fleet.terms and not prompt.images:
                hashes = reach.finish(prompt)  # hashed as the prompt was tokenized
            else:
                hashes = request_hashes(prompt, terms, lora)
        except ValueError as exc:  # token ids that are not ints in [0, 2**64)
            raise ApiError(400, f"the prompt's token ids are invalid: {exc}", param="prompt"
                           ) from None
        now = time.monotonic()
        matches = self.index.match(hashes) if hashes else {}
        workers = None if len(entries) == self.core.workers() else ids
        routed = self.core.decide(hashes, matches, now, self.rng, workers=workers,
                                  tokens=size, fetch=fetch and not fleet.prefill)
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        route = Route(request_id, prompt, hashes, routed.decision, by_id, now,
                      time.perf_counter() - started, routed.continued,
                      predicts_ttft=self.policy.predicts_ttft,
                      request=RouteRequest(body, kind, fetch))
        if fleet.prefill:
            self._choose_prefill(route, fleet, matches, now)
        return route

    def decide_again(self, route: Route) -> Route:
        """``route``'s request decided again now, on its prompt as tokenized the first time
        (flow control's late binding: the index and loads of the moment it leaves).

        Raises:
            ApiError: as :meth:`decide` (503: no worker can take it now).
        """
        request = route.request
        assert request is not None, "a route the service decided carries its request"
        return self.decide(request.body, request.kind, route.prompt, fetch=request.fetch)

    def _tokenized(self, body: Any, kind: str, fleet: _Fleet, model: str | None
                   ) -> tuple[PromptTokens, PrefixReach | None]:
        """The prompt of ``body`` and the reach it was tokenized with: under ``--tokenize
        match`` only as far as the index's longest match, in full (no reach) when the estimate
        passes the fleet's shortest model length, so that a refusal is told by the exact
        count."""
        reach = self._reach(fleet, model)
        prompt = self.tokenize(body, kind) if reach is None else self._walked(body, kind, reach)
        if (fleet.min_model_len and prompt.total_tokens > fleet.min_model_len
                and prompt.estimated_tokens):
            return self.tokenize(body, kind), None
        return prompt, reach

    def _choose_prefill(self, route: Route, fleet: _Fleet, matches: Any, now: float) -> None:
        """Disaggregated serving: the prefill worker by prefix hit against prefill load, unless
        the decode worker holds so much of the prompt that it prefills the rest itself
        (``pd_local_prefill_tokens``; :func:`router.routing.disaggregation.choose_prefill`)."""
        remote = choose_prefill(self.core, route.hashes, matches, now, self.rng,
                                route.decision.chosen, len(route.prompt.token_ids),
                                [e.id for e in fleet.prefill], self._prefill_link)
        if remote is None:
            self.counters["pd_local_prefills"] = self.counters.get("pd_local_prefills", 0) + 1
            return
        route.prefill_decision = remote.decision
        route.prefill = next(e for e in fleet.prefill if e.id == remote.decision.worker)
        route.remote_ttft_s = remote.ttft_s

    def prefill_dispatched(self, route: Route) -> str:
        """Book ``route``'s remote prefill on its prefill worker: its prefill as queued work
        there, the prompt as resident there; returns the booking's request id (end it with
        :meth:`RoutingCore.finished`). The decode worker's booking follows and keeps the
        session."""
        assert route.prefill is not None and route.prefill_decision is not None, \
            "a remote prefill needs its prefill worker"
        booking = f"{route.request_id}/prefill"
        terms = route.prefill_decision.terms(route.prefill.id)
        self.core.routed(booking, route.prefill.id, route.hashes, terms, time.monotonic())
        return booking

    def _reach(self, fleet: _Fleet, model: str | None) -> PrefixReach | None:
        """Under ``--tokenize match``, the reach that hashes a prompt's blocks as its walk
        goes (:meth:`_walked`), in the fleet's first candidate's terms."""
        if self.settings.tokenize != "match" or not isinstance(self.tokenizer, SegmentedTokenizer):
            return None
        first = fleet.entries[0]
        assert first.info is not None, "a candidate always has model info"
        lora = model if model is not None and model != first.info.model else None
        return PrefixReach(fleet.terms, lora)

    def _held(self, hashes: list[int]) -> int:
        """The longest leading run of ``hashes`` some worker holds, by the index or by the
        predictions a decision would extend it with."""
        return self.core.longest_held(hashes, self.index.match(hashes), time.monotonic())

    def prompt_bound(self, body: Any) -> int:
        """The longest prompt, in tokens, that some worker serving the body's model takes (0:
        no bound is known). Cached with the candidates, so cheap per request.

        Raises:
            ApiError: no candidate (503), or none serves the model (404).
        """
        model = body.get("model") if isinstance(body, dict) else None
        return self._fleet(self.registry.candidates(), model).bound

    def _fleet(self, candidates: list[Target], model: str | None) -> _Fleet:
        """The candidates for ``model``, with what a decision reads of them, computed once
        per list of candidates (a fleet of 1,024 workers would otherwise cost a decision
        several hundred µs of filtering). The registry keeps one list object until a worker
        joins, leaves or changes health (:mod:`router.fleet.healthy`), so the list compares by
        identity; a worker's model info changes only across a restart, which :meth:`forget`
        hears of.

        Raises:
            ApiError: no candidate (503), or none serves ``model`` (404).
        """
        if not candidates:
            raise ApiError(503, "no worker is available: "
                           f"{unavailable_reason(self.registry.entries())}",
                           "service_unavailable")
        if candidates is not self._fleet_key:
            self._fleet_key, self._fleets = candidates, {}
        fleet = self._fleets.get(model)
        if fleet is None:
            entries = candidates if model is None else [
                e for e in candidates if e.info and e.info.serves(model)]
            if not entries:
                raise ApiError(404, f"the model {model!r} does not exist",
                               "invalid_request_error", "model", "model_not_found")
            if len(self._fleets) >= 64:  # models asked for that no worker serves, say
                self._fleets.clear()
            fleet = self._fleets[model] = _Fleet(entries, self.settings)
        return fleet

    def dispatched(self, route: Route, worker: Target) -> None:
        """Book a request as sent to ``worker``: load, predicted residency, and its session
        (now living on ``worker``; a fallback moves it again, without counting it twice). A
        prefill worker serving the request whole (the decode workers failed it) is booked at
        its terms in the prefill decision."""
        if worker.id not in route.entries and route.prefill_decision is not None:
            terms = route.prefill_decision.terms(worker.id)
        else:
            terms = route.decision.terms(worker.id)
        predicted = None
        if route.prefill is not None:  # its KV arrives by transfer: nothing to prefill there
            terms = decode_terms(terms)
            if worker is route.worker:
                predicted = route.remote_ttft_s
        self.core.routed(route.request_id, worker.id, route.hashes, terms, time.monotonic(),
                         route.continued, len(route.prompt.token_ids), predicted)
        route.continued = None

    def fetch_headers(self, route: Route, worker: Target) -> dict[str, str]:
        """The fetch instruction for ``worker`` (empty: none), counted as a decision. The
        decode leg of a remote prefill carries the router's token alone, to a worker that
        advertises peer fetch: with the shared secret, a decode worker pulls from (and
        releases) the prefill worker its body names only for a request the router vouches
        for (docs/kv_transfer.md)."""
        fetch = route.fetch_from(worker)
        if fetch is None:
            secret = self.settings.kv_transfer_secret
            if route.prefill is not None and secret is not None \
                    and self.core.fetch_ability(worker.id) is not None:
                return {TRANSFER_TOKEN: secret}
            return {}
        source, blocks = fetch
        self.counters["fetch_decisions"] = self.counters.get("fetch_decisions", 0) + 1
        headers = {FETCH_SOURCE: source.url, FETCH_BLOCKS: str(blocks)}
        if self.settings.kv_transfer_secret is not None:
            headers[TRANSFER_TOKEN] = self.settings.kv_transfer_secret
        return headers

    def fetch_answered(self, route: Route, worker: Target, result: str | None) -> None:
        """``worker`` began its answer to an instructed fetch with ``result`` (its
        ``x-kvroute-fetch-result``, None when absent: it did not fetch, which teaches
        nothing): the pair's link learns, or is backed off."""
        fetch = route.fetch_from(worker)
        if fetch is None:
            return
        if result is None:
            self.core.fetch_answered(route.request_id, None)
            return
        source = fetch[0]
        try:
            parsed = parse_fetch_result(result)
        except ValueError as exc:
            self.counters["fetch_results_malformed"] = (
                self.counters.get("fetch_results_malformed", 0) + 1)
            log.warning("worker %s: %s", worker.url, exc)
            self.core.fetch_answered(route.request_id, None)
            return
        if parsed is None:
            reason = fetch_failure_reason(result)
            self.counters["fetch_failed"] = self.counters.get("fetch_failed", 0) + 1
            key = f"fetch_failed_{reason}"
            self.counters[key] = self.counters.get(key, 0) + 1
            self.core.fetch_answered(route.request_id, None)
            if reason in FETCH_STATE_FAILURES:  # the link is fine: nothing to back off
                log.info("peer fetch from %s to %s failed (%s)", source.url, worker.url,
                         reason)
                return
            backoff = self.core.fetch_failed(source.id, worker.id, time.monotonic())
            log.info("peer fetch from %s to %s failed (%s); not priced for %.0f s",
                     source.url, worker.url, result[:80], backoff)
            return
        blocks, nbytes, seconds = parsed
        self.core.fetch_answered(route.request_id, blocks)
        self.counters["fetch_fetched"] = self.counters.get("fetch_fetched", 0) + 1
        self.counters["fetch_bytes"] = self.counters.get("fetch_bytes", 0) + nbytes
        self.core.fetched(source.id, worker.id, nbytes, seconds)

    def undispatched(self, route: Route, worker: Target | None = None) -> None:
        """The send failed before the worker took the request: release its load and, given
        the ``worker``, the blocks predicted there for it."""
        if self.core.finished(route.request_id) is not None:
            self.capacity.ended(route.request_id)
        if worker is not None:
            self.refused(route, worker)

    def refused(self, route: Route, worker: Target) -> None:
        """``worker`` refused the request: withdraw the blocks predicted there for it."""
        self.core.withdrawn(worker.id, route.hashes)

    def first_token(self, route: Route) -> Prediction | None:
        """The worker began answering ``route``: its prefill is done; returns the predicted
        and the delivered time to it (None: told before)."""
        prediction = self.core.first_token(route.request_id, time.monotonic())
        self.capacity.wake()
        return prediction

    def finished(self, route: Route) -> None:
        """``route`` ended (answered, failed or abandoned): release its load. Idempotent."""
        if self.core.finished(route.request_id) is not None:
            self.capacity.ended(route.request_id)

    def queued_prefill(self, worker: Target) -> float:
        """Blocks of prefill queued on ``worker`` (routed there, no first token yet)."""
        return self.core.pending_prefill(worker.id)

    def in_flight(self, worker: Target) -> int:
        """Requests this router has in flight on ``worker``."""
        return self.core.in_flight(worker.id)
