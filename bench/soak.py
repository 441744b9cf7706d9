"""Soak: a real router and three sim workers under mixed good and bad traffic while workers
fail, with the figures a long run needs.

``python -m bench.soak --minutes N`` starts three sim workers and a router on 127.0.0.1 (child
processes, :func:`bench.http_load.spawn`) and keeps ``--concurrency`` clients busy with a mix
of valid completions, chats and streams over a few shared prefixes, and bad requests:
malformed JSON, JSON that is not a request, prompts longer than any worker takes, and 60,000
token prompts whose output would not fit (the router passes them, the worker refuses). Meanwhile
(unless ``--no-faults``) worker 0 is killed (SIGKILL) at 20% of the run and restarted at 35%,
and worker 1 is paused (SIGSTOP) at 55% and resumed (SIGCONT) at 65%.

It prints, at the end:

- requests by kind and outcome; a good request fails when it gets anything but 200 or a
  stream ends with an error event, a bad one when it gets anything but a 4xx; failures are
  grouped by cause;
- router and worker RSS over time (``/proc/<pid>/status``) and the router's growth per 10,000
  requests after the first tenth of the run (the warm-up);
- the router's event-loop lag, as the time a ``GET /health`` takes (sent every 100 ms): p50,
  p99 and max.

With ``--flood``, an overload runs beside the mix (:func:`_flood`): low-priority long chats
(body ``priority`` 10) sent every ``--flood-interval`` seconds, each with a 60 s client
timeout, and a trickle of high-priority short chats (``priority`` 0) every second; the router
must answer each one, served or refused at once (429 with Retry-After, or 503). It prints each
class's answers, the high-priority TTFT p50/p99, and the requests **lost before their first
byte**: no answer at all (a client timeout or a dropped connection before the status line)
or an answer that is neither 200 nor such a refusal. An answer that began and was then cut
short (its worker paused or killed mid-answer, past the router's reach) is counted apart.
Each flood request carries its own ``x-request-id`` and the router logs at level info to a
file, so each request lost before its first byte is told with the stage the router's lines
for it name (:meth:`Flood.stages`): how long it waited in flow control's queue and how long
it was then at its workers, which worker failed it, or that the router said nothing of it.
Each answer cut after it began is printed with the worker that gave it (the router's
``x-kvroute-worker`` header), when it was sent, and when its bytes stopped.

With ``--hostile``, hostile clients and peers run beside the traffic
(:mod:`bench.soak_hostile`): slow bodies, 2 MB headers, 16-image fan-out, and a stock-engine
stand-in whose metrics grow and whose event port is a rogue publisher; what each got back is
printed after the figures above.

Every loop ends at the deadline, every request has a timeout, and every child is stopped on
the way out, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from bench import soak_hostile
from bench.http_load import spawn, stop
from kvroute.up import free_port

__all__ = ["main"]

MODEL = "kvroute-sim"
PREFIXES = [f"Shared system prompt {i}: you are a careful assistant for team {i}. " * 12
            for i in range(8)]
#: Longer than the sim worker's default 65,536-token limit (one token a byte).
OVERSIZE = "x" * 70_000
#: Within that limit, but not with 8,000 tokens of output on top.
LONG = "y" * 60_000
REQUEST_TIMEOUT_S = 30.0
#: The flood's client timeout: a request not answered within it is lost.
FLOOD_TIMEOUT_S = 60.0
#: The most flood requests in flight at once (the client's bound, not the router's).
FLOOD_IN_FLIGHT = 2000


@dataclass
class Flood:
    """What the flood's clients saw: answers per class, the high class's TTFTs, and the
    requests lost before their first byte (module docstring)."""

    answers: Counter[tuple[str, str]] = field(default_factory=Counter)
    high_ttft_s: list[float] = field(default_factory=list)
    lost: Counter[str] = field(default_factory=Counter)
    #: Each request lost before its first byte: (its id, why, monotonic seconds it was sent,
    #: seconds until it was given up).
    lost_requests: list[tuple[str, str, float, float]] = field(default_factory=list)
    #: Each answer cut after it began: (its id, the worker that answered, monotonic seconds
    #: it was sent, seconds until its last byte, seconds until it was cut, bytes received).
    cut: list[tuple[str, str, float, float, float, int]] = field(default_factory=list)
    #: Requests sent, for their ids.
    sent: int = 0

    def cuts(self, started: float, names: dict[str, str]) -> list[str]:
        """Each answer cut after it began, when it was sent (``started``: the run's start),
        the worker that answered (by ``names``, its URL's name) and when its bytes stopped."""
        return [f"  {rid}, sent at {sent - started:.1f} s, answered by {names.get(url, url)}: "
                f"{size} bytes, the last {last:.1f} s after sending, cut at {took:.1f} s"
                for rid, url, sent, last, took, size in self.cut]

    def stages(self, router_log: str, started: float) -> list[str]:
        """Each lost request with the router's lines for it (``router_log``: the router's
        log at level info), sent ``t`` seconds into the run (``started``: its start)."""
        lines: dict[str, list[str]] = {}
        for line in router_log.splitlines():
            tag = line.rsplit(" [request ", 1)
            if len(tag) == 2 and tag[1].endswith("]"):
                lines.setdefault(tag[1][:-1], []).append(tag[0])
        out = []
        for rid, why, sent, took in self.lost_requests:
            said = [_after_name(line) for line in lines.get(rid, [])] or [
                "the router logged nothing for it (it did not see the client leave: still "
                "queued, or deciding)"]
            out.append(f"  {rid}, sent at {sent - started:.1f} s, {why} after {took:.1f} s:")
            out += [f"    router: {line}" for line in said]
        return out

    def report(self) -> list[str]:
        h = self.high_ttft_s
        lines = ["flood (class, answer, count):"]
        lines += [f"  {cls:<5} {answer:<28} {n}" for (cls, answer), n in
                  sorted(self.answers.items())]
        lines.append(f"flood high-priority TTFT ({len(h)} served): p50 "
                     f"{_percentile(h, 0.5) * 1e3:.0f} ms, p99 {_percentile(h, 0.99) * 1e3:.0f} ms")
        lines.append(f"flood lost before first byte: {sum(self.lost.values())}")
        lines += [f"  {cause}: {n}" for cause, n in self.lost.most_common()]
        return lines


@dataclass
class Tally:
    """What the clients saw."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    health_s: list[float] = field(default_factory=list)
    health_failed: int = 0
    rss: list[tuple[float, int, dict[str, int], int]] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    hostile: soak_hostile.Hostile | None = None
    flood: Flood | None = None
    #: The router's log (level info) and the run's start, monotonic seconds.
    router_log: str = ""
    started: float = 0.0
    #: Each worker's name by its URL.
    worker_names: dict[str, str] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())


class Worker:
    """A sim worker with fixed ports, so that a restart comes back at the same address."""

    def __init__(self, index: int, extra: list[str]) -> None:
        self.name = f"worker-{index}"
        self.port = free_port()
        self.args = ["worker", "--port", str(self.port), "--events-port", str(free_port()),
                     "--replay-port", str(free_port()), *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn(self.args, self.url)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _request(rng: random.Random) -> tuple[str, str, bytes, bool]:
    """One request of the mix: (kind, path, body, good)."""
    roll = rng.random()
    prefix = rng.choice(PREFIXES)
    tail = f"question {rng.randrange(10**6)} " * 8  # about four blocks of its own
    if roll < 0.35:
        body = {"model": MODEL, "prompt": prefix + tail, "max_tokens": rng.randint(1, 16)}
        return "completion", "/v1/completions", json.dumps(body).encode(), True
    if roll < 0.55:
        body = {"model": MODEL, "max_tokens": rng.randint(1, 16),
                "messages": [{"role": "system", "content": prefix},
                             {"role": "user", "content": tail}]}
        return "chat", "/v1/chat/completions", json.dumps(body).encode(), True
    if roll < 0.80:
        body = {"model": MODEL, "prompt": prefix + tail, "max_tokens": rng.randint(4, 32),
                "stream": True}
        return "stream", "/v1/completions", json.dumps(body).encode(), True
    if roll < 0.88:
        return "malformed", "/v1/completions", b'{"model": "kvroute-sim", "prompt": ', False
    if roll < 0.96:
        garbage = rng.choice([b"[1, 2, 3]", b'{"prompt": 5}', b'{"messages": "hi"}', b"null",
                              b'{"model": "kvroute-sim", "prompt": "x", "max_tokens": -4}'])
        path = "/v1/chat/completions" if b"messages" in garbage else "/v1/completions"
        return "garbage", path, garbage, False
    if roll < 0.98:
        body = {"model": MODEL, "prompt": OVERSIZE, "max_tokens": 4}
        return "oversize", "/v1/completions", json.dumps(body).encode(), False
    # Fits the router's check but not the worker's (prompt plus max_tokens): the worker
    # refuses it, after the router booked it there.
    body = {"model": MODEL, "prompt": f"{rng.randrange(10**9)} " + LONG, "max_tokens": 8000}
    return "refused", "/v1/completions", json.dumps(body).encode(), False


async def _one(session: aiohttp.ClientSession, base: str, rng: random.Random,
               tally: Tally) -> None:
    kind, path, body, good = _request(rng)
    try:
        async with session.post(base + path, data=body,
                                headers={"Content-Type": "application/json"}) as r:
            text = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.outcomes[(kind, "no answer")] += 1
        tally.failures[f"{kind}: {type(exc).__name__}"] += 1
        return
    errored = kind == "stream" and status == 200 and b'"error"' in text
    tally.outcomes[(kind, f"{status}{' error event' if errored else ''}")] += 1
    if good and (status != 200 or errored):
        cause = "stream ended with an error event" if errored else f"status {status}"
        tally.failures[f"{kind}: {cause}"] += 1
    elif not good and not 400 <= status < 500:
        tally.failures[f"{kind}: status {status} (a 4xx was due)"] += 1


async def _clients(base: str, concurrency: int, deadline: float, seed: int, tally: Tally
                   ) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await _one(session, base, rng, tally)
        await asyncio.gather(*(loop(i) for i in range(concurrency)))


async def _health(base: str, deadline: float, tally: Tally) -> None:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                async with session.get(base + "/health") as r:
                    await r.read()
                tally.health_s.append(time.perf_counter() - started)
            except (aiohttp.ClientError, TimeoutError):
                tally.health_failed += 1
            await asyncio.sleep(0.1)


async def _watch(router: subprocess.Popen[bytes], workers: list[Worker], started: float,
                 deadline: float, every: float, tally: Tally) -> None:
    while True:
        now = time.monotonic()
        tally.rss.append((now - started, rss_kib(router.pid),
                          {w.name: rss_kib(w.proc.pid) if w.proc else 0 for w in workers},
                          tally.requests))
        if now >= deadline:
            return
        await asyncio.sleep(min(every, max(0.0, deadline - now)))


async def _faults(workers: list[Worker], started: float, seconds: float, tally: Tally) -> None:
    plan = [(0.20, workers[0], "SIGKILL"), (0.35, workers[0], "restart"),
            (0.55, workers[1], "SIGSTOP"), (0.65, workers[1], "SIGCONT")]
    for at, worker, action in plan:
        await asyncio.sleep(max(0.0, started + at * seconds - time.monotonic()))
        tally.faults.append((time.monotonic() - started, f"{action} {worker.name}"))
        if action == "restart":
            if worker.proc is not None:
                await asyncio.to_thread(worker.proc.wait, 10)
            await _restart(worker, started, tally)
        else:
            worker.signal(getattr(signal, action))


async def _restart(worker: Worker, started: float, tally: Tally, tries: int = 5) -> None:
    """Start ``worker`` again on its ports; a start that fails (another process on this
    machine took a port the killed worker freed) is recorded and tried again, 2 s apart,
    ``tries`` times in all, so the run goes on and says so."""
    for attempt in range(tries):
        try:
            await asyncio.to_thread(worker.start)
            return
        except RuntimeError as exc:
            tally.faults.append((time.monotonic() - started,
                                 f"restart {attempt + 1} of {worker.name} failed: {exc}"))
            await asyncio.sleep(2.0)


def _flood_body(rng: random.Random, high: bool) -> bytes:
    if high:
        messages = [{"role": "user", "content": f"Quick question {rng.randrange(10**6)}?"}]
        return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8,
                           "priority": 0, "stream": True}).encode()
    doc = f"Batch document {rng.randrange(10**9)}: " + "lorem ipsum dolor sit amet " * 300
    messages = [{"role": "user", "content": doc + "\nSummarise it."}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 64,
                       "priority": 10, "stream": True}).encode()


def _after_name(line: str) -> str:
    """A log line from its message on (the time, level and logger name dropped)."""
    head, sep, message = line.partition(": ")
    return message if sep and " " in head else line


async def _flood_one(session: aiohttp.ClientSession, base: str, body: bytes, cls: str,
                     flood: Flood) -> None:
    sent = time.perf_counter()
    sent_at = time.monotonic()
    flood.sent += 1
    rid = f"flood-{cls}-{flood.sent}"
    status: int | None = None
    first: float | None = None
    last = 0.0
    size = 0
    worker = ""
    try:
        async with session.post(base + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json",
                                         "x-request-id": rid}) as r:
            status = r.status
            retry = r.headers.get("Retry-After")
            worker = r.headers.get("x-kvroute-worker", "")
            async for chunk in r.content.iter_any():
                last = time.perf_counter() - sent
                size += len(chunk)
                if first is None:
                    first = last
            if status == 200 and cls == "high" and first is not None:
                flood.high_ttft_s.append(first)
    except (aiohttp.ClientError, TimeoutError) as exc:
        if status is None:  # nothing came back: lost before its first byte
            flood.answers[(cls, "no answer")] += 1
            flood.lost[f"{cls}: {type(exc).__name__}"] += 1
            flood.lost_requests.append((rid, type(exc).__name__, sent_at,
                                        time.perf_counter() - sent))
        else:  # answered, then cut short (a worker paused or killed mid-answer)
            flood.answers[(cls, f"{status}, then cut: {type(exc).__name__}")] += 1
            flood.cut.append((rid, worker, sent_at, last, time.perf_counter() - sent, size))
        return
    refusal = status == 503 or (status == 429 and retry is not None)
    flood.answers[(cls, str(status) if status != 429 or retry else "429 no Retry-After")] += 1
    if status != 200 and not refusal:
        flood.lost[f"{cls}: status {status}"] += 1
        flood.lost_requests.append((rid, f"status {status}", sent_at,
                                    time.perf_counter() - sent))


async def _flood(base: str, deadline: float, interval: float, seed: int, flood: Flood) -> None:
    """Low-priority long chats every ``interval`` s and a high-priority short chat every
    second until ``deadline``; waits for every answer (each bounded by its timeout)."""
    rng = random.Random(seed + 7)
    timeout = aiohttp.ClientTimeout(total=FLOOD_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=FLOOD_IN_FLIGHT)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks: set[asyncio.Task[None]] = set()
        next_high = time.monotonic()
        while time.monotonic() < deadline:
            now = time.monotonic()
            high = now >= next_high
            if high:
                next_high = now + 1.0
            if len(tasks) < FLOOD_IN_FLIGHT:
                task = asyncio.create_task(_flood_one(session, base, _flood_body(rng, high),
                                                      "high" if high else "low", flood))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(interval)
        if tasks:
            await asyncio.gather(*tasks)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(tally: Tally, seconds: float) -> str:
    """The run's figures as text."""
    lines = [f"{tally.requests} requests in {seconds:.0f}s "
             f"({tally.requests / max(seconds, 1e-9):.0f}/s)", "", "requests by kind and answer:"]
    for (kind, answer), n in sorted(tally.outcomes.items()):
        lines.append(f"  {kind:<11} {answer:<22} {n}")
    lines += ["", f"failed: {sum(tally.failures.values())}"]
    lines += [f"  {cause}: {n}" for cause, n in tally.failures.most_common()]
    lines += ["", "faults:"] + [f"  {t:7.1f}s  {what}" for t, what in tally.faults]
    names = list(tally.rss[0][2]) if tally.rss else []
    lines += ["", "RSS (MiB) over time:",
              f"  {'t (s)':>7} {'requests':>9} {'router':>7} " + " ".join(f"{n:>9}" for n in names)]
    for t, router, workers, done in tally.rss:
        lines.append(f"  {t:7.1f} {done:>9} {router / 1024:7.1f} "
                     + " ".join(f"{workers[n] / 1024:9.1f}" for n in names))
    warm = next((s for s in tally.rss if s[0] >= seconds / 10), None)
    if warm is not None and tally.rss[-1][3] > warm[3]:
        grown = (tally.rss[-1][1] - warm[1]) / 1024
        per = grown / (tally.rss[-1][3] - warm[3]) * 10_000
        lines.append(f"router RSS after warm-up: {grown:+.1f} MiB over "
                     f"{tally.rss[-1][3] - warm[3]} requests ({per:+.2f} MiB per 10k)")
    h = tally.health_s
    lines += ["", f"event-loop lag (GET /health, {len(h)} probes, {tally.health_failed} failed): "
              f"p50 {_percentile(h, 0.5) * 1e3:.1f} ms, p99 {_percentile(h, 0.99) * 1e3:.1f} ms, "
              f"max {max(h, default=float('nan')) * 1e3:.1f} ms"]
    if tally.flood is not None:
        lines += ["", *tally.flood.report()]
        if tally.flood.lost_requests:
            lines += ["flood lost before first byte, by the router's lines for each:",
                      *tally.flood.stages(tally.router_log, tally.started)]
        if tally.flood.cut:
            lines += ["flood answers cut after they began:",
                      *tally.flood.cuts(tally.started, tally.worker_names)]
    if tally.hostile is not None:
        lines += ["", *tally.hostile.report()]
    return "\n".join(lines)


async def soak(seconds: float, concurrency: int, faults: bool, seed: int,
               worker_args: list[str], router_args: list[str], hostile: bool = False,
               flood_interval: float | None = None) -> Tally:
    """Run the soak for ``seconds`` and return what was seen (children stopped on return);
    ``flood_interval`` adds the flood (module docstring)."""
    tally = Tally()
    if flood_interval is not None:
        tally.flood = Flood()
    peers: soak_hostile.HostilePeers | None = None
    if hostile:
        tally.hostile = soak_hostile.Hostile()
        peers = soak_hostile.HostilePeers(tally.hostile)
        await peers.start()
        worker_args = [*worker_args, "--allow-image-hosts", "127.0.0.1"]
        router_args = [*router_args, "--worker", peers.stock_worker]
    workers = [Worker(i, worker_args) for i in range(3)]
    tally.worker_names = {w.url: w.name for w in workers}
    router: subprocess.Popen[bytes] | None = None
    logs = tempfile.TemporaryDirectory(prefix="kvroute-soak-")
    router_log = os.path.join(logs.name, "router.log")
    try:
        for w in workers:
            await asyncio.to_thread(w.start)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        args = ["router", "--port", str(port), *router_args]
        for w in workers:
            args += ["--worker", w.url]
        router = await asyncio.to_thread(spawn, args, base, log=router_log)
        started = tally.started = time.monotonic()
        deadline = started + seconds
        tasks = [_clients(base, concurrency, deadline, seed, tally),
                 _health(base, deadline, tally),
                 _watch(router, workers, started, deadline, max(seconds / 12, 0.5), tally)]
        if faults:
            tasks.append(_faults(workers, started, seconds, tally))
        if tally.flood is not None and flood_interval is not None:
            tasks.append(_flood(base, deadline, flood_interval, seed, tally.flood))
        if peers is not None and tally.hostile is not None:
            tasks += [soak_hostile.slow_bodies(port, deadline, tally.hostile),
                      soak_hostile.big_headers(port, deadline, tally.hostile),
                      soak_hostile.image_fan_out(base, peers, deadline, tally.hostile),
                      soak_hostile.boundary_probes(base, port, deadline, tally.hostile),
                      peers.rogue(deadline, seed)]
        await asyncio.gather(*tasks)
        if peers is not None and tally.hostile is not None:
            await soak_hostile.read_stand_in(base, peers, tally.hostile)
    finally:
        if peers is not None:
            await peers.stop()
        for w in workers:
            w.signal(signal.SIGCONT)
        for proc in [router, *(w.proc for w in workers)]:
            if proc is not None:
                stop(proc)
        with contextlib.suppress(OSError), open(router_log, errors="replace") as f:
            tally.router_log = f.read()
        logs.cleanup()
    return tally


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak``: run, print the figures."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="run length (default 2)")
    p.add_argument("--seconds", type=float, help="run length in seconds (overrides --minutes)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default 8)")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="no kill, restart or pause: traffic only")
    p.add_argument("--seed", type=int, default=0, help="the traffic mix's seed")
    p.add_argument("--hostile", action="store_true",
                   help="also run hostile clients and peers (bench.soak_hostile)")
    p.add_argument("--flood", action="store_true",
                   help="also run the overload flood (module docstring)")
    p.add_argument("--flood-interval", type=float, default=0.01, metavar="S",
                   help="seconds between the flood's low-priority chats (default 0.01)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for every worker (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="an extra flag for the router (repeatable)")
    args = p.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    if not seconds > 0 or args.concurrency < 1 or not args.flood_interval > 0:
        p.error("the run length, --concurrency and --flood-interval must be positive")
    tally = asyncio.run(soak(seconds, args.concurrency, args.faults, args.seed,
                             args.worker_arg, args.router_arg, args.hostile,
                             args.flood_interval if args.flood else None))
    print(report(tally, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
