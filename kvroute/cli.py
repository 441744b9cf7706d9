"""The ``kvroute`` command: one entry point, one subcommand per job.

Each subcommand's module is imported only when it runs, so ``kvroute events`` works without the
router's web stack loaded and the worker never imports the router (they meet on the wire).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import __version__
from kvroute.argtypes import non_negative_int, positive_int


def _add_events(sub: argparse._SubParsersAction) -> None:
    events = sub.add_parser("events", help="inspect KV event streams")
    esub = events.add_subparsers(dest="events_command", required=True)
    tail = esub.add_parser(
        "tail",
        help="subscribe to an engine's KV events and print each batch, normalised",
        description="Subscribes to any engine that publishes KV events over ZeroMQ (kvroute "
        "workers, vLLM, TensorRT-LLM, SGLang) and prints each batch, normalised, with gaps, "
        "replays and restarts as they happen.",
    )
    tail.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                      help="the engine's PUB endpoint")
    tail.add_argument("--replay", metavar="tcp://HOST:PORT",
                      help="the engine's replay endpoint (enables gap recovery)")
    tail.add_argument("--topic", default="", help="topic prefix (default: everything)")
    tail.add_argument("--from-seq", type=non_negative_int, metavar="N",
                      help="replay from seq N first (needs --replay)")
    tail.add_argument("--count", type=positive_int, metavar="N",
                      help="exit after N batches")
    tail.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="exit with status 3 if nothing arrives for this long")
    tail.add_argument("--json", action="store_true",
                      help="one JSON object a line (default: readable lines)")


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one bundled engine worker (OpenAI API + KV events)",
                       description="Runs one engine worker: a paged KV cache, an engine (sim by "
                       "default), its OpenAI-compatible HTTP API and its KV event stream. "
                       "Every flag also reads KVROUTE_WORKER_<NAME> from the environment.")
    a = p.add_argument
    a("--host", help="HTTP bind address (default 127.0.0.1)")
    a("--port", type=int, help="HTTP port (default 8100)")
    a("--events-host", help="address the event sockets bind (default 127.0.0.1)")
    a("--events-port", type=int, help="KV event PUB port (default 5557)")
    a("--replay-port", type=int, help="KV event replay ROUTER port (default 5558)")
    a("--topic", help="topic frame of every event batch (default empty)")
    a("--data-parallel-rank", type=int, help="this worker's rank; shifts both event ports")
    a("--engine", choices=["sim", "torch"], help="sim (default, no GPU) or torch")
    a("--model", help="served model name (default kvroute-sim); with --engine torch also the "
      "weights (tiny, llama-1b or a folder) unless --torch-model says otherwise")
    a("--tokenizer", help="local tokenizer.json or its folder (default: byte-level)")
    a("--block-size", type=int, help="tokens per KV block (default 32)")
    a("--num-blocks", type=int, help="device KV blocks (default 4096)")
    a("--host-blocks", type=int, help="host-tier KV blocks (default 0: none)")
    a("--max-num-batched-tokens", type=int, help="tokens per engine iteration (default 8192)")
    a("--max-num-seqs", type=int, help="running requests at most (default 256)")
    a("--max-model-len", type=int, help="prompt + output tokens at most (default 65536)")
    a("--speedup", type=float, help="sim engine: divide modelled time by this (default 1)")
    a("--timing", help="sim engine's cost model: measured (default: shared/calibration with "
      "attention over cached K/V priced as kernels measured on an H200), paged (only decode "
      "priced so), or calibrated (the calibration as fitted)")
    a("--mm-tokens-per-image", type=int, help="placeholder positions per image (default 16)")
    a("--lora", dest="loras", action="append", help="serve a LoRA adapter by this name")
    a("--admin-token", help="bearer token for reset, snapshot and fault injection")
    a("--replay-buffer", type=int, help="event batches kept for replay (default 10000)")
    a("--max-pending-stored", type=int, help="stored entries per event batch at most")
    a("--no-events", dest="events_port", action="store_const", const="none",
      help="publish no KV events")
    a("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
      help="never reuse KV blocks (and publish no events)")
    a("--no-images", dest="images", action="store_false", default=None,
      help="refuse image parts")
    a("--no-image-hints", dest="image_hints", action="store_false", default=None,
      help="publish no image UUID routing hints")
    a("--torch-model", help="torch engine: tiny, llama-1b or a local weights folder")
    a("--device", help="torch engine: cuda, cpu or auto (default)")
    a("--kv-memory-gb", "--kv-memory", dest="kv_memory_gb", type=float,
      help="torch engine: GiB of KV cache (default: sized to fit)")
    a("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
      help="torch engine on CUDA: run every pass eagerly, not as replayed CUDA graphs "
           "(whole decode passes; per-layer pieces of passes with prefill), and skip their "
           "capture at start (seconds, and a few GiB of graph memory)")
    a("--log-level", help="debug, info, warning (default info)")


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the KV-aware router in front of workers",
                       description="Runs the router: an OpenAI-compatible endpoint that sends "
                       "each request to the worker holding its prefix, weighed against load. "
                       "Every flag also reads KVROUTE_<NAME> from the environment.")
    a = p.add_argument
    a("--worker", dest="workers", action="append", metavar="URL[,KEY=VALUE...]",
      help="a worker's base URL, then its options: engine=kvroute|vllm|sglang|trtllm, "
      "events=tcp://HOST:PORT, replay=tcp://HOST:PORT, block_size=N (repeatable; also "
      "KVROUTE_WORKERS='URL,engine=vllm,events=...;URL2'; docs/engines.md)")
    a("--config", help="a TOML or JSON file of settings")
    a("--host", help="bind address (default 127.0.0.1)")
    a("--port", type=int, help="port (default 8000)")
    a("--block-size", type=int, help="must equal the workers' (default 32)")
    a("--tokenizer", help="must be the workers' tokenizer (default: byte-level)")
    a("--overlap-weight", type=float, help="prefill vs decode weight (default 32; 1 = Dynamo)")
    a("--queue-weight", help="queued prefill vs own prefill: auto (default: 0.5 while caches "
      "warm up, on at most the blocks the request finds cached there, then by eviction "
      "pressure from 0.25 down to 0.1), or a fixed number")
    a("--queue-cap-blocks", type=float,
      help="queued prefill blocks per worker past the shortest queue counted at the queue "
      "weight, the rest at 1 (default: 3000 under auto, no cap otherwise)")
    a("--admission-weight", type=float,
      help="price of waiting for a sequence slot on a full worker, in prefill blocks "
      "while another has one free (default 1; 0 turns it off)")
    a("--affinity-weight", type=float,
      help="multiplies the overlap weight for a request one worker clearly leads on (a "
      "continuing session, or a prefix only one worker holds); default 4, for engines with "
      "paged decode attention (vLLM, TensorRT-LLM, SGLang); 1 turns it off")
    a("--affinity-lead-blocks", type=int,
      help="blocks the best-matched worker must lead every other by (default 8)")
    a("--session-weight", type=float,
      help="price of a live chat or agent session already on a worker, in prefill blocks, "
      "for a request that does not continue one (default 16; 0 turns it off)")
    a("--session-queue-blocks",
      help="a continuing session stays on its worker unless that worker's queued prefill is "
      "this many blocks past the shortest queue (default 128; off: no stay)")
    a("--pressure-window", type=float,
      help="seconds of cache removals the eviction pressure counts (default 10)")
    a("--predict-ttl", type=float, help="seconds a routed prefix counts resident (default 10)")
    a("--host-credit", type=float, help="host-tier hit credit in [0,1] (default 0.75)")
    a("--temperature", type=float, help="0 picks the cheapest; >0 samples (default 0)")
    a("--policy", choices=["kv", "round_robin", "random"],
      help="kv (default); round_robin or random ignore the cache (baselines)")
    a("--admin-token", help="bearer token for /workers")
    a("--worker-admin-token", help="bearer token the workers want for /kv/snapshot")
    a("--health-interval", type=float, help="seconds between load polls (default 1)")
    a("--unhealthy-grace", type=float, help="seconds before an unhealthy worker's entries go")
    a("--seed", type=int, help="seed for tie-breaking")
    a("--log-level", help="debug, info, warning (default info)")


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the router and N sim workers on this machine",
                       description="Starts N simulated workers and the router on 127.0.0.1 "
                       "(free ports), waits until ready, prints the endpoint, and stops them "
                       "all on Ctrl-C or SIGTERM.")
    p.add_argument("--workers", type=positive_int, default=3, help="sim workers (default 3)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000; 0: any)")
    p.add_argument("--worker-arg", action="append", metavar="FLAG",
                   help="extra flag for every worker, e.g. --worker-arg=--speedup=10")
    p.add_argument("--router-arg", action="append", metavar="FLAG",
                   help="extra flag for the router")
    p.add_argument("--log-dir", help="write each child's output to DIR/<name>.log")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for ready")
    p.add_argument("--status-interval", type=float, default=10.0,
                   help="seconds between status lines")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="kvroute", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_events(sub)
    _add_worker(sub)
    _add_router(sub)
    _add_up(sub)
    from bench.replay import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "events":
        from kvroute.events_tail import run_tail

        if args.from_seq is not None and not args.replay:
            print("kvroute events tail: --from-seq needs --replay", file=sys.stderr)
            return 2
        return run_tail(args)
    if args.command == "bench":
        from bench.replay import run_bench

        return run_bench(args)
    if args.command == "up":
        from kvroute.up import run_up

        return run_up(args)
    if args.command in ("worker", "router"):
        from kvroute.serve import serve

        return serve(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
