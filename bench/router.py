"""Router benchmark: ``python -m bench.router [--json] [--quick] [--workers 8,64,256,1024]
[--decisions-only]``.

Three figures, in one run:

1. ``decision_p50_us`` / ``decision_p99_us``: :meth:`RouterService.decide` end to end
   (tokenize, hash, match, score) for an 8,192-token prompt, with 8 workers (or each count
   ``--workers`` names: ``decision_p99_us_at_1024`` and so on) and 1,000,000 blocks in the
   index, every worker's cache full; half the prompts follow a resident chain for 4,096
   tokens, half share nothing. In process, no sockets. Each decision is booked as the
   router books a request it sends (load, predicted residency, the session head) and then
   finished. The body carries token ids (the router hashes them without checking them
   against the vocabulary; the worker does). A fresh random prompt is built between
   decisions, as a server parses a body, so each decision starts with cold caches.
   ``decision_cpu_*`` count the thread's CPU time alone, the figure to read on a shared
   machine: there a wall-clock p99 is mostly the time the process waited for a core. To
   compare two versions, alternate their runs in one sitting (a checkout of each, the same
   command in turn) and compare CPU figures: the machine's load moves them by half.
2. ``added_p50_ms`` / ``added_p99_ms``: the latency the router adds over calling a worker
   directly, over one kept-alive connection, against a sim worker whose model costs nothing
   (``--speedup 1e9``, ``max_tokens`` 1): router p50 minus direct p50 (and p99 likewise).
3. ``router_rps``: requests per second one router process sustains with 16 connections in
   flight, against 2 such workers; ``worker_rps`` is one worker alone under the same load,
   for scale (on 2 cores the load generator, the router and the workers share the CPU).
   ``router_cpu_us_per_request``: the router process's CPU time (user plus system) over that
   run, per request: the figure to compare on a loaded machine, where the rates move with
   whatever else runs.

Targets (2-core machine): decision p99 <= 200 µs at 8 workers and <= 300 µs at 1,024; added
p50 <= 0.6 ms and p99 <= 2 ms; >= 2,000 requests/s through one router with 16 connections.

What the measurements taught (all on this 2-core machine, other jobs running at times):

- Decision time was tokenization, not the index: an 8k-token id prompt validated in a Python
  loop cost ~1.1 ms; validating it with ``msgspec.convert`` and a constrained int type, and
  shifting UTF-8 bytes to byte-tokenizer ids with ``bytes.translate`` (UTF-8 never holds bytes
  above 0xF4, so a 4-shift table is exact) brought ``decide`` to ~130 µs p50; hashing the token
  list in place for text-only prompts took p99 from 240 to ~190 µs. The index match itself is a
  few µs (``bench.index``).
- Serving: uvloop + httptools under uvicorn took one worker from ~1,400 to ~2,000 req/s and
  the router from ~610 to ~900 with the Python load generator; that generator itself eats a
  core, so figures come from ``wrk`` when it is installed (worker ~3,700, router ~1,400-1,850).
- A py-spy profile of the router under load: aiohttp's client 48% (18% in the socket write
  itself), our code 22%, uvicorn 14%, Starlette/FastAPI 14%. Plain Starlette routes for the two
  hot endpoints and request ids without ``uuid4`` (a urandom syscall each) gave ~10%. What is
  left is mostly the four socket syscalls a proxied request needs.
- A lean HTTP/1.1 client on asyncio *streams* (+ httptools, one write per request) lost to
  aiohttp's client on this machine, measured in one run with the order swapped: 2,032-2,246
  against 2,629-2,763 req/s, added p50 0.60 against 0.55 ms: asyncio's stream layer
  (``StreamReader``, ``readuntil``) cost more than aiohttp's objects saved. The client the
  proxy uses now (:mod:`router.http.upstream`) is an ``asyncio.Protocol`` fed straight to
  httptools' parser, with no stream layer; it won (the last item).
- The router stopped checking token-id prompts against the vocabulary (the hash checks every
  full block, the router the partial tail, the worker the vocabulary): ``decide`` went from
  ~133 µs p50 / 170-280 µs p99 to ~66 µs / 90-110 µs.
- Watching for a client that hangs up: racing two tasks per request cost ~0.15 ms of added
  latency; one watcher task that cancels the handler costs ~0.05 ms.
- Final, quiet machine (load ~1): decision p50 66-67 µs, p99 90-108 µs; added p50 0.51-0.58
  ms, p99 0.63-0.76 ms; 2,776-2,797 req/s through one router (worker alone ~4,400).
- The eviction-pressure and admission terms made ``decide`` +12 µs (54 -> 66 µs in-process,
  400 prompts). Candidate and WorkerCost were frozen dataclasses, whose ``__init__`` calls
  ``object.__setattr__`` per field (8 workers x 10 fields a request); plain slotted ones, and
  reading the admission inputs only for a worker at its sequence limit, took it to 45 µs.
- Pricing every worker cost about 3.4 µs a worker (p99 211, 442, 1,403 and 20,263 µs at 8,
  64, 256 and 1,024 workers). The routing core now prices one by one only the workers holding
  some of the prompt, and the rest once per group of equal load (:mod:`router.routing.load_groups`);
  the healthy-worker list is kept until health or membership changes (:mod:`router.fleet.healthy`).
- Booking each decision as the router does (predicted residency and session heads, not only
  the load), on caches past their warm-up, showed costs a lighter loop hid: groups that tie
  with each other (workers that differ only in live sessions while a session costs nothing,
  as on any workload that never continues one) were listed and sorted whole per decision;
  predicted residency's expiry visited every worker per request; the eviction pressure summed
  every worker's peak per decision. Each is now independent of the fleet's size.
- On a 2-core VM a decision runs on cold caches: after 5 ms of other work (building the next
  prompt here, a sleep as well) an empty Python call costs ~4 µs instead of 0.1, and each step
  two to five times its warm cost. Fewer Python calls (plain loops for comprehensions, figures
  read where they are kept, per-fleet objects kept) took about a quarter off, alternated in one
  sitting; compiling the core's modules with Cython unchanged made it slower (more code, so
  colder). ``docs/routing.md`` has the current figures.
- Where a forwarded request's CPU goes (router pinned nowhere, 16 connections, a 1,000-byte
  completions prompt, an nginx backend answering a fixed completion, so the backend costs
  nothing): uvicorn answering a fixed body alone costs ~35 µs a request; uvicorn forwarding
  through the proxy's aiohttp client ~200-225 µs; the whole router was 553-698 µs. A decision
  with its booking is ~57 µs warm and ~156 µs on a cold cache (after a 2 ms sleep), the
  metrics calls 6 and ~39 µs, parsing and checking the body 2 and ~20 µs. Serving the two
  forwarding endpoints as raw ASGI routes ahead of FastAPI (no middleware stack, routing
  table, ``Request`` or ``StreamingResponse`` task group) took the router to 454-528 µs,
  alternated in one sitting (pairs 569/454, 553/494, 644/528, 698/528). Caching the upstream
  URL and a dummy cookie jar for aiohttp, and joining uvicorn's two writes of a response into
  one, measured within the spread. What is left is the aiohttp client, the decision on cold
  caches and the metrics' locks.
- The next cuts, each predicted from a py-spy profile (250 Hz, the router pinned to one core,
  wrk at 64 connections, the nginx backend of ``bench.peers_http``), then measured with
  ``python -m bench.peers_http --no-peers --kvroute DIR ...``, one checkout per version
  alternated in one run (3-5 rounds; CPU per request, medians, ranges over rounds; load
  average 12-19 on the 2 cores, so the figures are high and move by a tenth between rounds):

  * aiohttp's ``ClientSession`` was a quarter of the router's CPU (request and response
    objects, header multidicts, a timer handle per request for the session's total timeout).
    A kept-alive connection pool on ``asyncio.Protocol`` with httptools' parser
    (:mod:`router.http.upstream`; one write per request, the answer's head and body parsed
    as they arrive, no timers of its own): 778 -> 478 µs per request at load 16 (the first
    version reused no connection: httptools' ``should_keep_alive`` is only true before the
    message completes; a test holds it).
  * Taking an idle connection without awaiting or a connect deadline, and registering the
    first-byte wait without a generator context manager: one timeout and two generator
    frames a request less; not measured on its own.
  * Python's cyclic collector ran a young-generation pass every 700 new objects, one every
    request or two: ``gc.freeze()`` after start-up and a threshold of 100,000
    (``kvroute/serve.py``): 440 -> 364 µs (freeze alone 408, threshold alone 375).
  * prometheus_client's locked counters and histograms (eight calls a request, ~3 µs an
    increment and ~7 µs an observation under this load) replaced by lock-free tallies with
    the same exposition (:mod:`router.http.tallies`): 389 -> 370 µs (5 rounds, ranges
    350-397 and 333-396: the ~20 µs predicted, inside the spread).
  * uvicorn's X-Forwarded-For middleware off (nothing reads the client's address) and the
    worker's answer headers passed through as bytes: a middleware call and two decodes a
    header less; too small to see here.

  A profile after these: uvicorn ~19% (its two socket writes a request ~10%), the event
  loop and asyncio's timeouts and tasks ~14%, the decision and its booking ~20%, the
  upstream write and parse ~9%, the request path, request ids and body deadline ~15%.

- The cuts after that, measured the same way (``python -m bench.peers_http --rounds 3
  --seconds 5 --kvroute BEFORE --kvroute STEP --kvroute .``, load average 7 on the 2 cores;
  ``bench/peers_http.py``'s docstring has the whole table):

  * Every forwarded request priced every worker of the fleet to rank its fallbacks
    (``Decision.costs``, 5% of the profile), though only a failed attempt reads them: ranked
    now when a retry asks (:func:`router.http.failover.send_with_failover`): 373 -> 319 µs.
  * The two forwarding routes served by the connection's protocol on a cycle of their own
    (:mod:`httpapi.lean_cycle`, ``httpapi/server.py`` rule 7), not through uvicorn's
    ``RequestResponseCycle`` and the three ASGI layers around the app (body deadline,
    request ids, the raw-route dispatch): no ``asyncio.timeout`` for a body that came with
    its headers, the answer's head written with its first body piece (one ``write`` a whole
    answer instead of two), the request id added as the head is built instead of by a
    wrapped ``send``, and a client that leaves told by a future instead of a watcher task
    reading the receive channel: 319 -> 261 µs (an earlier run of the same pair of commits
    together: 323 -> 258). ``KVROUTE_LEAN_HTTP=0`` serves them through the app again.
  * Tried and dropped: uvicorn's header timer set only for a head still open at the end of
    a read and one keep-alive timer per connection moved on when it fires (two
    ``call_later``/``cancel`` pairs a request less): 262 against 263 µs over 5 alternated
    rounds, inside the spread. uvloop was already the loop (uvicorn picks it when installed).

  A profile after these (the router at ~260-290 µs a request): the socket writes to the
  client and to the worker ~12%, the event loop ~6%, the decision ~17% and its booking and
  release ~10% (``RoutingCore._refresh`` regrouping the worker twice a request ~5%), the
  proxy's first-byte ``asyncio.timeout`` ~4%, the server's parse and cycle ~10%, the
  request path's own code ~6%.
- What ranking the fallbacks for every request costs grows with the fleet: deciding,
  booking and ranking a 1k-token prompt, in process, ranked eagerly against only when asked
  (``Route.ranked``, which the endpoint picker now books through too), alternating (load
  average 5-6): 130 -> 118 µs at 2 workers, 286 -> 124 µs at 64, 2,889 -> 299 µs at 1,024.
- Three cuts after that profile, each predicted from it and measured in process first, then
  together with ``python -m bench.peers_http --rounds 5 --seconds 5 --kvroute BEFORE --kvroute
  .`` (load average 2-4; kvroute 248 µs (235-268) before, 243 (236-252) after, pairs by round
  268/238, 258/244, 235/243, 248/252, 245/236) and ``python -m bench.router --quick``
  alternated 4 times (``router_cpu_us_per_request`` 213-235 before, 210-214 after, one round
  of each starved by other jobs left out; load 4-5). Two more runs of kvroute alone
  (``--no-peers``, load 2-3): 235 against 248 µs over 5 rounds, 242 (235-262) against 240
  (231-314) over 8. The ~10-15 µs predicted is inside the rounds' spread, end to end not seen;
  each piece, alone and in process, is a few µs:

  * The core regrouped a worker (``RoutingCore._refresh``, twice a request: booked, then
    released) from a frozen ``WorkerLoad`` (a call per field to build) and took its three
    rates out of their sorted lists and put them back even when only its load had moved. The
    books' figures as a plain tuple (``LoadTracker.figures``) and the sorted rates left alone
    unless the rates change: decide, book and release a 1k-token prompt in process (2
    workers, 64 in flight) 29.3-32.9 -> 25.2-29.3 µs.
  * The proxy armed an ``asyncio.timeout(limit)`` per send (a loop timer made and cancelled
    each request, the first byte nearly always long before the deadline). One timer keeps
    every send's deadline (:mod:`router.http.deadlines`): it fires at the earliest, expires
    exactly the waits past theirs (so ``FirstByteWaits.give_up`` still ends them too) and
    moves on to the earliest left: 4.0-4.3 -> 2.4 µs per wait in process under uvloop. The
    waits were unarmed ``asyncio.timeout`` blocks then; they are plain ``FirstByteWait``
    blocks now (``bench/peers_http.py``'s docstring has that cut).
  * The server's own cycle gave each request its id on a copy of the scope and of its header
    list; the list is the request's own, so the id is appended to it (``RequestIds.named``,
    ``in_place``): about 1% of the profile.

  The three together, in process (parse, decide, book and release a 1k-token completions body,
  2 workers, 64 in flight, 3 alternated runs of 5): 53.2-57.5 -> 49.1-53.8 µs a request.
  Tried and dropped: predicted residency's per-block loop (set, then move to the end) as two
  loops in C (``OrderedDict.update`` over ``zip``/``repeat``, then ``move_to_end`` mapped into a
  zero-length deque): 49.1-53.8 -> 52.2-55.7 µs, slower for a prompt's 31 blocks.
- Two cuts from a py-spy profile under ``bench.peers_http``'s load (250 Hz, 15 s, the router
  pinned to one core, wrk at 64 connections; load average 8-9):

  * The check for a repeated key in a body was a second decode, by ``json.loads`` with a pairs
    hook: 4.8% of the profile for the 1,000-byte completions body, and three times msgspec's
    decode for a 5.6 KB chat body. A count proves a body free of repeats without it
    (:func:`openai_request.bodies.parse_body`, module note 5: the colons outside strings
    against the decoded keys); the second decode runs only where the count cannot tell (an
    escaped colon, over 512 values, a count that differs). ``python -m bench.parse_body``,
    alternated twice with the commit before: 5.6 KB 22.9 -> 10.5 µs (msgspec's decode alone
    7.4), 272 KB 628-657 -> 328-334 µs, 3.3 MB 7.7-8.5 -> 3.9 ms; 1.9% of the profile after. The
    refusals are the same: 200,000 generated bodies (repeats, colons and escaped colons in keys
    and strings, deep and long values) parsed by both versions, none differing.
  * The client's answer head (``request_path._start``): bytes formatting for the
    ``x-kvroute-*`` figures and no generator to find the content type: 1.66 -> 1.31 µs an
    answer in process.

  Together, ``python -m bench.peers_http --rounds 5 --seconds 5 --kvroute BEFORE --kvroute .``
  (load average 3-11): 217 (208-240) -> 214 (210-223) µs, pairs by round 240/222, 217/210,
  208/223, 216/214, 231/210, the ~5 µs predicted inside the spread; sglang-router 82 (77-99)
  and vllm-router 134 (123-140) in the same run. A second run of the pair (load 6-9): 248
  (220-267) -> 232 (203-247), lower in each of its 5 rounds (248/237, 252/232, 220/203,
  242/209, 267/247; sglang-router 83). ``python -m bench.router --quick`` alternated
  twice: ``router_cpu_us_per_request`` 209, 214 -> 203, 187. Tried and dropped: the byte
  tokenizer's ids made by ``list(bytes)``, ``memoryview.tolist()`` or ``array.tolist()``
  instead of ``list.extend`` (6.9, 8.7, 9.5 against 6.2 µs for 1,000 bytes). Left alone: a
  router with no traffic spends 7.5 ms of CPU a second polling two workers (``/health``,
  ``/metrics``, ``/v1/models`` each second, through httpx), 3-5 µs a request at these rates
  and 2-3% of the profile.

  * The server's own request cycle (:mod:`httpapi.lean_cycle`) put its departure notice, a
    bound method, in the scope it holds: a reference cycle, so every request's cycle, its
    events, futures and headers (~11 objects) waited for the cyclic collector. Timed with
    ``gc.callbacks`` under this load, the young collections cost 8.1-9.4 µs a request (4 ms
    each, one every ~360 requests), and 0.5-0.8 µs once the notice leaves the scope as the
    request ends; the router's resident memory after ~60,000 requests 100-106 -> 84-88 MB.
    A young threshold of 1,000,000 instead of 100,000 had halved the collections' cost and
    tripled the memory (282 MB), the garbage waiting longer.

  The three, ``python -m bench.peers_http --rounds 5 --seconds 5 --kvroute BEFORE --kvroute .``
  (load average 5-6): 233 (220-245) -> 219 (201-225) µs, pairs by round 233/201, 245/221,
  220/218, 225/225, 235/219; sglang-router 88 (83-89), vllm-router 128 (124-132) in the
  same run: kvroute at 2.5 times sglang-router's CPU per request. ``python -m bench.router
  --quick`` alternated twice (load 3-6): ``router_cpu_us_per_request`` 220, 194 -> 189, 187.

  A profile after the first two (the router at ~210-250 µs a request): the two socket writes
  (to the worker and to the client) 15%, the event loop's own code 6%, the decision 13% and
  its booking and release 6%, tokenizing the prompt 2%, the body's parse 2%, the answer's head
  for the client 1.5%; the rest is spread over the request path, the server's parse and
  cycle, the proxy's exchange and the metrics, none above 2%.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx

from bench.figures import percentile, print_figures
from bench.http_load import (
    latency,
    process_cpu_seconds,
    spawn,
    stop,
    throughput,
    wrk_cpu,
    wrk_throughput,
)
from indexer.index import block_hashes, scope_seed
from kvroute.up import free_port
from router.fleet.worker_table import WorkerInfo
from router.service import RouterService
from router.settings import RouterSettings

BLOCK = 32
PROMPT_TOKENS = 8192


def _service(total_blocks: int, rng: random.Random, workers: int
             ) -> tuple[RouterService, list[list[int]]]:
    service = RouterService(RouterSettings(block_size=BLOCK, seed=1), httpx.AsyncClient())
    per_worker = total_blocks // workers
    for w in range(workers):
        service.registry.adopt(WorkerInfo(url=f"http://w{w}", model="kvroute-sim",
                                          block_size=BLOCK, tokenizer="bytes-v1",
                                          instance_id=f"i{w}", max_model_len=100_000,
                                          num_blocks=per_worker))
    now = time.monotonic()
    for w in range(workers):  # filler: random chains, 256 blocks each (or fewer)
        for _ in range(max(1, per_worker // 256)):
            service.index.store_hashes(w, [rng.getrandbits(64) for _ in range(256)])
        # Full caches, as in steady state (the eviction pressure sees them).
        service.core.record_resident(w, stored=per_worker, removed=0, now=now)
    chains = []
    seed = scope_seed(None, None)
    for i in range(64):  # resident conversations the queries follow
        tokens = [rng.randrange(4, 260) for _ in range(PROMPT_TOKENS)]
        hashes = block_hashes(tokens[: PROMPT_TOKENS // 2], BLOCK, seed=seed)
        service.index.store_hashes(i % workers, hashes)
        chains.append(tokens)
    return service, chains


def decision_latency(total_blocks: int, queries: int, workers: int = 8) -> dict[str, float]:
    """Time ``decide`` on 8k-token prompts with ``workers`` workers; returns p50/p99 in µs."""
    rng = random.Random(7)
    service, chains = _service(total_blocks, rng, workers)
    times, cpu = [], []
    for q in range(queries):
        if q % 2 == 0:
            tokens = chains[q % len(chains)]
        else:
            tokens = [rng.randrange(4, 260) for _ in range(PROMPT_TOKENS)]
        body = {"model": "kvroute-sim", "prompt": tokens, "max_tokens": 1}
        started, started_cpu = time.perf_counter(), time.thread_time()
        route = service.decide(body, "completions")
        cpu.append(time.thread_time() - started_cpu)
        times.append(time.perf_counter() - started)
        service.dispatched(route, route.worker)  # booked as the router books it
        service.finished(route)
    return {"decision_p50_us": round(percentile(times, 50) * 1e6, 1),
            "decision_p99_us": round(percentile(times, 99) * 1e6, 1),
            "decision_cpu_p50_us": round(percentile(cpu, 50) * 1e6, 1),
            "decision_cpu_p99_us": round(percentile(cpu, 99) * 1e6, 1),
            "index_blocks": service.index.num_blocks()}


def _worker_args(port: int) -> list[str]:
    return ["worker", "--port", str(port), "--events-port", str(free_port()),
            "--replay-port", str(free_port()), "--speedup", "1e9"]


def service_figures(requests: int, seconds: float) -> dict[str, Any]:
    """Added latency over one connection, and throughput with 16 connections."""
    body = {"model": "kvroute-sim", "prompt": "a small prompt", "max_tokens": 1}
    ports = [free_port(), free_port()]
    procs = [spawn(_worker_args(p), f"http://127.0.0.1:{p}") for p in ports]
    router_port = free_port()
    args = ["router", "--port", str(router_port), "--health-interval", "1"]
    for p in ports:
        args += ["--worker", f"http://127.0.0.1:{p}"]
    try:
        router = spawn(args, f"http://127.0.0.1:{router_port}", health="/ready")
        procs.append(router)
        worker_url = f"http://127.0.0.1:{ports[0]}/v1/completions"
        router_url = f"http://127.0.0.1:{router_port}/v1/completions"
        direct = latency(worker_url, body, requests)
        routed = latency(router_url, body, requests)
        worker_rps = wrk_throughput(worker_url, body, 16, seconds)
        measured = wrk_cpu(router_url, body, 16, seconds, router.pid)
        failed, generator = 0, "wrk"
        if worker_rps is None or measured is None:
            generator = "aiohttp (install wrk for figures less bound by the load generator)"
            worker_rps, _ = throughput(worker_url, body, 16, seconds)
            before = process_cpu_seconds(router.pid)
            router_rps, failed = throughput(router_url, body, 16, seconds)
            measured = router_rps, (process_cpu_seconds(router.pid) - before) / max(
                1, router_rps * seconds)
        router_rps, router_cpu = measured
    finally:
        for proc in procs:
            stop(proc)
    return {
        "direct_p50_ms": round(percentile(direct, 50) * 1e3, 3),
        "direct_p99_ms": round(percentile(direct, 99) * 1e3, 3),
        "routed_p50_ms": round(percentile(routed, 50) * 1e3, 3),
        "routed_p99_ms": round(percentile(routed, 99) * 1e3, 3),
        "added_p50_ms": round((percentile(routed, 50) - percentile(direct, 50)) * 1e3, 3),
        "added_p99_ms": round((percentile(routed, 99) - percentile(direct, 99)) * 1e3, 3),
        "worker_rps": round(worker_rps), "router_rps": round(router_rps),
        "router_cpu_us_per_request": round(router_cpu * 1e6),
        "router_failed": failed, "load_generator": generator,
    }


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of worker counts") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: worker counts are positive")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small, fast run")
    parser.add_argument("--workers", type=_counts, default=[8], metavar="N[,N...]",
                        help="worker counts to time decisions at (default 8)")
    parser.add_argument("--decisions-only", action="store_true",
                        help="time decisions only (no servers)")
    args = parser.parse_args(argv)
    blocks, queries = (100_000, 200) if args.quick else (1_000_000, 2000)
    result: dict[str, Any] = {}
    for n in args.workers:
        figures = decision_latency(blocks, queries, n)
        if len(args.workers) == 1:
            result |= figures
        else:
            result |= {f"{k}_at_{n}": v for k, v in figures.items()}
    if not args.decisions_only:
        result |= service_figures(200 if args.quick else 1000, 2.0 if args.quick else 5.0)
    print_figures(result, args.json)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
