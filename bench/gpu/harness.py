"""What the engine benchmarks share: the block size, timing by median with device
synchronisation, CUDA-graph replay, the copy bandwidth, plans built by hand, and operator
profiles."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from openai_request.tokenizer import ByteTokenizer
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import DecodeStep, IterationPlan, PrefillChunk
from workers.settings import WorkerSettings
from workers.torch.engine import TorchExecutor, build_torch_executor

BS = 32


def sync() -> None:
    """Wait for the CUDA device, where there is one."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Any, repeats: int) -> float:
    """Median ms of ``repeats`` calls of ``fn`` after one warm-up, the device synchronised
    around each."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def chunk(rid: str, blocks: Sequence[int], tokens: Sequence[int], start: int) -> PrefillChunk:
    return PrefillChunk(
        rid,
        tuple(blocks),
        start,
        len(tokens) - start,
        tuple(tokens[start:]),
        (),
        True,
        0,
        Prompt(tuple(tokens)),
    )


def plan_of(prefill: Sequence[PrefillChunk] = (),
            decode: Sequence[DecodeStep] = ()) -> IterationPlan:
    """An iteration of these chunks and steps, with no copies."""
    return IterationPlan(0, tuple(prefill), tuple(decode), (), ())


def executor(args: argparse.Namespace, cache: CacheManager) -> TorchExecutor:
    s = WorkerSettings(
        engine="torch", torch_model=args.model, device=args.device, block_size=BS, seed=0
    )
    return build_torch_executor(s, ByteTokenizer(), cache)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 260) for _ in range(n)]


def copy_bandwidth(device: Any, gib: int = 4) -> float:
    """Bytes/s of a device-to-device copy of ``gib`` GiB, bytes read plus written."""
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * (gib << 30) / (ms / 1e3)


def graphed(fn: Any) -> Any:
    """``fn`` captured as a CUDA graph (after two warm-up calls); returns its replay: device
    time without the host's launches, as the worker's decode graphs run attention."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def print_profiles(ex: TorchExecutor, plans: dict[str, IterationPlan]) -> None:
    """Print the device and host time of each pass's top operators."""
    from torch.profiler import ProfilerActivity, profile

    for name, plan in plans.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ex.run(plan)
        print(f"# profile {name}", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12), flush=True)
