"""The ``kvroute`` command: one entry point, one subcommand per job.

Each subcommand's module is imported only when it runs, so ``kvroute events`` works without the
router's web stack loaded and the worker never imports the router (they meet on the wire).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvroute import __version__
from kvroute.argtypes import non_negative_int, port_range, positive_int
from kvroute.help_defaults import field_defaults, formatter_showing

#: The one way into the benchmarks: imported only when ``kvroute bench`` runs.
BENCH_ENTRY = "bench.cli"


def _worker_defaults() -> dict[str, Any]:
    from workers.settings import WorkerSettings

    return field_defaults(WorkerSettings)


def _router_defaults() -> dict[str, Any]:
    from kvroute.epp import DEFAULT_GRPC_PORT
    from router.settings import RouterSettings

    return {**field_defaults(RouterSettings), "grpc_port": DEFAULT_GRPC_PORT}


def _up_defaults() -> dict[str, Any]:
    from router.settings import RouterSettings

    return {"port": RouterSettings().port}


def _tail_defaults() -> dict[str, Any]:
    from router.events.transport import DEFAULT_MAX_MESSAGE_BYTES

    return {"max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES}


def _add_events(sub: argparse._SubParsersAction) -> None:
    events = sub.add_parser("events", help="inspect KV event streams")
    esub = events.add_subparsers(dest="events_command", required=True)
    tail = esub.add_parser(
        "tail", formatter_class=formatter_showing(_tail_defaults),
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
    tail.add_argument("--curve-secret-key", metavar="FILE",
                      help="subscribe over CURVE with this secret certificate (a router's; "
                      "needs --curve-server-key)")
    tail.add_argument("--curve-server-key", metavar="FILE",
                      help="the engine's public certificate")
    tail.add_argument("--max-message-bytes", type=positive_int, metavar="N",
                      help="largest message taken (default %(default)s)")


def _add_http_limits(a: Callable[..., Any], what: str) -> None:
    a("--insecure-no-auth", action="store_const", const=True,
      help=f"serve the {what}'s admin endpoints without a token on a non-loopback address "
      "(refused otherwise: anyone who reaches the port could use them)")
    a("--max-connections", type=positive_int,
      help="open connections at most; a request past them is answered 503 "
      "(default %(default)s)")
    a("--header-timeout", type=float,
      help="seconds a connection has to send a request's headers (default %(default)s)")
    a("--keep-alive-timeout", type=float,
      help="seconds an idle kept-alive connection stays open (default %(default)s)")
    a("--max-header-bytes", type=positive_int,
      help="largest request line and headers; larger is refused with 431 "
      "(default %(default)s)")
    a("--body-timeout", type=float,
      help="seconds a request body has to arrive whole; then 408 (default %(default)s)")
    a("--body-idle-timeout", type=float,
      help="longest pause, in seconds, while a request body arrives; then 408 "
      "(default %(default)s)")
    a("--max-body-bytes", type=positive_int,
      help="largest request body; a larger one is refused with 413 as it arrives "
      "(default %(default)s)")


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one bundled engine worker (OpenAI API + KV events)",
                       formatter_class=formatter_showing(_worker_defaults),
                       description="Runs one engine worker: a paged KV cache, an engine (sim by "
                       "default), its OpenAI-compatible HTTP API and its KV event stream. "
                       "Every flag also reads KVROUTE_WORKER_<NAME> from the environment.")
    serving, engine = p.add_argument_group("serving"), p.add_argument_group("engine")
    events, images = p.add_argument_group("KV events"), p.add_argument_group("images")
    torch, logs = p.add_argument_group("torch engine"), p.add_argument_group("logging and tracing")
    a = serving.add_argument
    a("--host", help="HTTP bind address (default %(default)s)")
    a("--port", type=int, help="HTTP port (default %(default)s)")
    a = events.add_argument
    a("--events-host", help="address the event sockets bind (default %(default)s); off "
      "loopback it needs CURVE keys or --insecure-events")
    a("--insecure-events", action="store_const", const=True,
      help="publish KV events off loopback without CURVE (anyone who reaches the event ports "
      "reads the token ids of every cached prompt)")
    a("--events-port", type=int, help="KV event PUB port (default %(default)s)")
    a("--replay-port", type=int, help="KV event replay ROUTER port (default %(default)s)")
    a("--topic", help="topic frame of every event batch (default %(default)s)")
    a("--data-parallel-rank", type=int, help="this worker's rank; shifts both event ports")
    a("--data-parallel-size", type=int,
      help="sim engines in this process, each with its own KV cache, behind one port; events "
      "name their rank, X-data-parallel-rank pins a request to one (default %(default)s)")
    a("--kv-bytes-per-token", type=int,
      help="sim engine, disaggregated serving: KV bytes per token a transfer moves "
      "(default %(default)s)")
    a("--kv-transfer-bandwidth", type=float,
      help="sim engine, disaggregated serving: bytes per second a KV transfer moves "
      "(default %(default)s)")
    a("--kv-lease-seconds", type=float,
      help="disaggregated serving: seconds a prefill's blocks are held for a decode worker "
      "that has not taken them (default %(default)s, vLLM's)")
    a("--kv-transfer-secret-file", metavar="PATH",
      help="peer KV transfer: read the secret shared by the router and every worker from "
      "this file (at least 16 bytes; env KVROUTE_KV_TRANSFER_SECRET_FILE). Without one, KV "
      "is served to and fetch instructions taken from loopback peers of a loopback bind only")
    a("--kv-fetch-timeout", type=float,
      help="peer KV fetch: seconds one fetch may take before the request computes its "
      "prompt itself (default %(default)s)")
    a("--kv-fetch-concurrency", type=int,
      help="peer KV fetch: fetches this worker runs at once (default %(default)s)")
    a("--kv-read-concurrency", type=int,
      help="peer KV fetch: block reads this worker serves at once; one past them is "
      "answered 503 (default %(default)s)")
    a("--kv-fetch-bandwidth", type=float, metavar="BYTES_PER_S",
      help="peer KV fetch: bytes per second an HTTP fetch moves to or from this worker, "
      "advertised to routers for a pair's first fetch (default: the torch engine's measured "
      "0.25e9; the sim engine's --kv-transfer-bandwidth times --speedup)")
    a("--no-kv-fetch-ipc", dest="kv_fetch_ipc", action="store_false", default=None,
      help="peer KV fetch: never copy blocks over CUDA IPC between torch workers on one GPU "
      "(used only with --kv-transfer-secret-file; blocks then travel over HTTP)")
    a = engine.add_argument
    a("--engine", choices=["sim", "torch"], help="sim (no GPU) or torch (default %(default)s)")
    a("--model", help="served model name (default %(default)s); with --engine torch also the "
      "weights (tiny, llama-1b or a folder) unless --torch-model says otherwise")
    a("--tokenizer", help="local tokenizer.json or its folder (default: byte-level)")
    a("--block-size", type=int, help="tokens per KV block (default %(default)s)")
    a("--num-blocks", type=int, help="device KV blocks (default %(default)s)")
    a("--host-blocks", type=int, help="host-tier KV blocks, 0 for none (default %(default)s)")
    a("--max-num-batched-tokens", type=int,
      help="tokens per engine iteration (default %(default)s)")
    a("--max-num-seqs", type=int, help="running requests at most (default %(default)s)")
    a("--short-prefill", type=int, metavar="TOKENS",
      help="prefills with at most TOKENS left go ahead of longer ones, which leave TOKENS of "
      "an iteration to waiting requests; 0 for first come, first served (default %(default)s)")
    a("--short-pass-tokens", type=int, metavar="TOKENS",
      help="with --short-prefill: the most tokens longer prefills take in an iteration that "
      "ends another prompt's prefill; 0 for no cap (default %(default)s)")
    a("--max-model-len", type=int,
      help="prompt + output tokens at most (default %(default)s)")
    a("--speedup", type=float,
      help="sim engine: divide modelled time by this (default %(default)s)")
    a("--timing", help="sim engine's cost model (default %(default)s): measured (the H200 "
      "calibration with attention over cached K/V priced as kernels measured on an H200), "
      "paged (only decode priced so), or calibrated (the calibration as fitted)")
    a("--mm-tokens-per-image", type=int,
      help="placeholder positions per image (default %(default)s)")
    a("--lora", dest="loras", action="append", help="serve a LoRA adapter by this name")
    a = serving.add_argument
    a("--admin-token", help="bearer token for reset, snapshot and fault injection (visible "
      "in ps: prefer --admin-token-file or KVROUTE_WORKER_ADMIN_TOKEN)")
    a("--admin-token-file", metavar="PATH", help="read the admin token from this file")
    _add_http_limits(a, "worker")
    a = events.add_argument
    a("--replay-buffer", type=int,
      help="event batches kept for replay (default %(default)s)")
    a("--max-pending-stored", type=int,
      help="stored entries per event batch at most (default %(default)s)")
    a("--no-events", dest="events_port", action="store_const", const="none",
      help="publish no KV events")
    a("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
      help="never reuse KV blocks (and publish no events)")
    a = images.add_argument
    a("--no-images", dest="images", action="store_false", default=None,
      help="refuse image parts")
    a("--allow-image-hosts", metavar="CIDR|HOST,...",
      help="image URLs may reach these CIDR blocks or host names even when internal "
      "(default: none; loopback, private, link-local, multicast and unspecified addresses "
      "are refused)")
    a("--max-images-per-request", type=int,
      help="image parts a chat request may carry; more is a 400 (default %(default)s)")
    a("--max-image-request-bytes", type=int,
      help="fetched image bytes per request, all its images together; more is a 400 "
      "(default %(default)s)")
    a("--max-image-fetch-bytes", type=int,
      help="fetched image bytes in flight across all requests; a request past them is a "
      "503 (default %(default)s)")
    a("--max-image-read-ahead-bytes", type=int,
      help="a request's fetched image bytes not yet hashed, at most; its fetches wait "
      "beyond them, at least one image and 128 KiB (default %(default)s)")
    a("--no-image-hints", dest="image_hints", action="store_false", default=None,
      help="publish no image UUID routing hints")
    a = events.add_argument
    a("--curve-secret-key", metavar="FILE",
      help="encrypt the event and replay ports with CURVE: this worker's secret certificate "
      "(kvroute keys generate); needs --curve-authorized-clients")
    a("--curve-authorized-clients", metavar="DIR",
      help="folder of the public certificates (*.key) of the routers allowed to subscribe")
    a("--salt-secret", help="cluster secret that keys published cache-salt tags "
      "(HMAC-SHA256); routers need the same (default: unkeyed SHA-256 tags)")
    a("--salt-secret-file", metavar="FILE", help="read --salt-secret from FILE")
    a = torch.add_argument
    a("--torch-model", help="torch engine: tiny, llama-1b or a local weights folder "
      "(default %(default)s, or --model's weights)")
    a("--device", help="torch engine: cuda, cpu or auto (default %(default)s)")
    a("--gpu-memory-utilization", type=float,
      help="torch engine on CUDA: the share of the device's memory this worker may take, "
      "weights, the worst iteration (profiled at start), CUDA graphs and KV cache together "
      "(default %(default)s; e.g. 0.22 each for 4 workers on one GPU)")
    a("--kv-memory-gb", "--kv-memory", dest="kv_memory_gb", type=float,
      help="torch engine: GiB of KV cache (default: what the --gpu-memory-utilization share "
      "leaves; refused at start if it does not fit beside the rest)")
    a("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
      help="torch engine on CUDA: run every pass eagerly, not as replayed CUDA graphs "
           "(whole decode passes; per-layer pieces of passes with prefill), and skip their "
           "capture at start (seconds, and a few GiB of graph memory)")
    a = logs.add_argument
    a("--log-level", help="debug, info, warning (default %(default)s)")
    a("--log-format", choices=["text", "json"],
      help="text: one readable line; json: one JSON object a line (default %(default)s)")
    a("--tracing", choices=["on", "off"],
      help="export a span per generation request over OTLP, a child of the router's "
      "traceparent (default: on when OTEL_EXPORTER_OTLP_ENDPOINT is set; needs the otel extra)")


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the KV-aware router in front of workers",
                       formatter_class=formatter_showing(_router_defaults),
                       description="Runs the router: an OpenAI-compatible endpoint that sends "
                       "each request to the worker holding its prefix, weighed against load. "
                       "Every flag also reads KVROUTE_<NAME> from the environment.")
    _add_router_flags(p)


def _add_epp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("epp", formatter_class=formatter_showing(_router_defaults),
                       help="run the router's decision as a Gateway API Inference "
                       "Extension endpoint picker (Envoy ext_proc over gRPC)",
                       description="Serves envoy.service.ext_proc.v3.ExternalProcessor and "
                       "grpc.health.v1 on --grpc-port: Envoy sends each request's headers and "
                       "buffered body, the EPP names the worker the router would choose in "
                       "the x-gateway-destination-endpoint header. Takes the router's flags "
                       "(--port is unused). Every flag also reads KVROUTE_<NAME> from the "
                       "environment.")
    p.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                   help="gRPC port (default %(default)s, or KVROUTE_EPP_GRPC_PORT)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics, /ready and /health over HTTP here "
                   "(default: not served)")
    _add_router_flags(p)


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    workers, serving = p.add_argument_group("workers"), p.add_argument_group("serving")
    routing = p.add_argument_group("routing (each flag's effect: docs/routing.md)")
    events = p.add_argument_group("event plane")
    health = p.add_argument_group("health and failover")
    logs = p.add_argument_group("logging")
    a = workers.add_argument
    a("--worker", dest="workers", action="append", metavar="URL[,KEY=VALUE...]",
      help="a worker's base URL, then its options: engine=kvroute|vllm|sglang|trtllm, "
      "events=tcp://HOST:PORT, replay=tcp://HOST:PORT, block_size=N (repeatable; also "
      "KVROUTE_WORKERS='URL,engine=vllm,events=...;URL2'; docs/engines.md)")
    a("--discover", action="append", metavar="TARGET",
      help="find workers: dns:///NAME:PORT is one worker per address NAME resolves to, "
      "re-resolved every --discover-interval seconds (a Kubernetes headless Service); "
      "k8s://NAMESPACE/LABEL-SELECTOR[?port=NAME] watches the EndpointSlices the selector "
      "matches, one worker per ready endpoint on the named (or only) port, from the pod's "
      "service account or a kubeconfig (docs/kubernetes.md); repeatable")
    a("--discover-interval", type=float,
      help="seconds between DNS look-ups (default %(default)s)")
    a = serving.add_argument
    a("--config", help="a TOML or JSON file of settings")
    a("--host", help="bind address (default %(default)s)")
    a("--port", type=int, help="port (default %(default)s)")
    a = workers.add_argument
    a("--block-size", type=int, help="must equal the workers' (default %(default)s)")
    a("--tokenizer", help="must be the workers' tokenizer (default: byte-level)")
    a("--tokenize", choices=["match", "full"],
      help="match (default): tokenize by cached segments, only as far as some worker holds "
      "the prompt, estimating the rest's length; full: every token of every prompt")
    # Routing: each flag and its reason in docs/routing.md.
    a = routing.add_argument
    a("--policy", choices=["kv", "dynamo", "round_robin", "random"],
      help="kv: the worker with the least predicted time to first token; dynamo: NVIDIA "
      "Dynamo's cost rule; round_robin or random ignore the cache (baselines) "
      "(default %(default)s)")
    a("--rates", metavar="prefill=S,context=S,decode=S,onboard=S,first=S",
      help="every worker's rates by hand, in seconds per token (context: per new x cached "
      "token pair; first: a first token's fixed part); they are then not learned "
      "(default: each engine kind's, learned from observed first tokens)")
    a("--learn-rates", choices=["on", "off"],
      help="learn each engine kind's rate factor from the first tokens its workers deliver "
      "(default %(default)s)")
    a("--sessions", choices=["on", "off"],
      help="follow conversations, for /metrics and /debug/route (default %(default)s)")
    a("--predict-ttl", type=float,
      help="seconds a routed prompt counts as cached on its worker before its events arrive "
      "(default %(default)s)")
    a("--ttft-slo", type=float, metavar="SECONDS",
      help="the time to first token clients accept: when no worker is idle, send each "
      "request to the worker with the least prefill to do among those predicted to answer "
      "within it (the most of the prompt cached), the soonest otherwise (default: none, "
      "the soonest with the prefill passed on)")
    a("--kv-fetch", choices=["auto", "off"],
      help="peer KV fetch: auto lets a worker fetch a prompt's leading blocks from a peer "
      "holding them instead of recomputing them, where both advertise it in /model_info and "
      "it is priced cheaper (docs/peer_fetch.md); off never (default %(default)s)")
    a("--kv-transfer-secret-file", metavar="PATH",
      help="peer KV transfer: read the secret shared by the router and every worker from "
      "this file (at least 16 bytes; env KVROUTE_KV_TRANSFER_SECRET_FILE). Without one, a "
      "fetch is priced only between workers on loopback")
    # Flow control: saturation, the queue, deadlines and fairness (docs/flow_control.md).
    a("--flow-control", choices=["on", "off"],
      help="hold requests in the router while every worker is saturated, most urgent first, "
      "fair between tenants, refusing (429) what cannot meet its deadline (default on)")
    a("--flow-ttft-bound", type=float, metavar="SECONDS",
      help="a worker whose queued work would hold a new request's first token longer than "
      "this is saturated (default %(default)s)")
    a("--flow-kv-threshold", type=float, metavar="SHARE",
      help="a worker whose routed requests hold more than this share of its KV blocks is "
      "saturated; 0: not checked (default %(default)s)")
    a("--flow-max-queue", type=int, help="requests the router holds at most (default "
      "%(default)s); a full queue sheds its least urgent")
    a("--flow-max-wait", type=float, metavar="SECONDS",
      help="seconds a request waits in the router at most (default %(default)s)")
    a("--flow-seq-gate", choices=["on", "off"],
      help="send a request to a worker only while it runs fewer sequences than its "
      "max_num_seqs (learned from a stock engine's running/waiting counts); the rest wait "
      "in the router, most urgent first (default on)")
    a("--flow-urgent-share", type=float, metavar="SHARE",
      help="share of each worker's sequences (at least one) a request less urgent than "
      "priority 0 leaves free for more urgent ones; 0: none (default %(default)s)")
    a("--flow-ttft-budget", type=float, metavar="SECONDS",
      help="seconds to its first token a request that must wait may take when no deadline "
      "is set for it; one predicted (its wait at the fleet's measured pace, plus its TTFT) "
      "past it is refused at once with 429 and Retry-After; 0: none (default %(default)s)")
    a("--flow-deadlines", metavar="PRIORITY=SECONDS,...",
      help="a TTFT deadline per priority (the x-kvroute-ttft-deadline-ms header overrides)")
    a("--tenant-weights", metavar="TENANT=WEIGHT,...",
      help="each tenant's share of tokens inside its priority (one when not named)")
    a("--trusted-clients", metavar="CIDR,...",
      help="peers whose tenant, priority and deadline headers (and body priority) flow "
      "control believes: addresses or CIDR blocks, 'any' or 'none'; from others they are "
      "ignored (default %(default)s)")
    a("--objective-priorities", metavar="NAME=PRIORITY,...",
      help="the priority of each InferenceObjective a request names in the "
      "x-gateway-inference-objective header, as its spec.priority reads (higher first)")
    a = serving.add_argument
    a("--admin-token", help="bearer token for /workers and /debug/* (visible in ps: prefer "
      "--admin-token-file or KVROUTE_ADMIN_TOKEN)")
    a("--admin-token-file", metavar="PATH", help="read the admin token from this file")
    a = events.add_argument
    a("--worker-admin-token", help="bearer token the workers want for /kv/snapshot")
    a("--event-max-message-bytes", type=int,
      help="largest event message taken from a worker; a connection carrying a larger one "
      "is dropped, counted and reopened (default %(default)s)")
    a("--event-receive-hwm", type=int,
      help="event messages queued per socket at most; more are dropped and recovered by "
      "replay (default %(default)s)")
    a("--curve-secret-key", metavar="FILE",
      help="subscribe over CURVE: this router's secret certificate (kvroute keys generate); "
      "needs --curve-server-key")
    a("--curve-server-key", metavar="FILE",
      help="the workers' public certificate (the .key of their --curve-secret-key)")
    a("--salt-secret", help="cluster secret the workers key cache-salt tags with "
      "(their --salt-secret)")
    a("--salt-secret-file", metavar="FILE", help="read --salt-secret from FILE")
    a("--worker-admin-token-file", metavar="PATH",
      help="read the workers' admin token from this file")
    _add_http_limits(serving.add_argument, "router")
    a = health.add_argument
    a("--health-interval", type=float, help="seconds between load polls (default %(default)s)")
    a("--health-timeout", type=float,
      help="seconds a load poll may take before it counts as late (default %(default)s)")
    a("--health-misses", type=positive_int,
      help="late load polls in a row, with no bytes from the worker on its streams meanwhile, "
      "that take a worker out (default %(default)s)")
    a("--first-byte-floor", type=float,
      help="shortest wait for a stream's first byte before it is retried elsewhere "
      "(default %(default)s)")
    a("--first-byte-factor", type=float,
      help="a stream's first byte may take this many times the prefill the router expects "
      "there before it is retried elsewhere (default %(default)s)")
    a("--pd-local-prefill-tokens", type=int,
      help="disaggregated serving: a decode worker with at most this many prompt tokens "
      "uncached prefills locally, no remote prefill (default %(default)s)")
    a("--pd-prefill-timeout", type=float,
      help="seconds a remote prefill may take before the request is served whole on its "
      "decode worker (default %(default)s)")
    a("--pd-kv-bytes-per-token", type=positive_int,
      help="disaggregated serving: KV bytes of one token, for the predicted transfer time "
      "(default %(default)s)")
    a("--pd-transfer-bandwidth", type=float,
      help="disaggregated serving: the prefill-to-decode link in bytes a second, for the "
      "predicted transfer time (default %(default)s)")
    a("--allow-client-transfer-fields", action="store_const", const=True,
      help="take kv_transfer_params, SGLang's bootstrap fields and the X-data-parallel-rank "
      "header from clients (refused with 400, the header dropped, otherwise: the router "
      "sets them itself)")
    a("--first-byte-timeout", type=float,
      help="longest wait for any answer's first byte (default %(default)s)")
    a("--unhealthy-grace", type=float,
      help="seconds before an unhealthy worker's entries go (default %(default)s)")
    a = routing.add_argument
    a("--seed", type=int, help="seed for tie-breaking")
    a = logs.add_argument
    a("--log-level", help="debug, info, warning (default %(default)s)")
    a("--log-format", choices=["text", "json"],
      help="text: one readable line; json: one JSON object a line (default %(default)s)")
    _add_extension_flags(p)


def _add_extension_flags(p: argparse.ArgumentParser) -> None:
    """Client API keys, the autoscaling signal and tracing (docs/operations.md)."""
    a = p.add_argument_group("API keys, autoscaling, tracing").add_argument
    a("--api-keys-file", metavar="FILE",
      help="require an API key on /v1/*: one salted hash a line, as 'kvroute keys hash' "
      "prints them (or the lines in KVROUTE_API_KEYS, ';' between them; default: open)")
    a("--api-key-tokens-per-minute", type=non_negative_int, metavar="TOKENS",
      help="prompt tokens a minute for a key whose line sets no tpm=; 0: no limit "
      "(default %(default)s)")
    a("--demand-window", type=float, metavar="SECONDS",
      help="seconds the uncached prompt tokens routed are averaged over for "
      "kvroute_prefill_demand_ratio (default %(default)s)")
    a("--tracing", choices=["on", "off"],
      help="export a span per request over OTLP to OTEL_EXPORTER_OTLP_ENDPOINT, OTLP/HTTP "
      "unless OTEL_EXPORTER_OTLP_PROTOCOL=grpc (default: on when that variable is set; "
      "needs the otel extra)")


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the router and N sim workers on this machine",
                       formatter_class=formatter_showing(_up_defaults),
                       description="Starts N simulated workers and the router on 127.0.0.1 "
                       "(free ports), waits until ready, prints the endpoint, and stops them "
                       "all on Ctrl-C or SIGTERM.")
    p.add_argument("--workers", type=positive_int, default=3,
                   help="sim workers (default %(default)s)")
    p.add_argument("--port", type=int,
                   help="router port (default KVROUTE_PORT, else %(default)s, the router's; "
                   "0: any)")
    p.add_argument("--worker-ports", type=port_range, metavar="LOW-HIGH",
                   help="the workers' ports, three each (HTTP, events, replay), taken in "
                   "order from this range (default: free ports in 20000-32767)")
    p.add_argument("--worker-arg", action="append", metavar="FLAG",
                   help="extra flag for every worker, e.g. --worker-arg=--speedup=10")
    p.add_argument("--router-arg", action="append", metavar="FLAG",
                   help="extra flag for the router")
    p.add_argument("--log-dir", help="write each child's output to DIR/<name>.log")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for ready (default %(default)s)")
    p.add_argument("--status-interval", type=float, default=10.0,
                   help="seconds between status lines (default %(default)s)")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="the router's and workers' log format (default text)")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvroute", description="kvroute: a KV-aware router for LLM serving, its bundled "
        "workers and tools; one subcommand per job.")
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_events(sub)
    _add_worker(sub)
    _add_router(sub)
    _add_epp(sub)
    _add_up(sub)
    from kvroute.keys import add_keys_parser

    add_keys_parser(sub)
    _add_bench(sub)
    return parser


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Everything after "bench" goes to the benchmarks' own parser (BENCH_ENTRY), help included.
    p = sub.add_parser("bench", add_help=False, help="benchmarks: trace replay over routing "
                       "policies ('kvroute bench --help' lists them)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvroute`` command line; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":  # the benchmark's flags are its own parser's to judge
        bench: Any = importlib.import_module(BENCH_ENTRY)
        return int(bench.main([*unknown, *args.bench_args]))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "events":
        from kvroute.events_tail import run_tail

        if args.from_seq is not None and not args.replay:
            print("kvroute events tail: --from-seq needs --replay", file=sys.stderr)
            return 2
        if (args.curve_secret_key is None) != (args.curve_server_key is None):
            print("kvroute events tail: --curve-secret-key and --curve-server-key go together",
                  file=sys.stderr)
            return 2
        return run_tail(args)
    if args.command == "keys":
        from kvroute.keys import run_keys

        return run_keys(args)
    if args.command == "up":
        from kvroute.up import run_up

        return run_up(args)
    if args.command == "epp":
        from kvroute.epp import serve_epp

        return serve_epp(args)
    if args.command in ("worker", "router"):
        from kvroute.serve import serve

        return serve(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
