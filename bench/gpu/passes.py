"""Mixed passes at the long-context mix's shapes: wall, host issue and device wait per pass.

Run: ``python -m bench.gpu.passes [--repeats 10] [--profile]``.

Each pass is one executor pass (:meth:`TorchExecutor.run`, sampling included) of one prefill
chunk of n new tokens over c cached, beside B decode steps over 11,264-token contexts: the
shapes ``bench.gpu.mix`` saw under the fleet's load (2,030 over 8,192 beside 18 decodes,
inside the 2,048-token bucket; 8,192 over 16,384 beside 24), and a decode-only pass of 24.
Every pass runs in each mode, side by side in one run: ``eager`` (no graphs) and
``piecewise`` (the token bucket's per-layer graphs, attention eager between them), each with
long chunks split into a cuDNN bulk and a flash tail (:mod:`workers.torch.bulk`) and, where
the split runs, without it (``-unsplit``). "Issue" is host time until the pass's work is
queued (``TorchExecutor.last_issue_s``), "wait" the time the host then waits for the device.
``--profile`` prints the host's top Python functions of five passes of each (cProfile, by own
time). Block tables are random blocks of the bench's cache: a timing bench, no request owns
them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections.abc import Sequence

from bench.gpu.harness import BS, random_tokens, sync
from openai_request.tokenizer import ByteTokenizer
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.engine.executor import DecodeStep, IterationPlan, PrefillChunk
from workers.settings import WorkerSettings
from workers.torch import bulk, model
from workers.torch.engine import TorchExecutor, build_torch_executor

#: (name, new tokens, cached tokens, decode steps) of each pass.
SHAPES = (("2030_over_8192_with_18", 2030, 8192, 18),
          ("8192_over_16384_with_24", 8192, 16384, 24),
          ("decode_24", 0, 0, 24))
DECODE_CONTEXT = 11264
BLOCKS = 12288


def _plan(rng: random.Random, new: int, cached: int, decodes: int) -> IterationPlan:
    def blocks(n: int) -> tuple[int, ...]:
        return tuple(rng.sample(range(BLOCKS), -(-n // BS)))

    prefill = []
    if new:
        tokens = random_tokens(rng, cached + new)
        prefill.append(PrefillChunk("chunk", blocks(cached + new), cached, new,
                                    tuple(tokens[cached:]), (), True, 0,
                                    Prompt(tuple(tokens))))
    steps = [DecodeStep(f"d{i}", blocks(DECODE_CONTEXT), DECODE_CONTEXT, 7, 0, Prompt((7,)))
             for i in range(decodes)]
    return IterationPlan(0, tuple(prefill), tuple(steps), (), ())


def _time(ex: TorchExecutor, plan: IterationPlan, repeats: int) -> dict[str, float]:
    ex.run(plan)  # warm-up
    walls, issues, waits = [], [], []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        ex.run(plan)
        sync()
        walls.append((time.perf_counter() - t) * 1e3)
        issues.append(ex.last_issue_s * 1e3)
        waits.append(ex.last_wait_s * 1e3)
    return {"ms": statistics.median(walls), "issue_ms": statistics.median(issues),
            "wait_ms": statistics.median(waits)}


def _profile(ex: TorchExecutor, plan: IterationPlan) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        ex.run(plan)
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.passes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", help="tiny, llama-1b or a folder")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes of each")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    settings = WorkerSettings(engine="torch", torch_model=args.model, device=args.device,
                              block_size=BS, seed=0)
    ex = build_torch_executor(settings, ByteTokenizer(), CacheManager(BLOCKS, BS))
    saved = (ex.piecewise, ex.graphs)
    modes = [("eager", False, True)]
    if ex.piecewise is not None:
        modes.append(("piecewise", True, True))
    if bulk.available(ex.kv.device):
        modes += [(f"{name}-unsplit", graphs, False) for name, graphs, _ in list(modes)]
    rng = random.Random(0)
    for name, new, cached, decodes in SHAPES:
        plan = _plan(rng, new, cached, decodes)
        for mode, graphs, split in modes:
            ex.piecewise, ex.graphs = saved if graphs else (None, None)
            model.SPLIT_CHUNKS = split
            row = {"pass": name, "mode": mode} | _time(ex, plan, args.repeats)
            print(json.dumps(row), flush=True)
            if args.profile:
                print(f"# profile {name} {mode}\n{_profile(ex, plan)}", flush=True)
    model.SPLIT_CHUNKS = True
    ex.piecewise, ex.graphs = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
