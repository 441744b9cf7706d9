"""Long-prompt benchmark: ``python -m bench.prompts [--json] [--quick] [--sizes 1k,8k,...]
[--requests N] [--no-http] [--upload-mbps M]``.

The router's cost on long chat prompts with a real tokenizer: a byte-level BPE with a
32,000-entry vocabulary trained with ``tokenizers`` on generated text (built once, kept in
``bench-out/prompts/``), a ChatML template whose ``<|im_start|>``/``<|im_end|>`` are added
tokens. Prompts of 1k, 8k, 32k and 128k tokens, four traffic shapes:

- ``first``: a prompt never seen before;
- ``repeat``: the same prompt again;
- ``next_turn``: a conversation's next turn (every earlier turn was routed before);
- ``shared_doc``: one document with a new question each time.

Two parts, one run, ``--tokenize match`` (the default) against ``--tokenize full``:

1. In process, ``cpu_ms``: the process CPU time (all threads: the tokenizer encodes a
   batch of segments on several) of what the router does per request (parse the body,
   tokenize, hash, match, score, book), as the app does it (under ``full`` a body over
   256 KB is tokenized whole, off the event loop). Each request is booked, and the worker
   it went to is then told to hold the whole prompt, as that worker's events would.
2. Over HTTP (unless ``--no-http``): five simulated workers (``--speedup 1e9``, the same
   tokenizer): one for the straight path, which no router hears, and two behind each router
   (one router per mode), so a router applies only the events of the requests it routed.
   Each request goes straight to a worker and through each router in turn, with the same
   body. ``added_p50_ms`` / ``added_p99_ms`` are percentiles, request by request, of the
   router's round trip less the worker's own time, minus the straight round trip less the
   worker's own time; the worker's own time (from the body's end to its answer) is what its
   ``Server-Timing`` header says, and the router passes it through. ``gross_p50_ms`` is the
   same without taking the worker's time out. ``router_cpu_ms`` is the router process's CPU
   seconds over the requests it served (from ``/proc``). ``--upload-mbps`` uploads each body
   in 16 KB pieces at that link speed, on both paths: a body that arrives in pieces may be
   decided, and sent on, before its end.

What the measurements taught (2-core machine shared with other jobs, load average 3-10):

- Whole-prompt tokenization costs ~2.3 µs a token with this tokenizer (4.8 characters a
  token), linear in the prompt, and is nearly all of the router's work on a long prompt under
  ``--tokenize full``: ~82 ms of CPU for a 150 KB prompt, ~370 ms for 600 KB.
- Segment cache: a repeated or continued prompt's segments are look-ups, and what is left is
  parsing the body, rendering the template, cutting (one regex search a segment), hashing and
  matching, ~14 µs a KB: 2.1 ms of CPU for a repeated 150 KB prompt in process, 4.4 ms in the
  router process over HTTP (the HTTP path adds ~2 ms at that size). Cuts at spaces come every
  2,048 characters (~430 tokens): a changed text re-encodes at most that much around each
  change; a segment's look-up (~1-2 µs) is small against its tokenization (~1 ms).
- Tokenizing only as far as the match: a first-time prompt costs its first 4,096 characters
  of tokenization plus the estimate of the rest, 3-6 ms of CPU from 38 KB to 600 KB. The
  estimate (bytes over the bytes-per-token ratio of all text tokenized) was off by 2.6% on
  this text (``estimate_error``). On the Mooncake trace rendered to text
  (``python -m bench.estimate``) a whole prompt's estimate was off by 0.31% at the median and
  1.9% at p99, and 3 of 3,993 decisions differed from those on exact tokens.
- Before a large body could be walked on the event loop (the walk needs the index), bodies
  over 256 KB were tokenized whole in a thread: a first-time 600 KB prompt cost 196 ms of CPU
  instead of 6 ms.
- Where the added time of a 100 KB prompt went, timed in the router and the worker at load
  average 8: the body arrived as one ASGI message (0.1 ms), parsing took 0.1 ms, the
  decision 3.1 ms (first time, next turn; 0.9 ms a repeat), handing it to the client pool
  0.2 ms, the hop to the worker 1.1 ms (straight: 1.3 ms from the client), the way back
  about 0.6 ms more than straight: 5-6 ms in all, 3-4 ms for a repeat. The 10-17 ms once
  reported as added were the worker's own time differing between the two requests: it
  tokenizes the whole prompt (115-190 ms a request at that load, moving by 15 ms from one
  to the next), and the straight path went to a worker both routers heard, so its
  first-time prompts' events landed on them too. Hence the worker's own time taken out of
  both paths, and a worker of its own for the straight path.
- A body decided before its end is decided on its first part with the rest stood in for by
  as many bytes of filler (so the load booked counts the whole prompt); filler of one long
  run without spaces made the tokenizer's cutter cost 3.9 ms of CPU on a 100 KB body, filler
  of one-letter words 0.5 ms. The early decision (the read, the try, the decision) costs
  about what the buffered one does (2.8 ms at 100 KB, 3.8 ms at 400 KB, first time), but
  before the body's end. Tries at every doubling with no end cost a repeated 600 KB body,
  which arrives in three or four pieces even on loopback and which no try can settle, 9-12
  ms of CPU (against 0.3-0.7 ms to read it whole): no try is made past 64 KB.
- 150 KB against 600 KB: nothing in the router's path grows faster than the body. By phase
  (``python -m bench.prompt_phases``, the cells taking turns in one process), a repeat's
  decision is 1.7-2.1 ms at 154 KB and 5.3-6.0 ms at 616 KB (11-14 and 9-10 µs a KB, two
  runs): parsing, the template, cutting, look-ups, gathering the ids, hashing and matching,
  booking each grow 2.3 to 3.4 times. The in-process part here reads 6.7-10 ms at 612 KB
  because each decision follows the same body's whole-prompt tokenization under ``full``, on
  cold caches. Over HTTP the
  router process spends about as much again as the decision (the body's socket reads, its
  write to the worker, a fifth of a py-spy profile's busy samples at 612 KB, and the rest of
  the request path). The 6x growth of the added latency once reported (5.0 ms at 153 KB,
  30.6 ms at 612 KB, repeat) was measured at load average 11-19; at load 4-7 the same run
  gave 4.8 and 17.4 ms (3.6x), at load 3-5 3.3 and 7.9 ms (2.4x; a next turn 4.1 and 7.9,
  1.9x). On 2 shared cores a request that needs 12-21 ms of CPU waits for the core more often
  than one that needs 3-5: the figure to hold a change to is CPU per request.
- Sending a request used to price every candidate for its fallbacks before the first worker
  was tried, a walk of the prompt's blocks per worker: now only when the first one fails
  (``bench/router.py``'s docstring has the figures).
- Figures with the command that printed them are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

OUT = Path("bench-out/prompts")
VOCAB = 32_000
SIZES = {"1k": 1_000, "8k": 8_000, "32k": 32_000, "128k": 128_000}
SHAPES = ("first", "repeat", "next_turn", "shared_doc")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|image|>"]
#: Bytes a paced upload writes at a time (``--upload-mbps``).
UPLOAD_PIECE = 16 * 1024
#: The straight-to-worker path is the sim worker's; its model name.
MODEL = "kvroute-sim"


class Language:
    """Generated text: words from syllables, sentences, paragraphs, numbers and punctuation,
    enough distinct words to train a 32k vocabulary and leave most words several tokens."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(1234)
        syllables = [a + b for a in ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n",
                                     "p", "r", "s", "t", "v", "w", "z", "ch", "st", "tr")
                     for b in ("a", "e", "i", "o", "u", "ai", "ou", "er", "an", "in", "on")]
        self.words = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
                      for _ in range(400_000)]
        self.rng = random.Random(seed)

    def text(self, chars: int) -> str:
        rng, words, out, n = self.rng, self.words, [], 0
        while n < chars:
            # Half the words from the 2,000 most common, half from all: the rare ones split
            # into several tokens, as English does at about 4.5 characters a token.
            sentence = " ".join(words[rng.randrange(2_000 if rng.random() < 0.5 else len(words))]
                                for _ in range(rng.randint(4, 18)))
            sentence = sentence.capitalize() + rng.choice((".", ".", ",", "?", "!", ":",
                                                          f" {rng.randint(0, 9999)}."))
            if rng.random() < 0.1:
                sentence += "\n\n"
            out.append(sentence)
            n += len(sentence) + 1
        return " ".join(out)[:chars]


def tokenizer_dir() -> Path:
    """Build the benchmark's tokenizer once (about a minute), or find it built."""
    folder = OUT / f"bpe-{VOCAB}"
    if (folder / "tokenizer.json").is_file():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lang = Language(0)
    tok.train_from_iterator((lang.text(10_000) for _ in range(3_000)), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def bodies(shape: str, tokens: int, n: int, chars_per_token: float, seed: int
           ) -> list[dict[str, Any]]:
    """``n`` chat bodies of about ``tokens`` tokens each, shaped as ``shape``."""
    lang = Language(seed)
    chars = int(tokens * chars_per_token)
    base = {"model": MODEL, "max_tokens": 1}
    if shape == "first":
        return [{**base, "messages": [{"role": "user", "content": lang.text(chars)}]}
                for _ in range(n)]
    if shape == "repeat":
        body = {**base, "messages": [{"role": "user", "content": lang.text(chars)}]}
        return [body] * n
    if shape == "shared_doc":
        doc = lang.text(chars)
        return [{**base, "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": lang.text(200)}]} for _ in range(n)]
    assert shape == "next_turn", shape
    # The conversation has reached ``tokens`` at the first measured turn; each turn adds an
    # answer and a question of about 100 tokens each.
    history = [{"role": "user", "content": lang.text(chars)}]
    out = []
    for _ in range(n):
        history = [*history, {"role": "assistant", "content": lang.text(400)},
                   {"role": "user", "content": lang.text(400)}]
        out.append({**base, "messages": list(history)})
    return out


def services_by_mode(folder: Path, http: httpx.AsyncClient) -> dict[str, Any]:
    """A router service per ``--tokenize`` mode (``full`` first: its hashes stand for the
    worker's events), each with two adopted workers of the bench's model and tokenizer."""
    from router.fleet.worker_table import WorkerInfo
    from router.service import RouterService
    from router.settings import RouterSettings

    services = {}
    for mode in ("full", "match"):
        service = RouterService(RouterSettings(tokenizer=str(folder), block_size=32, seed=1,
                                               tokenize=mode), http)
        for w in range(2):
            service.registry.adopt(WorkerInfo(url=f"http://w{w}", model=MODEL, block_size=32,
                                              tokenizer=service.tokenizer.identity,
                                              instance_id=f"i{w}", max_model_len=1 << 20))
        services[mode] = service
    return services


def in_process(folder: Path, shapes: list[str], sizes: dict[str, int], n: int,
               chars_per_token: float) -> list[dict[str, Any]]:
    """Part 1: CPU per request of the router's own work, per mode."""
    http = httpx.AsyncClient()
    services = services_by_mode(folder, http)
    rows = []
    for shape in shapes:
        for label, tokens in sizes.items():
            raws = [msgspec.json.encode(b) for b in bodies(shape, tokens, n + 1, chars_per_token,
                                                           seed=tokens)]
            cpu: dict[str, list[float]] = {"match": [], "full": []}
            known: list[int] = []
            for k, raw in enumerate(raws):
                whole: list[int] = []
                for mode, service in services.items():
                    started = time.process_time()
                    body = msgspec.json.decode(raw)
                    prompt = (service.tokenize(body, "chat")
                              if service.tokenizes_off_loop(len(raw)) else None)
                    route = service.decide(body, "chat", prompt)
                    service.dispatched(route, route.worker)
                    service.finished(route)
                    spent = time.process_time() - started
                    # The worker caches the whole prompt and says so in its events.
                    whole = whole or route.hashes
                    service.index.store_hashes(route.worker.id, whole)
                    if k:  # the first body only primes the repeat and the conversation
                        cpu[mode].append(spent)
                        if mode == "match":
                            known.append(len(route.prompt.token_ids))
            rows.append({"shape": shape, "size": label, "bytes": len(raws[-1]),
                         "cpu_ms_match": round(statistics.median(cpu["match"]) * 1e3, 2),
                         "cpu_ms_full": round(statistics.median(cpu["full"]) * 1e3, 2),
                         "tokenized_match": int(statistics.median(known))})
    stats = services["match"].tokenizer.stats()  # type: ignore[attr-defined]
    rows.append({"estimate_error": round(stats.estimate_error_tokens
                                         / max(1, stats.encoded_tokens), 4),
                 "bytes_per_token": round(services["match"].tokenizer.bytes_per_token, 3)})  # type: ignore[attr-defined]
    return rows


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` (the scheduler's nanosecond count)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def over_http(folder: Path, shapes: list[str], sizes: dict[str, int], n: int,
              chars_per_token: float, upload_mbps: float = 0.0) -> list[dict[str, Any]]:
    """Part 2: added latency and router CPU, straight to a worker against each router."""
    from bench.http_load import spawn, stop
    from kvroute.up import free_port

    procs = []

    def worker() -> int:
        port = free_port()
        procs.append(spawn(["worker", "--port", str(port), "--events-port", str(free_port()),
                            "--replay-port", str(free_port()), "--speedup", "1e9",
                            "--tokenizer", str(folder), "--max-model-len", "1000000",
                            "--num-blocks", "65536"], f"http://127.0.0.1:{port}"))
        return port

    try:
        # The straight path has a worker of its own, which no router hears; each router has
        # two of its own: a router ingests only the events of the requests it routed.
        direct = worker()
        routers = {}
        for mode in ("match", "full"):
            port = free_port()
            args = ["router", "--port", str(port), "--tokenizer", str(folder),
                    "--tokenize", mode, "--health-interval", "1",
                    # A worker encoding a 128k-token prompt on a loaded 2-core machine may
                    # answer its health probe late: that is not what this measures.
                    "--health-timeout", "10", "--unhealthy-grace", "60",
                    "--first-byte-floor", "60", "--first-byte-timeout", "120"]
            for p in (worker(), worker()):
                args += ["--worker", f"http://127.0.0.1:{p}"]
            procs.append(spawn(args, f"http://127.0.0.1:{port}", health="/ready"))
            routers[mode] = (f"http://127.0.0.1:{port}", procs[-1].pid)
        rows = []
        with httpx.Client(timeout=120) as client:
            for shape in shapes:
                for label, tokens in sizes.items():
                    targets = [("direct", f"http://127.0.0.1:{direct}", 0),
                               *((m, url, pid) for m, (url, pid) in routers.items())]
                    # Every target gets the same bodies: no worker is shared between them.
                    same = [msgspec.json.encode(b) for b in bodies(
                        shape, tokens, n + 1, chars_per_token, seed=tokens + 1)]
                    raws = {name: same for name, _, _ in targets}
                    times: dict[str, list[float]] = {"direct": [], "match": [], "full": []}
                    raw_times: dict[str, list[float]] = {"direct": [], "match": [], "full": []}
                    cpu = {m: 0.0 for m in routers}
                    for k in range(n + 1):
                        for name, url, pid in targets:
                            raw = raws[name][k]
                            before = _cpu_seconds(pid) if pid else 0.0
                            started = time.perf_counter()
                            r = client.post(url + "/v1/chat/completions",
                                            content=_paced(raw, upload_mbps),
                                            headers={"content-type": "application/json",
                                                     "content-length": str(len(raw))})
                            elapsed = time.perf_counter() - started
                            if r.status_code != 200:
                                raise RuntimeError(f"{name}, {shape} {label}: "
                                                   f"{r.status_code} {r.text[:200]}")
                            if k:
                                # The worker's own time (from the body's end to its answer)
                                # is left out of both paths: it is the same work either way.
                                times[name].append(elapsed - _worker_seconds(r))
                                raw_times[name].append(elapsed)
                                if pid:
                                    cpu[name] += _cpu_seconds(pid) - before
                    row: dict[str, Any] = {"shape": shape, "size": label,
                                           "direct_p50_ms": _ms(raw_times["direct"], 50)}
                    for mode in routers:
                        # Paired: each request through the router against the same body
                        # straight to the worker just before it.
                        added = [r - d for r, d in zip(times[mode], times["direct"],
                                                        strict=True)]
                        gross = [r - d for r, d in zip(raw_times[mode], raw_times["direct"],
                                                        strict=True)]
                        row[f"added_p50_ms_{mode}"] = _ms(added, 50)
                        row[f"added_p99_ms_{mode}"] = _ms(added, 99)
                        row[f"gross_p50_ms_{mode}"] = _ms(gross, 50)
                        row[f"router_cpu_ms_{mode}"] = round(cpu[mode] / n * 1e3, 2)
                    rows.append(row)
        return rows
    finally:
        for proc in procs:
            stop(proc)


def _paced(raw: bytes, mbps: float) -> bytes | Iterator[bytes]:
    """``raw`` at once (``mbps`` 0), or in pieces at ``mbps`` megabits a second, as a client
    on a link of that speed would upload it."""
    if not mbps:
        return raw

    def pieces() -> Iterator[bytes]:
        started = time.perf_counter()
        for at in range(0, len(raw), UPLOAD_PIECE):
            due = started + at * 8 / (mbps * 1e6)
            time.sleep(max(0.0, due - time.perf_counter()))
            yield raw[at:at + UPLOAD_PIECE]

    return pieces()


def _worker_seconds(answer: httpx.Response) -> float:
    """The worker's own seconds for a request, from its ``Server-Timing`` (which the router
    passes through)."""
    timing = answer.headers.get("server-timing", "")
    found = re.search(r"worker;dur=([0-9.]+)", timing)
    if not found:
        raise RuntimeError(f"the worker's answer has no Server-Timing: {timing!r}")
    return float(found.group(1)) / 1e3


def _ms(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))] * 1e3, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prompts", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    parser.add_argument("--quick", action="store_true", help="5 requests a cell, 1k and 8k")
    parser.add_argument("--sizes", help="comma-separated of 1k,8k,32k,128k (default all)")
    parser.add_argument("--requests", type=int, default=20, help="measured requests a cell")
    parser.add_argument("--no-http", action="store_true", help="the in-process part only")
    parser.add_argument("--upload-mbps", type=float, default=0.0,
                        help="over HTTP, upload each body at this many megabits a second, in "
                        f"{UPLOAD_PIECE // 1024} KB pieces (default 0: all at once)")
    args = parser.parse_args(argv)
    sizes = dict(SIZES)
    if args.sizes:
        unknown = set(args.sizes.split(",")) - set(SIZES)
        if unknown:
            parser.error(f"unknown sizes {sorted(unknown)}; known: {', '.join(SIZES)}")
        sizes = {k: SIZES[k] for k in args.sizes.split(",")}
    n = args.requests
    if args.quick:
        sizes = {k: v for k, v in sizes.items() if k in ("1k", "8k")} or sizes
        n = 5
    if n < 2:
        parser.error("--requests must be at least 2")
    folder = tokenizer_dir()
    from openai_request.tokenizer import load_tokenizer

    sample = Language(99).text(200_000)
    chars_per_token = len(sample) / len(load_tokenizer(str(folder)).encode(sample))
    if args.upload_mbps < 0:
        parser.error("--upload-mbps must be >= 0")
    http = functools.partial(over_http, upload_mbps=args.upload_mbps)
    parts = [("in_process", in_process)] + ([] if args.no_http else [("http", http)])
    for part, run in parts:
        rows = run(folder, list(SHAPES), sizes, n, chars_per_token)
        rows.append({"load_average": [round(x, 2) for x in os.getloadavg()]})
        if args.json:
            print(json.dumps({part: rows}), flush=True)
            continue
        print(f"== {part}")
        for row in rows:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
