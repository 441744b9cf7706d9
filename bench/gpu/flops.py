"""The arithmetic of a prefill, and the floor it puts under a window's prompt throughput:
``python -m bench.gpu.flops [--trace FIRST:COUNT | --generator long_context:SEED:COUNT]
[--model llama-1b] [--matmul-tflops 780] [--attention-tflops 383] [--max-model-len 65536]``.

A token through the decoder costs its projections and MLP, ``2 x`` the layers' weights
(:func:`linear_flops`), plus its attention over every earlier position of its sequence:
``4 x head_dim x query heads x layers`` a (query, key) pair, QK^T and PV
(:func:`attention_flops`). A prompt of ``n`` cold tokens has ``n (n + 1) / 2`` pairs, so its
attention grows with its square: for llama-1b the two are equal at about 15k tokens, and the
packaged trace's first 70 requests (mean 12,950 tokens, almost all cold) spend half of their
arithmetic in attention.

The floor is that arithmetic at given rates: the window's linear FLOPs over the matrix
products' rate plus its attention FLOPs over attention's, every token computed (no hit), no
other kernel, nothing idle. The defaults are the rates the H200 ran them at inside the
worker's own passes on that trace (``python -m bench.gpu.mix --configs 1:off --workload
trace:0:400 --chunks 8192 --load 1.5``, profiled 8,192-token passes, each pass's arithmetic
from its plan over its kernels' time): 774-784 TFLOP/s for the matrix products and 381-385
for attention (cuDNN's bulk and flash's tail and squares together). Against the floor, a
measured throughput says how much of the device time went to what the floor leaves out
(norms, rotary, copies, decode steps, idle time); against the datasheet's 989 dense bf16
TFLOP/s, how much faster kernels could still buy. The figures are in ``docs/gpu.md`` ("The
arithmetic floor of the packaged trace").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from workers.torch.shapes import CONFIGS, ModelConfig

__all__ = ["Floor", "attention_flops", "floor", "linear_flops", "main"]

#: The H200 rates measured in the worker's passes (TFLOP/s; module docstring).
MATMUL_TFLOPS = 780.0
ATTENTION_TFLOPS = 383.0


def linear_flops(c: ModelConfig, tokens: int) -> float:
    """FLOPs of ``tokens`` tokens through every layer's projections and MLP (the output
    projection to the vocabulary left out: a prefill computes it for one token)."""
    h, d, q, kv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    per_layer = h * d * (2 * q + 2 * kv) + 3 * h * c.intermediate_size
    return 2.0 * c.num_layers * per_layer * tokens


def attention_flops(c: ModelConfig, new: int, cached: int = 0) -> float:
    """FLOPs of ``new`` tokens' attention after ``cached`` earlier positions (causal)."""
    pairs = new * cached + new * (new + 1) / 2
    return 4.0 * c.head_dim * c.num_heads * c.num_layers * pairs


@dataclass(frozen=True, slots=True)
class Floor:
    """A window's arithmetic and its floor at the given rates."""

    requests: int
    tokens: int
    linear: float  # FLOPs
    attention: float  # FLOPs
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("inf")

    @property
    def attention_share(self) -> float:
        total = self.linear + self.attention
        return self.attention / total if total else 0.0


def floor(c: ModelConfig, prompts: Iterable[int], matmul_tflops: float = MATMUL_TFLOPS,
          attention_tflops: float = ATTENTION_TFLOPS) -> Floor:
    """The floor of prefilling every prompt (its length in tokens) cold.

    Raises:
        ValueError: a rate that is not positive.
    """
    if matmul_tflops <= 0 or attention_tflops <= 0:
        raise ValueError("rates must be positive TFLOP/s")
    lengths = list(prompts)
    tokens = sum(lengths)
    linear = linear_flops(c, tokens)
    attention = sum(attention_flops(c, n) for n in lengths)
    seconds = linear / (matmul_tflops * 1e12) + attention / (attention_tflops * 1e12)
    return Floor(len(lengths), tokens, linear, attention, seconds)


def _prompts(args: argparse.Namespace) -> list[int]:
    from bench.workloads import GeneratorConfig, generate, load_trace

    if args.generator:
        name, seed, count = _fields(args.generator, "--generator", 3)
        rows = generate(name, GeneratorConfig(requests=int(count)), int(seed))
    else:
        first, count = (int(x) for x in _fields(args.trace, "--trace", 2))
        path = args.trace_file or Path(__file__).resolve().parents[1] / "data" / (
            "mooncake_synthetic_trace.jsonl")
        rows = load_trace(path, limit=first + count)[first:]
    return [r.input_length for r in rows if r.input_length + r.output_length <= args.max_model_len]


def _fields(text: str, flag: str, n: int) -> list[str]:
    parts = text.split(":")
    if len(parts) != n or not all(parts[1:]) or not all(p.isdigit() for p in parts[-(n - 1):]):
        shape = "FIRST:COUNT" if n == 2 else "NAME:SEED:COUNT"
        raise ValueError(f"{flag} must be {shape}, not {text!r}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.flops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--trace", default="0:70", help="FIRST:COUNT of the packaged trace (default 0:70)")
    a("--trace-file", type=Path, default=None)
    a("--generator", default=None, help="NAME:SEED:COUNT of bench.workloads instead")
    a("--model", default="llama-1b", choices=sorted(CONFIGS))
    a("--matmul-tflops", type=float, default=MATMUL_TFLOPS)
    a("--attention-tflops", type=float, default=ATTENTION_TFLOPS)
    a("--max-model-len", type=int, default=65536, help="longer requests are left out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    c = CONFIGS[args.model]
    try:
        prompts = _prompts(args)
        measured = floor(c, prompts, args.matmul_tflops, args.attention_tflops)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        print("error: no request in the window", file=sys.stderr)
        return 2
    window = args.generator or f"trace {args.trace}"
    print(f"{window}: {measured.requests} prompts, {measured.tokens:,} tokens (mean "
          f"{measured.tokens // measured.requests:,}), {measured.linear / 1e15:.2f} PFLOP linear "
          f"+ {measured.attention / 1e15:.2f} PFLOP attention "
          f"({measured.attention_share:.0%} attention)")
    for label, mm, at in (("at the given rates", args.matmul_tflops, args.attention_tflops),
                          ("matrix products alone", args.matmul_tflops, float("inf")),
                          ("attention at the matrix products' rate", args.matmul_tflops,
                           args.matmul_tflops)):
        f = floor(c, prompts, mm, at)
        print(f"  floor {label} ({mm:.0f} / {at:.0f} TFLOP/s): {f.seconds:.2f} s, "
              f"{f.tokens_per_s:,.0f} prompt tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
