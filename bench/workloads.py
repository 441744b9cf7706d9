"""Workloads for the routing benchmark: Mooncake traces and generators with knobs.

A workload is a list of :class:`WorkloadRequest` in arrival order. A request's prompt is kept
as *segments* (tuples of token ids shared by reference between requests: a system prompt, a
trace block, an earlier turn) and expanded only when it arrives, so a 60M-token trace costs
the memory of its distinct content, not of every prompt.

Token ids live in ``[4, 260)``, the byte tokenizer's non-special ids, so the same prompts
replay against a live router (:mod:`bench.live`) as token-id prompts.

Mooncake traces (``bench/data/README.md``): each hash id becomes 512 deterministic tokens
(SHAKE-128 of the id: the same id always gives the same tokens, in any process) and the prompt
is cut to ``input_length``, so the last block may be partial.

Generators (:data:`GENERATORS`), each seeded and open-loop (arrivals do not wait for replies):

- ``system_prompt``: a few long system prompts with Zipf popularity, a unique user turn each.
- ``multi_turn``: chat sessions; each turn's prompt is the previous prompt, the previous reply
  and a new user message, so the reply's blocks (which workers cache too) are reused.
- ``agentic``: tool loops: a shared tool preamble, a task, then steps that each append a short
  tool call and a long tool result; steps follow each other within seconds.
- ``images``: the system-prompt workload with a share of requests carrying one or two images
  (placeholder positions + a content digest) drawn from a Zipf-popular pool.
- ``long_context``: conversations over a long document: a shared system prompt, a document of
  its own (log-uniform in ``context_tokens``, 3k-48k), then turns that each add the reply
  (200-500 tokens) and a new message, until the next prompt would pass ``max_prompt_tokens``
  (64k less room for the reply): prompts from 4k to 64k tokens, each turn reusing the last.

Output tokens are a deterministic function of the request id
(:meth:`WorkloadRequest.output_tokens`):
the simulated engine emits exactly these, and the multi-turn and agentic generators put them
into the next turn's prompt. Against a live sim worker the worker's own tokens differ, so there
only the prompt part of a previous turn is reusable (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from openai_request.images import ImageSpan
from openai_request.tokenizer import BYTE_OFFSET, IMAGE_ID

__all__ = [
    "GENERATORS",
    "TRACE_BLOCK",
    "GeneratorConfig",
    "WorkloadRequest",
    "generate",
    "load_trace",
    "scale_rate",
    "trace_block_tokens",
]

#: Tokens per hash id in Mooncake traces.
TRACE_BLOCK = 512
# The Mooncake synthetic trace, kept in the package (bench/data/README.md says where from).
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
#: Token ids are ``BYTE_OFFSET + byte``: 256 ids in ``[4, 260)``.
VOCAB_LOW = BYTE_OFFSET

_U64 = struct.Struct(">Q")
Tokens = tuple[int, ...]


def _tokens(domain: bytes, key: bytes, n: int) -> Tokens:
    """``n`` deterministic token ids in ``[4, 260)`` named by ``domain`` and ``key``."""
    digest = hashlib.shake_128(domain + key).digest(n)
    return tuple(b + VOCAB_LOW for b in digest)


_block_cache: dict[int, Tokens] = {}


def trace_block_tokens(hash_id: int) -> Tokens:
    """Return the 512 token ids a Mooncake hash id stands for (memoised)."""
    block = _block_cache.get(hash_id)
    if block is None:
        block = _block_cache[hash_id] = _tokens(b"kvroute.trace.v1", _U64.pack(hash_id),
                                                TRACE_BLOCK)
    return block


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        request_id: unique in the workload.
        arrival_s: seconds from the start of the run.
        segments: the prompt, as token-id tuples to concatenate (shared between requests).
        input_length: prompt tokens: the segments are cut to this length.
        output_length: tokens to generate (the engine never stops early).
        images: images in the prompt (placeholder positions hold ``IMAGE_ID``).
        session: the conversation, agent or trace the request belongs to (for reports).
    """

    request_id: str
    arrival_s: float
    segments: tuple[Tokens, ...]
    input_length: int
    output_length: int
    images: tuple[ImageSpan, ...] = ()
    session: str = ""

    def token_ids(self) -> Tokens:
        """Return the prompt's token ids (expanded now; not kept)."""
        return tuple(itertools.chain.from_iterable(self.segments))[: self.input_length]

    def output_tokens(self) -> Tokens:
        """Return the tokens the simulated engine produces for this request."""
        return _tokens(b"kvroute.output.v1", self.request_id.encode(), self.output_length)


def load_trace(path: str | Path, limit: int | None = None) -> list[WorkloadRequest]:
    """Read a Mooncake-format JSONL trace.

    Args:
        path: one JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``,
            ``hash_ids`` (one per 512-token block).
        limit: keep only the first ``limit`` requests.

    Returns:
        The requests, sorted by arrival (stable for equal timestamps).

    Raises:
        ValueError: the file is unreadable, a line is malformed, or ``input_length`` does not
            fit its hash ids.
    """
    out: list[WorkloadRequest] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            row = json.loads(line)
            ts, n, m, ids = (row["timestamp"], row["input_length"], row["output_length"],
                             row["hash_ids"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
        if not (isinstance(n, int) and isinstance(m, int) and n >= 1 and m >= 1):
            raise ValueError(f"{path}:{number}: input and output lengths must be positive ints")
        if not len(ids) * TRACE_BLOCK >= n > (len(ids) - 1) * TRACE_BLOCK:
            raise ValueError(f"{path}:{number}: input_length {n} does not fit {len(ids)} "
                             f"hash ids of {TRACE_BLOCK} tokens")
        out.append(WorkloadRequest(
            request_id=f"t{len(out)}", arrival_s=float(ts) / 1e3,
            segments=tuple(trace_block_tokens(int(h)) for h in ids), input_length=n,
            output_length=m, session="trace"))
    out.sort(key=lambda r: r.arrival_s)
    return out


def scale_rate(requests: Sequence[WorkloadRequest], rate_scale: float) -> list[WorkloadRequest]:
    """Return the requests with arrival times divided by ``rate_scale`` (2.0: twice the rate).

    Raises:
        ValueError: ``rate_scale`` is not positive.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    if rate_scale == 1.0:
        return list(requests)
    return [replace(r, arrival_s=r.arrival_s / rate_scale) for r in requests]


# -- generators ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GeneratorConfig:
    """Knobs of the generated workloads (each generator reads the ones it needs).

    Attributes:
        requests: how many requests (sessions are started until this many exist).
        rate: arrivals per second of new requests (system_prompt, images) or of new sessions
            (multi_turn, agentic), Poisson.
        system_prompts: distinct system prompts (system_prompt, images); chats use a 16th
            as many, agents a 64th (tool preambles), at least one.
        system_tokens: (min, max) tokens of a system prompt.
        user_tokens: (min, max) tokens of a user message.
        output_tokens: (min, max) tokens of a reply.
        zipf: popularity skew of system prompts and images (0: uniform).
        turns: (min, max) turns of a chat, or steps of an agent.
        turn_gap_s: mean seconds between a session's turns (exponential).
        tool_tokens: (min, max) tokens of a tool result (agentic).
        image_share: share of requests that carry images (images).
        image_tokens: placeholder positions per image.
        image_pool: distinct images.
        context_tokens: (min, max) tokens of a long-context conversation's document,
            log-uniform (long_context).
        context_message_tokens: (min, max) tokens of its user messages.
        context_reply_tokens: (min, max) tokens of its replies.
        max_prompt_tokens: a long-context prompt's most tokens; the conversation ends before.
    """

    requests: int = 2000
    rate: float = 20.0
    system_prompts: int = 128
    system_tokens: tuple[int, int] = (2048, 8192)
    user_tokens: tuple[int, int] = (128, 1024)
    output_tokens: tuple[int, int] = (32, 256)
    zipf: float = 1.0
    turns: tuple[int, int] = (3, 10)
    turn_gap_s: float = 8.0
    tool_tokens: tuple[int, int] = (256, 3072)
    image_share: float = 0.3
    image_tokens: int = 576
    image_pool: int = 200
    context_tokens: tuple[int, int] = (3000, 48000)
    context_message_tokens: tuple[int, int] = (200, 2000)
    context_reply_tokens: tuple[int, int] = (200, 500)
    max_prompt_tokens: int = 65536 - 512


class _Gen:
    """Shared machinery: a seeded RNG, unique content, Zipf picks."""

    def __init__(self, config: GeneratorConfig, seed: int, name: str) -> None:
        self.c = config
        self.rng = random.Random(f"{name}:{seed}")
        self.name = name
        self.seed = seed
        self._serial = 0

    def fresh(self, length: int) -> Tokens:
        """Tokens no other segment shares."""
        self._serial += 1
        return _tokens(b"kvroute.gen.v1", f"{self.name}:{self.seed}:{self._serial}".encode(),
                       length)

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def zipf_pick(self, n: int) -> int:
        weights = [1.0 / (k + 1) ** self.c.zipf for k in range(n)]
        return self.rng.choices(range(n), weights=weights, k=1)[0]

    def arrivals(self, count: int) -> list[float]:
        t, out = 0.0, []
        for _ in range(count):
            out.append(t)
            t += self.rng.expovariate(self.c.rate)
        return out


def _system_prompt(config: GeneratorConfig, seed: int, images: bool) -> list[WorkloadRequest]:
    g = _Gen(config, seed, "images" if images else "system_prompt")
    systems = [g.fresh(g.between(config.system_tokens)) for _ in range(config.system_prompts)]
    pool = [hashlib.sha256(f"image:{seed}:{k}".encode()).hexdigest()
            for k in range(config.image_pool)]
    out = []
    for i, t in enumerate(g.arrivals(config.requests)):
        system = systems[g.zipf_pick(len(systems))]
        segments: list[Tokens] = [system]
        spans: list[ImageSpan] = []
        if images and g.rng.random() < config.image_share:
            for _ in range(g.rng.choice((1, 2))):
                start = sum(len(s) for s in segments)
                digest = pool[g.zipf_pick(len(pool))]
                spans.append(ImageSpan(start, config.image_tokens, digest, None))
                segments.append((IMAGE_ID,) * config.image_tokens)
        segments.append(g.fresh(g.between(config.user_tokens)))
        n = sum(len(s) for s in segments)
        out.append(WorkloadRequest(f"{g.name[0]}{i}", t, tuple(segments), n,
                                   g.between(config.output_tokens), tuple(spans), g.name))
    return out


def _sessions(config: GeneratorConfig, seed: int, agentic: bool) -> list[WorkloadRequest]:
    name = "agentic" if agentic else "multi_turn"
    g = _Gen(config, seed, name)
    prompts = max(1, config.system_prompts // (64 if agentic else 16))
    systems = [g.fresh(g.between(config.system_tokens)) for _ in range(prompts)]
    out: list[WorkloadRequest] = []
    t_start = 0.0
    s = 0
    while len(out) < config.requests:
        segments: list[Tokens] = [systems[g.zipf_pick(len(systems))],
                                  g.fresh(g.between(config.user_tokens))]
        t = t_start
        for turn in range(g.between(config.turns)):
            rid = f"{name[0]}{s}.{turn}"
            req = WorkloadRequest(rid, t, tuple(segments), sum(len(x) for x in segments),
                                  g.between(config.output_tokens if not agentic else (32, 160)),
                                  (), f"{name}{s}")
            out.append(req)
            segments.append(req.output_tokens())
            follow = config.tool_tokens if agentic else config.user_tokens
            segments.append(g.fresh(g.between(follow)))
            gap = config.turn_gap_s / (4.0 if agentic else 1.0)
            t += g.rng.expovariate(1.0 / gap)
        s += 1
        t_start += g.rng.expovariate(config.rate)
    out.sort(key=lambda r: r.arrival_s)
    return out[: config.requests]


def _long_context(config: GeneratorConfig, seed: int) -> list[WorkloadRequest]:
    g = _Gen(config, seed, "long_context")
    systems = [g.fresh(g.between((1024, 2048))) for _ in range(max(1, config.system_prompts // 32))]
    low, high = config.context_tokens
    out: list[WorkloadRequest] = []
    t_start, s = 0.0, 0
    while len(out) < config.requests:
        document = round(math.exp(g.rng.uniform(math.log(low), math.log(high))))
        segments: list[Tokens] = [systems[g.zipf_pick(len(systems))], g.fresh(document),
                                  g.fresh(g.between(config.context_message_tokens))]
        t = t_start
        for turn in range(g.between(config.turns)):
            length = sum(len(x) for x in segments)
            if length > config.max_prompt_tokens:
                break
            req = WorkloadRequest(f"l{s}.{turn}", t, tuple(segments), length,
                                  g.between(config.context_reply_tokens), (), f"long_context{s}")
            out.append(req)
            segments += [req.output_tokens(), g.fresh(g.between(config.context_message_tokens))]
            t += g.rng.expovariate(1.0 / config.turn_gap_s)
        s += 1
        t_start += g.rng.expovariate(config.rate)
    out.sort(key=lambda r: r.arrival_s)
    return out[: config.requests]


#: Generator name -> function (config, seed) -> requests in arrival order.
GENERATORS: dict[str, Callable[[GeneratorConfig, int], list[WorkloadRequest]]] = {
    "system_prompt": lambda c, s: _system_prompt(c, s, images=False),
    "images": lambda c, s: _system_prompt(c, s, images=True),
    "multi_turn": lambda c, s: _sessions(c, s, agentic=False),
    "agentic": lambda c, s: _sessions(c, s, agentic=True),
    "long_context": _long_context,
}


def generate(name: str, config: GeneratorConfig | None = None, seed: int = 0
             ) -> list[WorkloadRequest]:
    """Return the requests of generated workload ``name`` (see :data:`GENERATORS`).

    Raises:
        ValueError: unknown generator, or a knob out of range.
    """
    config = config or GeneratorConfig()
    fn = GENERATORS.get(name)
    if fn is None:
        raise ValueError(f"unknown generator {name!r}; choose from {sorted(GENERATORS)}")
    if config.requests < 1 or not config.rate > 0 or not math.isfinite(config.rate):
        raise ValueError("requests must be >= 1 and rate positive")
    return fn(config, seed)
