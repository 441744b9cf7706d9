"""Decode iterations at fixed shapes, captured once per shape as CUDA graphs and replayed.

A decode step of the 1B model launches ~900 small kernels; on the H200 machine's CPU that host
work (~25 ms a step) was ten times the kernels' device time (~2.7 ms). A CUDA graph replays
the whole step with one launch. Graphs need fixed shapes and fixed addresses, so each step is
padded to a *shape*: the batch rounded up to :data:`BATCH_BUCKETS`, the block-table width to a
power of two (at least :data:`MIN_WIDTH` blocks), and its inputs copied into that shape's one
static tensor ``[tokens B | positions B | slot rows B | context lengths B | tables B x W]``.

Padding never touches a real block: padded rows write their K/V into the scratch block
(:attr:`workers.torch.kv.PagedKV.scratch_block`, one block past the cache manager's), their
table entries point there, and each attends to one position of it (a row with no visible
position would be NaN). Real rows' table padding also points at the scratch block, masked out.

On CUDA a worker captures every shape it can use while it starts (:meth:`DecodeGraphs.
capture_shapes`; a shape missed there is captured on its first use), into one memory pool
shared by every shape (they replay one at a time; the logits are cloned before the next
replay). With ``capture=False`` the same padded forward runs eagerly: the CPU tests check it
against the unpadded forward, and with it the padding rules the graphs rely on.

Where attention gathers the context (no paged kernel: :func:`workers.torch.paged.
kernel_available`), shapes whose gathered context would exceed :data:`MAX_SLOTS` positions
(batch x width x block size) are not padded: :meth:`DecodeGraphs.fits` says no and the executor
runs them eagerly. The paged kernel's memory does not grow with the context, so with it every
shape up to the worker's limits is captured.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engine.executor import DecodeStep
from workers.torch.model import Decoder, PagedBatch

__all__ = ["BATCH_BUCKETS", "MAX_SLOTS", "MIN_WIDTH", "DecodeGraphs", "capture_graphs",
           "decode_shapes"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 8
#: Gathered context positions per padded step at most, where attention gathers (1M: 1 GiB of
#: K per layer for the 1B model).
MAX_SLOTS = 1 << 20


def capture_graphs(
    device: torch.device, pool: tuple[int, int], pieces: Sequence[Callable[[], object]]
) -> list[tuple[torch.cuda.CUDAGraph, object]]:
    """Capture each of ``pieces`` as one CUDA graph in the memory ``pool``; returns each graph
    with what its piece returned during capture (static outputs the replays overwrite).

    All pieces first run twice on a side stream, outside any graph, so that kernel selection
    and the allocator's first allocations (which a graph must not record) happen before."""
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for _ in range(2):
            for piece in pieces:
                piece()
    compute.wait_stream(side)
    captured = []
    for piece in pieces:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = piece()
        captured.append((graph, out))
    return captured


def _zeros(n: int) -> array[int]:
    return array("q", bytes(8 * n))


def decode_shapes(max_batch: int, max_context: int, block_size: int,
                  max_slots: int | None = MAX_SLOTS) -> list[tuple[int, int]]:
    """Every (batch, width) shape that decode steps of at most ``max_batch`` requests over
    contexts of at most ``max_context`` tokens can be padded to (what a worker captures at
    start), smallest first; shapes over ``max_slots`` positions (None: no limit), which
    :meth:`DecodeGraphs.fits` refuses, are left out."""
    top_batch = _round_up(min(max_batch, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
    top_width = _width(-(-max_context // block_size))
    shapes = []
    for batch in BATCH_BUCKETS[: BATCH_BUCKETS.index(top_batch) + 1]:
        width = MIN_WIDTH
        while width <= top_width and (max_slots is None
                                      or batch * width * block_size <= max_slots):
            shapes.append((batch, width))
            width *= 2
    return shapes


def _round_up(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


def _width(blocks: int) -> int:
    return max(MIN_WIDTH, 1 << (blocks - 1).bit_length())


@dataclass(slots=True)
class _Shape:
    batch: int
    width: int
    inputs: Tensor
    logits: Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Padded decode forwards, one static shape per (batch bucket, width bucket).

    Args:
        model: the decoder.
        kv_layers, kv_rows: the KV cache views the executor passes to ``forward_paged``.
        scratch_block: a device block no request owns (padding writes and reads it).
        block_size: tokens per block.
        capture: capture CUDA graphs (CUDA only); False runs the padded forward eagerly.
        max_slots: padded positions (batch x width x block size) per shape at most, None for
            no limit (module docstring).
    """

    def __init__(self, model: Decoder, kv_layers: list[Tensor], kv_rows: Tensor,
                 scratch_block: int, block_size: int, *, capture: bool,
                 max_slots: int | None = MAX_SLOTS) -> None:
        self.model = model
        self.kv_layers, self.kv_rows = kv_layers, kv_rows
        self.scratch = scratch_block
        self.block_size = block_size
        self.capture = capture
        self.max_slots = max_slots
        self.device = kv_rows.device
        self._row_stride = 2 * model.config.num_layers * block_size
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._rows = torch.arange(BATCH_BUCKETS[-1], device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._outputs: dict[int, Tensor] = {}  # batch -> logits buffer of its shapes
        self.steps = 0  # padded steps run
        self.captured = 0  # shapes captured as graphs
        self.replayed = 0  # steps replayed from a graph

    def fits(self, steps: Sequence[DecodeStep]) -> bool:
        """Whether these decode steps run padded (else the caller runs them eagerly)."""
        if not steps or len(steps) > BATCH_BUCKETS[-1]:
            return False
        if self.max_slots is None:
            return True
        blocks = max(-(-s.context_len // self.block_size) for s in steps)
        slots = _round_up(len(steps), BATCH_BUCKETS) * _width(blocks) * self.block_size
        return slots <= self.max_slots

    def capture_shapes(self, max_batch: int, max_context: int) -> int:
        """Capture, now, every shape of :func:`decode_shapes` (``max_batch`` requests, contexts
        of ``max_context`` tokens), so that no decode step waits for a capture.

        Returns:
            How many shapes were captured (0 without ``capture``).
        """
        if not self.capture:
            return 0
        before = self.captured
        with torch.inference_mode():
            for batch, width in decode_shapes(max_batch, max_context, self.block_size,
                                              self.max_slots):
                self._shape(batch, width)
        return self.captured - before

    def logits(self, steps: Sequence[DecodeStep]) -> Tensor:
        """float32 logits ``[len(steps), vocab]`` of one decode step per request (a copy)."""
        bs = self.block_size
        n = len(steps)
        blocks = max(-(-s.context_len // bs) for s in steps)
        shape = self._shape(_round_up(n, BATCH_BUCKETS), _width(blocks))
        b, w = shape.batch, shape.width
        shape.inputs.copy_(self._stage(steps, b, w), non_blocking=True)
        self.steps += 1
        if shape.graph is not None:
            shape.graph.replay()
            self.replayed += 1
            assert shape.logits is not None, "a captured shape keeps its output"
            return shape.logits[:n].clone()
        return self._forward(shape)[:n]

    def _stage(self, steps: Sequence[DecodeStep], b: int, w: int) -> Tensor:
        """The shape's inputs on the host, ``[tokens | positions | slot rows | lengths |
        tables]`` padded to ``b`` rows of ``w`` blocks. Built in ``array('q')`` and viewed as a
        tensor: a list of Python ints through ``torch.tensor`` took ~4 ms for a 32 x 512
        shape, on the device's host, before every replay."""
        bs, n, stride = self.block_size, len(steps), self._row_stride
        pad = b - n
        ctx = [s.context_len for s in steps]
        host = array("q", [s.token_id for s in steps])
        host.extend(_zeros(pad))
        host.extend([c - 1 for c in ctx])
        host.extend(_zeros(pad))
        host.extend([s.block_ids[(c - 1) // bs] * stride + (c - 1) % bs
                     for s, c in zip(steps, ctx, strict=True)])
        host.extend(array("q", [self.scratch * stride]) * pad)
        host.extend(ctx)
        host.extend(array("q", [1]) * pad)
        fill = array("q", [self.scratch]) * w
        for s, c in zip(steps, ctx, strict=True):
            used = -(-c // bs)
            host.extend(s.block_ids[:used])
            host.extend(fill[: w - used])
        for _ in range(pad):
            host.extend(fill)
        return torch.frombuffer(host, dtype=torch.long)

    def _shape(self, batch: int, width: int) -> _Shape:
        shape = self._shapes.get((batch, width))
        if shape is None:
            inputs = torch.zeros(4 * batch + batch * width, dtype=torch.long, device=self.device)
            # Every row padding until filled: scratch slot and table, one visible position.
            inputs[2 * batch : 3 * batch] = self.scratch * self._row_stride
            inputs[3 * batch : 4 * batch] = 1
            inputs[4 * batch :] = self.scratch
            shape = self._shapes[(batch, width)] = _Shape(batch, width, inputs)
            if self.capture:
                self._capture(shape)
        return shape

    def _forward(self, shape: _Shape) -> Tensor:
        b, w, bs = shape.batch, shape.width, self.block_size
        x = shape.inputs
        lens = x[3 * b : 4 * b]
        batch = PagedBatch(
            token_ids=x[:b],
            positions=x[b : 2 * b],
            slot_rows=x[2 * b : 3 * b],
            prefill=(),
            decode_offset=0,
            decode_tables=x[4 * b :].view(b, w),
            decode_lens=lens,
            logit_rows=self._rows[:b],
            decode_max_context=w * bs,
        )
        return self.model.forward_paged(batch, self.kv_layers, self.kv_rows)

    def _capture(self, shape: _Shape) -> None:
        """Capture ``shape``'s forward, its logits copied into the one output buffer of its
        batch size: allocated outside the graphs, so shapes of one batch share it (each
        replay's logits are cloned before the next replay) instead of each keeping its own
        (~0.6 GB over every shape with a 32k vocabulary)."""
        assert self._pool is not None, "capture needs the graph pool"
        out = self._outputs.get(shape.batch)
        if out is None:
            vocab = self.model.config.vocab_size
            out = self._outputs[shape.batch] = torch.empty(
                shape.batch, vocab, dtype=torch.float32, device=self.device)
        [(shape.graph, _)] = capture_graphs(self.device, self._pool,
                                            [lambda: out.copy_(self._forward(shape))])
        shape.logits = out
        self.captured += 1
