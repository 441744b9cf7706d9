"""A Llama-style decoder in PyTorch whose attention reads and writes a paged KV cache.

The architecture is the one Llama and Qwen2 share: token embedding, then per layer RMSNorm ->
grouped-query attention with rotary positions -> residual, RMSNorm -> SwiGLU MLP -> residual,
then a final RMSNorm and the output projection. Parameter names are the Hugging Face ones
(``model.layers.0.self_attn.q_proj.weight`` ...), so a local safetensors checkpoint loads as is.

Two forwards compute the same function:

- :meth:`Decoder.forward_paged` runs one engine iteration over a flat batch of tokens from many
  sequences (:class:`PagedBatch`): each token's K/V is written into its slot of the paged cache
  before attention, and each sequence attends to its whole context read through its block
  table (:mod:`workers.torch.paged`). A prefill chunk over a cached prefix thus computes only
  its new tokens.
- :meth:`Decoder.forward_dense` runs one sequence from scratch with no cache: the reference the
  tests compare the paged forward against.

Notes:
    1. Weights come from a named configuration (:data:`CONFIGS`) with seeded random values
       (:meth:`Decoder.init_random`: every tensor's generator is seeded from the seed and the
       tensor's name, so two processes with the same config, seed and device type get the same
       weights), or from a local folder (:func:`load_checkpoint`). Nothing is ever downloaded.
    2. Attention: a prefill from position 0 runs PyTorch's SDPA causally over its fresh K/V
       (flash attention on CUDA); a chunk over a cached prefix gathers its context and runs
       the same kernel bottom-right causal (:data:`CHUNKS_IN_PLACE` says why), its cached
       bulk through cuDNN when the chunk is long (:data:`SPLIT_CHUNKS`); the decode
       steps (one padded batch) read their context in place through the block tables
       (:func:`workers.torch.paged.paged_attention`: a Triton kernel on CUDA, a gather and
       SDPA on the CPU).
    3. Images have no vision tower here: an image's positions are its placeholder tokens.
"""

from __future__ import annotations

import json
import math
import mmap
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from workers.torch.bulk import available as bulk_available
from workers.torch.bulk import bulk_for, split_attention
from workers.torch.paged import paged_attention
from workers.torch.shapes import CONFIGS, ModelConfig, config_from_folder

__all__ = [
    "CHUNKS_IN_PLACE",
    "CONFIGS",
    "FUSE_MAX_TOKENS",
    "SPLIT_CHUNKS",
    "Decoder",
    "ModelConfig",
    "PagedBatch",
    "PrefillView",
    "config_from_folder",
    "load_checkpoint",
    "prefill_attention",
    "prefill_views",
    "read_safetensors",
]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(file: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Read every tensor of a ``.safetensors`` file onto ``device`` as ``dtype``.

    The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
    byte range) and the raw data; reading it directly keeps the ``safetensors`` package an
    optional nicety rather than a dependency.

    Raises:
        ValueError: the file is not a safetensors file or holds an unknown dtype.
    """
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file")
        size = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ValueError(f"{file}: not a safetensors file (bad header)") from None
        # A private writable mapping: torch.frombuffer warns on read-only buffers. It is
        # closed when the last view of it is gone (each tensor is copied out of it).
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = _SAFETENSORS_DTYPES.get(info["dtype"])
        if kind is None:
            raise ValueError(f"{file}: tensor {name} has unknown dtype {info['dtype']}")
        start, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if count * kind.itemsize != end - start:
            raise ValueError(f"{file}: tensor {name} has {end - start} bytes for its shape")
        if count == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype, device=device)
            continue
        view = torch.frombuffer(data, dtype=kind, count=count, offset=8 + size + start)
        out[name] = view.reshape(info["shape"]).to(device=device, dtype=dtype, copy=True)
    return out


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where the tokens of one iteration come from and where their K/V go.

    Tokens are flat: every prefill chunk's tokens in order, then one token per decode step.

    Attributes:
        token_ids: [T] token ids.
        positions: [T] each token's position in its sequence.
        slot_rows: [T] the row of each token's layer-0 K in the cache seen as rows of one
            position (``block * layers * 2 * block_size + offset``; layer ``l`` adds
            ``2 * l * block_size``, V adds ``block_size``).
        prefill: per chunk, (first flat index, start position, new tokens, block table of the
            whole context [ceil((start + new) / block_size)]).
        decode_offset: flat index of the first decode token.
        decode_tables: [B, max blocks] decode block tables, padded with any valid block.
        decode_lens: [B] each decode step's context length (its own token included).
        logit_rows: [S] flat indices whose logits are wanted, in order.
        decode_max_context: an upper bound of ``decode_lens`` known on the host (the tables'
            width in positions).
    """

    token_ids: Tensor
    positions: Tensor
    slot_rows: Tensor
    prefill: tuple[tuple[int, int, int, Tensor], ...]
    decode_offset: int
    decode_tables: Tensor | None
    decode_lens: Tensor | None
    logit_rows: Tensor
    decode_max_context: int = 0


@dataclass(frozen=True, slots=True)
class PrefillView:
    """One prefill chunk as attention reads it (built once per iteration, used by every layer).

    Attributes:
        first: flat index of the chunk's first token.
        new: its tokens.
        context: positions its last token sees (start + new).
        table: block table of the whole context ``[1, blocks]``; None when the chunk starts at
            position 0 (then it attends causally over its own fresh K/V).
        lens: ``[1]`` the context on the table's device (None with no table).
    """

    first: int
    new: int
    context: int
    table: Tensor | None
    lens: Tensor | None


def prefill_views(batch: PagedBatch) -> list[PrefillView]:
    """The batch's prefill chunks as attention reads them."""
    views = []
    for first, start, n, table in batch.prefill:
        if not start:
            views.append(PrefillView(first, n, n, None, None))
            continue
        lens = torch.full((1,), start + n, dtype=torch.long).to(table.device, non_blocking=True)
        views.append(PrefillView(first, n, start + n, table[None], lens))
    return views


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel on CUDA (eight as float32 ops): statistics in float32 as the
        # reference implementations compute them; the weight is applied before the one
        # rounding back, where Hugging Face's rounds, then multiplies (a bf16 ulp apart).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


#: Whether a prefill chunk over a cached prefix reads its context in place (the paged kernel)
#: rather than gathered into one tensor for flash attention. Measured on the H200 (one layer,
#: llama-1b; ``python -m bench.gpu --sections attention``), gathered + flash against the best
#: launch of the paged kernel: 64 new over 8,128 cached 0.16 / 0.24 ms, 2,048 over 30,720
#: 2.14 / 2.78, 8,192 over 24,576 6.8 / 9.3. The gather's memory is bounded by one request's
#: context (``--max-model-len``: 128 MiB a layer at 64k for llama-1b) and is in the profiled
#: worst iteration (:mod:`workers.torch.memory`), so chunks gather; decode steps, whose
#: gathered context grows with the batch, read in place.
CHUNKS_IN_PLACE = False

#: Whether a long chunk over a long cached prefix attends its cached bulk through cuDNN and
#: the rest through flash (:mod:`workers.torch.bulk`; CUDA with cuDNN only). On the H200, one
#: layer of 8,192 new over 16,384 cached: 4.60 ms flash alone, 3.30 split (``docs/gpu.md``).
SPLIT_CHUNKS = True

#: Passes of more tokens use the projections one by one. Fused, a pass launches 128 kernels
#: fewer (~0.2 ms in a graph) but an 8k cold pass measured 5% slower (~0.3 µs a token,
#: ``docs/gpu.md``): by that line fusing pays below ~700 tokens.
FUSE_MAX_TOKENS = 512


def _slices(weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]) -> list[nn.Linear]:
    """Linear layers whose parameters are consecutive row slices of one ``weight`` (and
    ``bias``): loading or initialising a slice by its own name fills the shared tensor, which
    then serves all of them in one matrix multiply. The model is built where it runs, in its
    dtype, and never moved or cast: ``.to()`` would copy the slices apart from the tensor."""
    layers, start = [], 0
    for size in sizes:
        layer = nn.Linear(weight.shape[1], size, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight[start : start + size])
        if bias is not None:
            layer.bias = nn.Parameter(bias[start : start + size])
        layers.append(layer)
        start += size
    return layers


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        kw = {"dtype": dtype, "device": device}
        sizes = (c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d)
        # [q; k; v] in one tensor, one GEMM (attributes, not parameters: the Hugging Face
        # names below are the parameters, views of these).
        self.qkv_weight = torch.empty(sum(sizes), h, **kw)
        self.qkv_bias = torch.empty(sum(sizes), **kw) if c.attention_bias else None
        self.q_proj, self.k_proj, self.v_proj = _slices(self.qkv_weight, self.qkv_bias, sizes)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False, **kw)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, m = c.hidden_size, c.intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.gate_up_weight = torch.empty(2 * m, h, **kw)  # [gate; up], as qkv_weight above
        self.gate_proj, self.up_proj = _slices(self.gate_up_weight, None, (m, m))
        self.down_proj = nn.Linear(m, h, bias=False, **kw)
        self.size = m

    def forward(self, x: Tensor) -> Tensor:
        if len(x) > FUSE_MAX_TOKENS:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight).split(self.size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = _Attention(c, dtype, device)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = _MLP(c, dtype, device)


class _Backbone(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(_Layer(c, dtype, device) for _ in range(c.num_layers))
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)


class Decoder(nn.Module):
    """A Llama-style decoder (module docstring). Build with ``torch.device("meta")`` and no
    memory is taken; :meth:`init_random` or :func:`load_checkpoint` fills it.

    Args:
        config: the shape.
        dtype: parameter and activation dtype (bf16 on CUDA, float32 on CPU).
        device: where the parameters live.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.model = _Backbone(config, dtype, device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        )
        self.register_buffer("inv_freq", _inv_freq(config, device), persistent=False)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Fill every weight from ``seed`` (norms with ones, the rest normal(0, init_std))."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            param.normal_(0.0, self.config.init_std, generator=gen)

    # -- forwards --------------------------------------------------------------------------

    def forward_paged(self, batch: PagedBatch, kv_layers: list[Tensor], kv_rows: Tensor) -> Tensor:
        """Run one iteration: write every token's K/V into the cache, attend, return logits.

        Args:
            batch: the flat tokens and their cache layout.
            kv_layers: per layer, the device blocks ``[num_blocks, 2, block_size, kv_heads,
                head_dim]`` (views of one block-major allocation), read by attention.
            kv_rows: the same allocation as ``[num_blocks * layers * 2 * block_size,
                kv_heads * head_dim]`` rows, where each token's K/V is written in place.

        Returns:
            float32 logits ``[len(batch.logit_rows), vocab_size]``.
        """
        x, cos, sin = self.embed(batch.token_ids, batch.positions)
        block_size = kv_layers[0].shape[2]
        prefill = prefill_views(batch)
        for i, kv in enumerate(kv_layers):
            q, k, v = self.attention_inputs(i, x, cos, sin, batch.slot_rows, kv_rows, block_size)
            out = torch.empty_like(q)
            self.attend(out, q, k, v, kv, prefill, batch)
            x = self.layer_output(i, x, out)
        return self.logits_of(x[batch.logit_rows])

    # -- the pieces of one layer (forward_paged, and torch_piecewise's graphs) ------------

    def embed(self, token_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Token embeddings and the rotary cos/sin of each position."""
        cos, sin = self._rotary(positions)
        return self.model.embed_tokens(token_ids), cos, sin

    def attention_inputs(self, i: int, x: Tensor, cos: Tensor, sin: Tensor, slot_rows: Tensor,
                         kv_rows: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Layer ``i`` up to attention: norm, Q/K/V with rotary positions, K/V written into
        the cache (``slot_rows`` as in :class:`PagedBatch`). Returns q, k, v ``[T, heads, D]``."""
        c = self.config
        attn = self.model.layers[i].self_attn
        h = self.model.layers[i].input_layernorm(x)
        if len(x) > FUSE_MAX_TOKENS:
            q = _rotate(attn.q_proj(h).view(-1, c.num_heads, c.head_dim), cos, sin)
            k = _rotate(attn.k_proj(h).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
            v = attn.v_proj(h).view(-1, c.num_kv_heads, c.head_dim)
        else:  # one GEMM for q, k and v, one rotary pass over q and k together
            qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias)
            heads = c.num_heads + c.num_kv_heads
            qk = _rotate(qkv[:, : heads * c.head_dim].view(-1, heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, heads * c.head_dim :].view(-1, c.num_kv_heads, c.head_dim)
        rows = slot_rows + i * 2 * block_size
        kv_rows.index_copy_(0, rows, k.flatten(1))
        kv_rows.index_copy_(0, rows + block_size, v.flatten(1))
        return q, k, v

    @staticmethod
    def attend(out: Tensor, q: Tensor, k: Tensor, v: Tensor, kv: Tensor,
               prefill: list[PrefillView], batch: PagedBatch) -> None:
        """Attention of one layer into ``out``'s rows of real tokens: each prefill chunk over
        its fresh K/V (from position 0) or, read in place, its cached context; the decode
        steps as one padded batch. ``kv`` is the layer's blocks; rows past the batch's are
        left alone."""
        for view in prefill:
            rows = slice(view.first, view.first + view.new)
            if view.table is None:
                out[rows] = prefill_attention(q[rows], k[rows], v[rows])
            elif CHUNKS_IN_PLACE:
                assert view.lens is not None, "a chunk over a cached prefix has its length"
                out[rows] = paged_attention(q[rows], kv, view.table, view.lens,
                                            queries=view.new, max_context=view.context)
            else:
                keys = kv[:, 0].index_select(0, view.table[0]).flatten(0, 1)[: view.context]
                values = kv[:, 1].index_select(0, view.table[0]).flatten(0, 1)[: view.context]
                cut = bulk_for(view.new, view.context) if SPLIT_CHUNKS and bulk_available(
                    kv.device) else 0
                out[rows] = (split_attention(q[rows], keys, values, cut) if cut
                             else prefill_attention(q[rows], keys, values))
        if batch.decode_tables is not None:
            assert batch.decode_lens is not None, "decode tables without their lengths"
            n = batch.decode_tables.shape[0]
            rows = slice(batch.decode_offset, batch.decode_offset + n)
            out[rows] = paged_attention(q[rows], kv, batch.decode_tables, batch.decode_lens,
                                        queries=1, max_context=batch.decode_max_context)

    def layer_output(self, i: int, x: Tensor, attention: Tensor) -> Tensor:
        """Layer ``i`` after attention: output projection, residual, MLP, residual."""
        layer = self.model.layers[i]
        x = x + layer.self_attn.o_proj(attention.flatten(1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward_dense(self, token_ids: Tensor) -> Tensor:
        """Run one sequence from scratch, no cache: float32 logits ``[n, vocab_size]``.

        Every projection runs on its own (the paged forward fuses q/k/v and gate/up), so the
        tests' comparison checks the fusion too."""
        c = self.config
        x = self.model.embed_tokens(token_ids)
        cos, sin = self._rotary(torch.arange(len(token_ids), device=token_ids.device))
        for layer in self.model.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rotate(attn.q_proj(h).view(-1, c.num_heads, c.head_dim), cos, sin)
            k = _rotate(attn.k_proj(h).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
            v = attn.v_proj(h).view(-1, c.num_kv_heads, c.head_dim)
            x = x + attn.o_proj(prefill_attention(q, k, v).flatten(1))
            mlp, h = layer.mlp, layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.logits_of(x)

    def logits_of(self, x: Tensor) -> Tensor:
        """float32 logits of hidden states ``[n, hidden]``: the final norm, then the output
        projection (the tied embedding when there is no ``lm_head``)."""
        h = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    # -- internals -------------------------------------------------------------------------

    def _rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def _inv_freq(c: ModelConfig, device: torch.device) -> Tensor:
    d = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if c.rope_scaling:
        # Llama 3: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between.
        s = dict(c.rope_scaling)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(
            wavelen > old / low, inv / factor, torch.where(wavelen < old / high, inv, scaled)
        )
    return inv.to(device) if device.type != "meta" else inv.to("meta")


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def prefill_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One sequence's chunk: q ``[n, Hq, D]``, the last n of ctx positions, over k, v ``[ctx,
    Hkv, D]``, causally (query i sees positions up to ``ctx - n + i``). Returns ``[n, Hq, D]``.

    The causal mask is aligned to the bottom right and query heads share KV heads
    (``enable_gqa``), both inside the kernel: on CUDA that is flash attention, which splits a
    long context across thread blocks (``flash_fwd_splitkv``). With an explicit mask and K/V
    repeated to every query head instead, the piecewise pass of 64 new tokens over 8,128
    cached took 5.8-6.1 ms against 3.0-3.6 (``docs/gpu.md``).

    On CUDA in half precision the flash kernel is called by name. Through the dispatcher a
    chunk from position 0 (as many queries as keys) is plain causal attention, for which
    SDPA may choose cuDNN, whose plan is built per sequence length on the host: on the
    packaged trace's varied cold prompts that was about a third of a pass's host time
    (``docs/gpu.md``, "Where an iteration's time goes")."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0:
        # Flash's causal mask is bottom-right: the same as top-left for a square.
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0,
            True)[0][0].transpose(0, 1)
    mask = causal_lower_right(q.shape[0], k.shape[0])
    # Batched 4-D inputs: the fused (flash, memory-efficient) kernels refuse 3-D ones, and the
    # math fallback materialises the whole [heads, n, ctx] score matrix.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def load_checkpoint(model: Decoder, folder: Path) -> None:
    """Load every ``*.safetensors`` file of ``folder`` into ``model`` (Hugging Face names).

    Raises:
        ValueError: no safetensors file, or a missing or unexpected weight.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(read_safetensors(file, model.device, model.dtype))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.lm_head is None:
        state.pop("lm_head.weight", None)
    expected = {name for name, _ in model.named_parameters()}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match a Llama-style decoder: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.shape != state[name].shape:
                raise ValueError(
                    f"{folder}: {name} has shape {tuple(state[name].shape)}, "
                    f"config says {tuple(param.shape)}"
                )
            param.copy_(state[name])
