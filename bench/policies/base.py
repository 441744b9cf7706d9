"""The one interface every routing policy of the benchmark implements.

A policy sees what a router in front of the cluster would see, no more:

- the request (token ids, images; its router-local block hashes on demand);
- the event-fed prefix index, when the policy asks for it (:attr:`Policy.needs_index`): the
  simulation feeds it the workers' real KV events after the configured lag;
- the workers' engine metrics (:meth:`ClusterView.worker_metrics`: running, waiting, KV
  usage), as a metrics scrape would read them; a policy that scrapes periodically models
  its own interval;
- the index's events as they are applied (:meth:`Policy.index_events`), for a policy that
  keeps its own statistics of them, as a router's event subscriber could;
- the lifecycle of what it routed (:meth:`Policy.first_token`, :meth:`Policy.finished`), as a
  router in the response path sees it.

Deciding is separate from sending: :meth:`Policy.route` returns a worker and the caller
(simulation or live driver) sends. Policies do no I/O and read no clock; ``now`` is passed in.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from indexer.events import Event
from indexer.index import GLOBAL_SEED, PrefixIndex, block_hashes
from openai_request.images import ImageSpan
from openai_request.prompts import PromptTokens
from router.routing.prompt_path import HashingTerms, request_hashes

__all__ = ["HELD", "PREFILL_SUFFIX", "SHED", "ClusterView", "Policy", "RouteRequest",
           "WorkerMetrics"]

#: What :meth:`Policy.route` answers for a request it holds (sent later, by
#: :meth:`Policy.dispatch`) or refuses (never served), in place of a worker.
HELD, SHED = -1, -2

#: A request's remote prefill runs on its prefill worker as the request's id and this
#: (:meth:`Policy.prefill_for`).
PREFILL_SUFFIX = "/prefill"


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """What an engine's metrics endpoint says about one worker now.

    Attributes:
        running: requests holding KV blocks.
        waiting: requests queued for admission.
        kv_usage: fraction of device KV blocks held by requests, in [0, 1].
    """

    running: int
    waiting: int
    kv_usage: float


class ClusterView(Protocol):
    """What the driver offers a policy."""

    num_workers: int
    block_size: int
    index: PrefixIndex | None
    rng: random.Random
    #: Each worker's sequence limit (``max_num_seqs``), as its ``/model_info`` reports it.
    max_num_seqs: int
    #: Each worker's device KV blocks, as its ``/model_info`` reports them.
    capacity_blocks: int
    #: Each worker's role: ``prefill``, ``decode`` or ``both`` (:data:`bench.sim.ROLES`).
    roles: tuple[str, ...]
    #: Every worker serves and receives peer fetches (``kv_fetch`` in its ``/model_info``),
    #: with this many bytes of KV a token.
    peer_fetch: bool
    kv_bytes_per_token: int

    def worker_metrics(self, worker: int) -> WorkerMetrics:
        """Return the worker's engine metrics now."""
        ...


class RouteRequest:
    """One request as the router receives it.

    Args:
        request_id: unique id.
        token_ids: the prompt's token ids.
        images: its images (with content digests).
        block_size: the workers' block size, for :attr:`hashes`.
    """

    __slots__ = ("_hashes", "block_size", "images", "request_id", "token_ids")

    def __init__(self, request_id: str, token_ids: Sequence[int],
                 images: Sequence[ImageSpan] = (), block_size: int = 32) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.images = tuple(images)
        self.block_size = block_size
        self._hashes: list[int] | None = None

    @property
    def hashes(self) -> list[int]:
        """Router-local hashes of the prompt's full blocks, computed once, as the router does
        (:func:`router.routing.prompt_path.request_hashes`)."""
        if self._hashes is None:
            if self.images:
                prompt = PromptTokens(list(self.token_ids), list(self.images))
                self._hashes = request_hashes(prompt, HashingTerms(self.block_size))
            else:
                # What request_hashes computes for a text prompt without a salt, minus its
                # per-block image bookkeeping (a test pins the equality).
                full = len(self.token_ids) // self.block_size * self.block_size
                self._hashes = block_hashes(self.token_ids[:full], self.block_size,
                                            seed=GLOBAL_SEED)
        return self._hashes


class Policy(ABC):
    """A routing policy: picks a worker per request (see the module docstring).

    Subclasses set :attr:`name`; if they read the event-fed index, :attr:`needs_index`; if
    they route for prefill and decode roles (:meth:`prefill_for`), :attr:`disaggregates`.
    """

    name: ClassVar[str]
    needs_index: ClassVar[bool] = False
    disaggregates: ClassVar[bool] = False

    def start(self, cluster: ClusterView) -> None:
        """Attach to a cluster before the first request; resets per-run state."""
        self.cluster = cluster

    @abstractmethod
    def route(self, request: RouteRequest, now: float) -> int:
        """Return the worker (in ``range(cluster.num_workers)``) that serves ``request``, or
        :data:`HELD` or :data:`SHED` for a policy with flow control."""

    def prefill_for(self, request_id: str) -> int | None:
        """Disaggregated serving: the prefill worker :meth:`route` chose for the request
        (which the driver then runs there first, as ``request_id`` + :data:`PREFILL_SUFFIX`, and
        reports to :meth:`first_token` and :meth:`finished` under that id); None: the worker
        :meth:`route` answered prefills it itself. Asked once per request, when it is sent."""
        return None

    def fetch_for(self, request_id: str) -> tuple[int, int] | None:
        """Peer fetch: the source and the blocks :meth:`route` told the request's worker to
        fetch from it before running it (None: it recomputes what it lacks). Asked once per
        request, when it is sent, on a cluster whose workers fetch."""
        return None

    def fetch_result(self, request_id: str, blocks: int, nbytes: int,  # noqa: B027
                     seconds: float, now: float) -> None:
        """The fetch :meth:`fetch_for` named ended, and its request joins its worker's
        queue: ``blocks`` blocks received, ``nbytes`` bytes in ``seconds`` (0 blocks: it
        failed, and the worker recomputes), as a worker's ``x-kvroute-fetch-result`` says."""

    def dispatch(self, now: float) -> tuple[list[tuple[str, int]], list[str]]:
        """A policy that holds requests (:meth:`route` answered :data:`HELD`): those that
        leave now, with their workers, and those it refused while they waited. Asked after
        every iteration."""
        return [], []

    def first_token(self, request_id: str, now: float) -> None:  # noqa: B027 (optional hook)
        """The request produced its first token."""

    def finished(self, request_id: str, now: float) -> None:  # noqa: B027 (optional hook)
        """The request ended."""

    def index_events(self, worker: int, events: Sequence[Event],  # noqa: B027 (optional hook)
                     now: float) -> None:
        """``worker``'s normalised events were just applied to the index (only for a policy
        with :attr:`needs_index`)."""

    def predictions(self) -> list[tuple[float, float]] | None:
        """Each first token's predicted and delivered seconds, for a policy that predicts
        its time to first token (None: it does not)."""
        return None


def pick_min(values: Sequence[float], rng: random.Random) -> int:
    """Return the index of the smallest value, ties at random."""
    best = min(values)
    tied = [i for i, v in enumerate(values) if v == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def pick_max(values: Sequence[float], rng: random.Random) -> int:
    """Return the index of the largest value, ties at random."""
    best = max(values)
    tied = [i for i, v in enumerate(values) if v == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
