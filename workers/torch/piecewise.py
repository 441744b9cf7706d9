"""Iterations with prefill, run as CUDA graphs between the layers' attentions (piecewise).

A whole-iteration graph (:mod:`workers.torch.graphs`) needs every shape fixed, which decode
steps allow and prefill chunks do not: their count, lengths and cached contexts vary. Yet a
short chunk is launch-bound exactly as a decode step is: 64 new tokens took 10-18 ms eagerly
on the H200 machines (the host's speed varies) and 3.2 ms replayed (``docs/gpu.md``), and one
such chunk sent a whole mixed iteration, decodes included, down the eager path. Everything but
attention depends only on the number of tokens, so the iteration is padded to a *token
bucket* (:data:`TOKEN_BUCKETS`) and cut at each attention: ``layers + 1`` graphs per bucket, each
``[previous layer's output projection, residual, MLP, residual; this layer's norm, Q/K/V,
rotary, K/V write]``, with attention run eagerly between them on the real rows only (the
prefill views built once per iteration, not per layer). vLLM's V1 engine cuts its
graphs at attention the same way.

Every piece reads and writes one bucket's static buffers (hidden state, q, k, v, attention
output, rotary cos/sin), so the graphs replay in any order of buckets, one at a time. Padded
tokens write their K/V into the scratch block (:attr:`workers.torch.kv.PagedKV.scratch_block`)
and no real row reads them: attention skips padded rows, and every other piece works row by
row. A bucket is captured from padding alone, so capture never writes a real block: on its
first use, or up front with :meth:`PiecewiseGraphs.capture_buckets` (what a worker does at
start, as vLLM captures its graphs before serving). With ``capture=False`` the same pieces
run eagerly: the CPU tests check them against the dense forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from workers.torch.graphs import capture_graphs
from workers.torch.model import Decoder, PagedBatch, prefill_views

__all__ = ["TOKEN_BUCKETS", "PiecewiseGraphs"]

#: Padded token counts; an iteration with more tokens is compute-bound and runs unpadded.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(slots=True)
class _Bucket:
    tokens: int
    inputs: Tensor  # [3T] long: token ids | positions | slot rows
    x: Tensor  # [T, hidden]
    cos: Tensor  # [T, 1, head_dim]
    sin: Tensor
    q: Tensor  # [T, heads, head_dim]
    k: Tensor  # [T, kv_heads, head_dim]
    v: Tensor
    attention: Tensor  # [T, heads, head_dim]
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class PiecewiseGraphs:
    """Iterations padded to a token bucket, run as per-layer graphs around eager attention.

    Args:
        model: the decoder.
        kv_layers, kv_rows: the KV cache views the executor passes to ``forward_paged``.
        scratch_block: a device block no request owns (padding writes it).
        block_size: tokens per block.
        capture: capture CUDA graphs (CUDA only); False runs the pieces eagerly.
    """

    def __init__(self, model: Decoder, kv_layers: list[Tensor], kv_rows: Tensor,
                 scratch_block: int, block_size: int, *, capture: bool) -> None:
        self.model = model
        self.kv_layers, self.kv_rows = kv_layers, kv_rows
        self.block_size = block_size
        self.capture = capture
        self.device = kv_rows.device
        self._scratch_row = scratch_block * 2 * model.config.num_layers * block_size
        self._buckets: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.iterations = 0  # padded iterations run
        self.captured = 0  # buckets captured as graphs
        self.replayed = 0  # iterations replayed from graphs

    @staticmethod
    def fits(num_tokens: int) -> bool:
        """Whether an iteration of this many tokens runs padded (else it runs unpadded)."""
        return 0 < num_tokens <= TOKEN_BUCKETS[-1]

    def capture_buckets(self, max_tokens: int) -> int:
        """Capture, now, every bucket a pass of at most ``max_tokens`` tokens can use, so that
        no request waits for a capture (a bucket takes ~0.1-1.4 s on the H200 machine).

        Returns:
            How many buckets were captured (0 without ``capture``).
        """
        if not self.capture:
            return 0
        before = self.captured
        with torch.inference_mode():
            for tokens in TOKEN_BUCKETS:
                self._bucket(tokens)
                if tokens >= max_tokens:
                    break
        return self.captured - before

    def logits(self, batch: PagedBatch) -> Tensor:
        """float32 logits ``[len(batch.logit_rows), vocab]``, as ``forward_paged`` returns."""
        n = len(batch.token_ids)
        b = self._bucket(next(t for t in TOKEN_BUCKETS if t >= n))
        t = b.tokens
        b.inputs[:n].copy_(batch.token_ids)
        b.inputs[t : t + n].copy_(batch.positions)
        b.inputs[2 * t : 2 * t + n].copy_(batch.slot_rows)
        b.inputs[2 * t + n :].fill_(self._scratch_row)
        prefill = prefill_views(batch)
        replay = bool(b.graphs)
        for i, kv in enumerate(self.kv_layers):
            self._run(b, i, replay)
            self.model.attend(b.attention, b.q, b.k, b.v, kv, prefill, batch)
        self._run(b, len(self.kv_layers), replay)
        self.iterations += 1
        self.replayed += replay
        return self.model.logits_of(b.x[batch.logit_rows])

    def _run(self, b: _Bucket, piece: int, replay: bool) -> None:
        if replay:
            b.graphs[piece].replay()
        else:
            self._piece(b, piece)

    def _piece(self, b: _Bucket, i: int) -> None:
        """Piece ``i``: layer ``i - 1`` after attention (or the embedding, for 0), then layer
        ``i`` up to attention (none after the last layer)."""
        m, t = self.model, b.tokens
        if i == 0:
            x, cos, sin = m.embed(b.inputs[:t], b.inputs[t : 2 * t])
            b.x.copy_(x)
            b.cos.copy_(cos)
            b.sin.copy_(sin)
        else:
            b.x.copy_(m.layer_output(i - 1, b.x, b.attention))
        if i < len(self.kv_layers):
            q, k, v = m.attention_inputs(i, b.x, b.cos, b.sin, b.inputs[2 * t :], self.kv_rows,
                                         self.block_size)
            b.q.copy_(q)
            b.k.copy_(k)
            b.v.copy_(v)

    def _bucket(self, tokens: int) -> _Bucket:
        b = self._buckets.get(tokens)
        if b is None:
            c, m = self.model.config, self.model
            kw = {"dtype": m.dtype, "device": self.device}
            inputs = torch.zeros(3 * tokens, dtype=torch.long, device=self.device)
            inputs[2 * tokens :] = self._scratch_row
            b = self._buckets[tokens] = _Bucket(
                tokens=tokens,
                inputs=inputs,
                x=torch.zeros(tokens, c.hidden_size, **kw),
                cos=torch.zeros(tokens, 1, c.head_dim, **kw),
                sin=torch.zeros(tokens, 1, c.head_dim, **kw),
                q=torch.zeros(tokens, c.num_heads, c.head_dim, **kw),
                k=torch.zeros(tokens, c.num_kv_heads, c.head_dim, **kw),
                v=torch.zeros(tokens, c.num_kv_heads, c.head_dim, **kw),
                attention=torch.zeros(tokens, c.num_heads, c.head_dim, **kw),
            )
            if self.capture:
                self._capture(b)
        return b

    def _capture(self, b: _Bucket) -> None:
        """Capture every piece of ``b`` while its inputs are padding (only the scratch block
        is written, during the warm-up passes)."""
        assert self._pool is not None, "capture needs the graph pool"
        pieces = [partial(self._piece, b, i) for i in range(len(self.kv_layers) + 1)]
        b.graphs = [graph for graph, _ in capture_graphs(self.device, self._pool, pieces)]
        self.captured += 1
