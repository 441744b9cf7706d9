"""What an executor computes each iteration, and the simulated executor.

An executor runs one :class:`IterationPlan` from :class:`~workers.engine.batcher.Batcher` (one
forward pass) and returns a sampled token for every request that samples. The contract, shared
by the simulated executor here and the CUDA one:

1. Perform the plan's :attr:`~IterationPlan.transfers` in order, each offload list before its
   onboard list, before computing anything. Block ids index the KV tensors directly: device
   ids ``[0, num_blocks)``, host ids ``[0, host_blocks)``.
2. Compute the KV of every :class:`PrefillChunk` position and of every :class:`DecodeStep`'s
   last token into the request's blocks (position ``p`` lives in ``block_ids[p // block_size]``
   at offset ``p % block_size``), attending to everything before it.
3. Sample one token from the last position of every chunk that ``samples`` and of every
   decode step.

:class:`SimExecutor` does no arithmetic: it sleeps for what the pass would take on the H200 as
:mod:`workers.engine.timing` models it (its default model unless told), divided by a speedup, and
returns tokens that depend only on the prompt and the output position, so a request gets the
same output on any worker, after any preemption, in any process.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from openai_request.tokenizer import BYTE_OFFSET
from workers.cache.block_keys import Prompt
from workers.cache.block_pool import BlockCopy
from workers.engine.timing import DEFAULT_TIMING, TIMING_MODELS, TimingModel

__all__ = [
    "BYTE_TEXT_VOCAB",
    "BlockTransfer",
    "DecodeStep",
    "Executor",
    "IterationPlan",
    "PrefillChunk",
    "SimExecutor",
]

#: Printable ASCII under the byte-level tokenizer: simulated output reads as text.
BYTE_TEXT_VOCAB = range(BYTE_OFFSET + 0x20, BYTE_OFFSET + 0x7F)

# Below this many seconds a sleep only yields to the event loop.
_MIN_SLEEP_S = 1e-6
_SEED_CACHE = 4096
_U64 = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Copies one cache call asked for: perform ``offload``, then ``onboard``."""

    offload: tuple[BlockCopy, ...]
    onboard: tuple[BlockCopy, ...]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt positions ``[start, start + num_new_tokens)`` of one request, computed this pass.

    Attributes:
        request_id: whose prompt.
        block_ids: the request's block table (every prompt position).
        start: first position computed; everything before it is in the KV cache.
        num_new_tokens: positions computed.
        token_ids: the token ids at those positions (image positions hold the placeholder).
        onboard: host-tier blocks copied back for this request (its first chunk after
            admission only; already in :attr:`IterationPlan.transfers`).
        samples: the chunk ends the prompt: a token is sampled from its last position.
        output_index: index, in the request's output, of the token sampled.
        prompt: the request's original prompt (a recompute after preemption prefills it plus
            the tokens produced so far).
    """

    request_id: str
    block_ids: tuple[int, ...]
    start: int
    num_new_tokens: int
    token_ids: tuple[int, ...]
    onboard: tuple[BlockCopy, ...]
    samples: bool
    output_index: int
    prompt: Prompt

    @property
    def num_cached_tokens(self) -> int:
        """Positions whose KV the chunk attends to without computing: all before ``start``."""
        return self.start


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One request's next token: compute the KV of its last token and sample from it.

    Attributes:
        request_id: whose token.
        block_ids: the request's block table, including the last token's block.
        context_len: positions in the sequence, the last token included.
        token_id: the last token (input of this step), at position ``context_len - 1``.
        output_index: index, in the request's output, of the token sampled.
        prompt: the request's original prompt.
    """

    request_id: str
    block_ids: tuple[int, ...]
    context_len: int
    token_id: int
    output_index: int
    prompt: Prompt


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """One forward pass.

    Attributes:
        serial: the iteration's number, from 0.
        prefill: prompt chunks, in schedule order.
        decode: decode steps, in schedule order.
        transfers: block copies to perform, in order, before computing. Each step's offloads
            precede its onboards; steps must not be merged, because a later step may offload
            into a host block that an earlier step's onboard still has to read.
        admitted: requests admitted this iteration (first admission or recompute).
    """

    serial: int
    prefill: tuple[PrefillChunk, ...]
    decode: tuple[DecodeStep, ...]
    transfers: tuple[BlockTransfer, ...]
    admitted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this pass: chunk sizes plus one per decode step."""
        return sum(c.num_new_tokens for c in self.prefill) + len(self.decode)

    @property
    def offload(self) -> tuple[BlockCopy, ...]:
        """Every device-to-host copy of the plan, in order."""
        return tuple(c for t in self.transfers for c in t.offload)

    @property
    def onboard(self) -> tuple[BlockCopy, ...]:
        """Every host-to-device copy of the plan, in order."""
        return tuple(c for t in self.transfers for c in t.onboard)


class Executor(Protocol):
    """Runs iterations (the contract is in the module docstring)."""

    async def execute(self, plan: IterationPlan) -> tuple[dict[str, int], float]:
        """Run one plan.

        Returns:
            The sampled token of every request that samples, and the seconds spent.
        """
        ...


class SimExecutor:
    """An executor that sleeps for the modeled time and returns deterministic tokens.

    Args:
        timing: milliseconds per iteration.
        speedup: how much faster than the model to run (the modeled time is divided by it).
        vocab: token ids to draw outputs from; leave specials (EOS above all) out of it.
        block_size: positions per block, for the cost of onboarding host-tier blocks.
        sleep: how a pass waits out its seconds (``asyncio.sleep``; a test passes a recorder).

    Notes:
        1. Output token ``i`` of a request is a BLAKE2b function of its prompt's token ids,
           the digests and places of its images, and ``i`` (:meth:`token`); never of the
           process, the worker or the schedule.
        2. Offloads cost nothing (device-to-host copies overlap compute); onboards cost
           :meth:`TimingModel.onboard_ms`.
    """

    def __init__(
        self,
        timing: TimingModel = TIMING_MODELS[DEFAULT_TIMING],
        *,
        speedup: float = 1.0,
        vocab: range = BYTE_TEXT_VOCAB,
        block_size: int = 32,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if not speedup > 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        if len(vocab) == 0 or vocab.start < 0:
            raise ValueError(f"vocab must be a non-empty range of token ids, got {vocab}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.timing = timing
        self.speedup = speedup
        self.vocab = vocab
        self.block_size = block_size
        self._sleep = sleep
        #: Recent requests' output seeds, each with the prompt it hashes, held weakly: the
        #: prompts of the last 4,096 requests, held here after their requests ended, grew a
        #: worker by 65 KiB a request of 8,000 tokens (512 KiB at 65,536).
        self._seeds: OrderedDict[str, tuple[weakref.ref[Prompt], bytes]] = OrderedDict()

    def modeled_seconds(self, plan: IterationPlan) -> float:
        """Return how long the plan takes on the modeled GPU, before the speedup."""
        ms = self.timing.iteration_ms(
            [(c.num_new_tokens, c.num_cached_tokens) for c in plan.prefill],
            [d.context_len for d in plan.decode],
        )
        onboard = plan.onboard
        if onboard:
            ms += self.timing.onboard_ms(len(onboard), self.block_size)
        return ms / 1e3

    def token(self, prompt: Prompt, index: int) -> int:
        """Return output token ``index`` of any request with ``prompt``."""
        return self._token(_prompt_seed(prompt), index)

    async def execute(self, plan: IterationPlan) -> tuple[dict[str, int], float]:
        """Sleep for the modeled time over ``speedup`` and sample (see the class notes).

        Returns:
            The sampled tokens and the seconds slept.
        """
        sampled = {
            c.request_id: self._sample(c.request_id, c.prompt, c.output_index)
            for c in plan.prefill
            if c.samples
        }
        for d in plan.decode:
            sampled[d.request_id] = self._sample(d.request_id, d.prompt, d.output_index)
        seconds = self.modeled_seconds(plan) / self.speedup
        # Always yield, so that a very large speedup cannot starve the event loop.
        await self._sleep(seconds if seconds >= _MIN_SLEEP_S else 0)
        return sampled, seconds

    def _sample(self, request_id: str, prompt: Prompt, index: int) -> int:
        # A request's seed hashes its whole prompt: compute it once, not once per token.
        cached = self._seeds.get(request_id)
        if cached is not None and cached[0]() is prompt:
            self._seeds.move_to_end(request_id)
            seed = cached[1]
        else:
            seed = _prompt_seed(prompt)
            self._seeds[request_id] = (weakref.ref(prompt), seed)
            if len(self._seeds) > _SEED_CACHE:
                self._seeds.popitem(last=False)
        return self._token(seed, index)

    def _token(self, seed: bytes, index: int) -> int:
        digest = hashlib.blake2b(seed + _U64.pack(index), digest_size=8).digest()
        return self.vocab[int.from_bytes(digest, "big") % len(self.vocab)]


def _prompt_seed(prompt: Prompt) -> bytes:
    h = hashlib.blake2b(digest_size=32, person=b"kvroute-sim-out")
    h.update(_U64.pack(len(prompt.token_ids)))
    h.update(struct.pack(f">{len(prompt.token_ids)}Q", *prompt.token_ids))
    for span in prompt.images:
        h.update(_U64.pack(span.start) + _U64.pack(span.length))
        h.update(bytes.fromhex(span.digest) if span.digest is not None else b"")
    return h.digest()
