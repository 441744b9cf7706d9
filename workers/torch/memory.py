"""How much device memory a torch worker takes, and how much of it goes to the KV cache.

A worker's share of the device is ``--gpu-memory-utilization`` of its total memory (several
workers share one GPU with, say, 0.22 each). Out of that share come, in order:

1. the weights;
2. the worst iteration's working memory (activations, logits, attention's scratch), measured
   at start by :func:`profile_iteration`: a forward pass of ``--max-num-batched-tokens`` new
   tokens over ``--max-model-len`` of context, and a mixed pass of the largest decode batch
   whose contexts together reach the iteration's context budget (:func:`iteration_context`),
   the most context the batcher lets one iteration touch;
3. the CUDA graph pool, allowed as much as the worst iteration (a graph replays a pass of at
   most that size); measured after capture, and the start refused if it took more;
4. the CUDA context and libraries outside PyTorch's allocator (:data:`CONTEXT_BYTES`);
5. the rest is the KV cache, in whole blocks. ``--kv-memory-gb`` sets it instead, and the
   start is refused when that setting and items 1-4 do not fit the share.

This is the accounting vLLM does before it sizes its cache. The profile runs the real forward
over a cache of one block whose tables name that block at every position, so it takes no
memory for K/V it does not need and reads the same amount as a real pass.

:func:`plan_memory` is pure arithmetic (the tests check it on the CPU);
:func:`profile_iteration` runs on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.cache.block_keys import Prompt
from workers.engine.executor import DecodeStep, IterationPlan, PrefillChunk
from workers.settings import WorkerSettings

__all__ = ["CONTEXT_BYTES", "MemoryPlan", "iteration_context", "plan_memory",
           "profile_iteration", "worst_case_plans"]

#: Device memory a CUDA process holds outside PyTorch's allocator (context, kernels' code,
#: library handles): about 0.5-0.7 GiB on an H100/H200; allowed 1 GiB.
CONTEXT_BYTES = 1 << 30
#: Context tokens one iteration may touch, at least (the batcher's budget; raised to cover one
#: request of ``--max-model-len`` plus a full batch of new tokens).
MIN_ITERATION_CONTEXT = 1 << 20
#: Decode steps in the profile's mixed pass at most.
PROFILE_DECODE_STEPS = 256

_GIB = 2**30
_PROMPT = Prompt((5,))  # plans carry a prompt for the simulated engine; the torch one ignores it


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One worker's device memory, by use (bytes).

    Attributes:
        budget: the worker's share (``--gpu-memory-utilization`` x the device's total).
        weights: parameters.
        iteration: the worst iteration's working memory, as profiled.
        graphs: allowance for the CUDA graph pool (0 without graphs).
        context: allowance for memory outside PyTorch's allocator.
        kv: the KV cache (``num_blocks`` whole blocks).
        num_blocks: KV blocks.
        iteration_context: context tokens one iteration may touch (the batcher's budget).
    """

    budget: int
    weights: int
    iteration: int
    graphs: int
    context: int
    kv: int
    num_blocks: int
    iteration_context: int

    @property
    def total(self) -> int:
        """Everything planned; at most :attr:`budget`."""
        return self.weights + self.iteration + self.graphs + self.context + self.kv

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"budget {self.budget / _GIB:.2f} GiB: weights {self.weights / _GIB:.2f}, "
                f"worst iteration {self.iteration / _GIB:.2f}, graphs {self.graphs / _GIB:.2f}, "
                f"context {self.context / _GIB:.2f}, KV {self.kv / _GIB:.2f} GiB "
                f"({self.num_blocks} blocks); an iteration touches at most "
                f"{self.iteration_context} context tokens")


def iteration_context(settings: WorkerSettings) -> int:
    """Context tokens one iteration may touch: what the profile covers and the batcher keeps
    each iteration under (decode contexts plus every chunk's start and new tokens)."""
    return max(MIN_ITERATION_CONTEXT, settings.max_model_len + settings.max_num_batched_tokens)


def plan_memory(*, total: int, utilization: float, weights: int, iteration: int, graphs: int,
                block_bytes: int, context: int = CONTEXT_BYTES, kv_bytes: int | None = None,
                iteration_tokens: int = MIN_ITERATION_CONTEXT) -> MemoryPlan:
    """Divide a worker's share of the device (module docstring).

    Args:
        total: the device's memory.
        utilization: the worker's share of it, in (0, 1].
        weights, iteration, graphs, context: items 1-4 of the module docstring.
        block_bytes: one KV block.
        kv_bytes: the KV cache's size when set by hand (``--kv-memory-gb``), else the rest.
        iteration_tokens: the iteration's context budget, recorded in the plan.

    Raises:
        ValueError: the share holds no KV block after items 1-4, or a hand-set KV cache does
            not fit beside them; the message names the settings to change.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization)
    fixed = weights + iteration + graphs + context
    need = (f"weights {weights / _GIB:.2f} GiB, the worst iteration {iteration / _GIB:.2f} "
            f"GiB, CUDA graphs {graphs / _GIB:.2f} GiB and {context / _GIB:.2f} GiB of CUDA "
            f"context")
    share = f"--gpu-memory-utilization {utilization:g} of {total / _GIB:.1f} GiB"
    lower = "lower --max-model-len or --max-num-batched-tokens, pass --no-cuda-graphs"
    if kv_bytes is not None:
        if fixed + kv_bytes > budget:
            raise ValueError(
                f"--kv-memory-gb {kv_bytes / _GIB:g} does not fit: with {need} the worker "
                f"needs {(fixed + kv_bytes) / _GIB:.2f} GiB, over its {budget / _GIB:.2f} GiB "
                f"({share}); lower --kv-memory-gb, {lower}, or raise "
                f"--gpu-memory-utilization")
        kv = kv_bytes
    else:
        kv = budget - fixed
    blocks = kv // block_bytes if kv > 0 else 0
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {need} leave {max(0, budget - fixed) / _GIB:.2f} GiB "
            f"of the worker's {budget / _GIB:.2f} GiB ({share}); {lower}, or raise "
            f"--gpu-memory-utilization")
    return MemoryPlan(budget=budget, weights=weights, iteration=iteration, graphs=graphs,
                      context=context, kv=blocks * block_bytes, num_blocks=blocks,
                      iteration_context=iteration_tokens)


def worst_case_plans(settings: WorkerSettings, block: int) -> list[IterationPlan]:
    """The iterations :func:`profile_iteration` runs, every table naming ``block``.

    1. ``--max-num-batched-tokens`` new tokens ending at ``--max-model-len`` (one chunk over
       the longest cached context, or a fresh prompt when the batch is the longer).
    2. The largest decode batch (:data:`PROFILE_DECODE_STEPS`, ``--max-num-seqs`` and half the
       token budget at most) with the rest of the tokens as such a chunk, the decode contexts
       filling the iteration's context budget (:func:`iteration_context`) together.
    """
    bs, tokens, longest = settings.block_size, settings.max_num_batched_tokens, \
        settings.max_model_len
    budget = iteration_context(settings)

    def chunk(rid: str, n: int) -> PrefillChunk:
        start = max(0, longest - n)
        table = (block,) * -(-(start + n) // bs)
        return PrefillChunk(rid, table, start, n, (5,) * n, (), True, 0, _PROMPT)

    steps = max(1, min(PROFILE_DECODE_STEPS, settings.max_num_seqs, tokens // 2))
    each = min(longest, max(1, (budget - longest) // steps))
    table = (block,) * -(-each // bs)
    decode = tuple(DecodeStep(f"profile-decode-{i}", table, each, 5, 0, _PROMPT)
                   for i in range(steps))
    return [IterationPlan(0, (chunk("profile-prefill", tokens),), (), (), ()),
            IterationPlan(1, (chunk("profile-mixed", tokens - steps),), decode, (), ())]


def profile_iteration(run: Callable[[IterationPlan], object], plans: list[IterationPlan],
                      device: torch.device) -> int:
    """Run ``plans`` and return the most device memory any of them reserved beyond what was
    reserved before (bytes; 0 off CUDA). The allocator's cache is emptied first and after."""
    if device.type != "cuda":
        for plan in plans:
            run(plan)
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    for plan in plans:
        run(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - before
    torch.cuda.empty_cache()
    return peak
