"""The bytes-per-token estimate on a trace: ``python -m bench.estimate [--trace PATH]
[--requests N] [--workers W] [--in-flight K] [--json]``.

Under ``--tokenize match`` the router tokenizes a prompt only as far as some worker holds it
and estimates the rest from its UTF-8 bytes (``openai_request.segment_cache``, note 3); the
decision uses the estimate for load. This bench asks what that estimate gets wrong on a
trace with real prefix sharing, the Mooncake trace the project packages
(``bench/data/mooncake_synthetic_trace.jsonl``), rendered to text:

- every 512-token block id of the trace becomes a block of generated text
  (``bench.prompts.Language``, seeded by the id, about 512 tokens of ``bench.prompts``' 32k
  BPE), so equal ids at equal positions are an equal text prefix; each request's prompt is
  its blocks' text cut to ``input_length`` tokens' worth of characters, sent as one chat
  message through the ChatML template;
- one ``RouterService`` under ``--tokenize match`` with ``--workers`` workers routes the
  requests in the trace's order, ``--in-flight`` of them booked at a time (a request is
  finished ``K`` requests after it was dispatched, so loads are never all zero), and the
  worker chosen is then told to hold the whole prompt, as its events would;
- before each decision is booked, the same service decides the same body on its exact
  tokens (what ``--tokenize full`` would see), from the same state and the same random
  state; a different worker is a decision the estimate changed.

Printed: for the requests whose walk stopped early (``walked_short``), the remainder's
estimated and actual token counts (the actual from the same BPE over the whole prompt), the
median and p99 of the relative error ``|estimated - actual| / actual`` of the remainder and
of the whole prompt (known + estimated against actual), the remainder's error weighted by
its size (``remainder_error_weighted``: the tokens missed over all the tokens estimated),
the decisions changed, and the ratio at the end.

What it taught (figures in ``docs/benchmarks.md``, long prompts):

- On this text the ratio settles within the first few requests, and the remainder's error is
  a few percent at the median; the whole prompt's error is smaller, since the known part is
  exact.
- Load is compared in tokens across workers, so an error of a few percent moves a decision
  only where two workers' costs are that close; the count of changed decisions says how often
  that happened here.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from bench.prompts import MODEL, Language, tokenizer_dir
from bench.workloads import DEFAULT_TRACE, TRACE_BLOCK

#: Characters a trace block's text is given: 512 tokens at the BPE's ~4.8 characters a
#: token, measured once by ``bench.prompts`` (the prompt is cut by ``input_length``).
BLOCK_CHARS = int(TRACE_BLOCK * 4.8)


def trace_rows(path: Path, limit: int) -> list[tuple[int, list[int]]]:
    """``(input_length, hash_ids)`` of the trace's first ``limit`` requests.

    Raises:
        ValueError: a line is not a Mooncake trace line.
    """
    rows: list[tuple[int, list[int]]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if len(rows) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((int(row["input_length"]), [int(h) for h in row["hash_ids"]]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
    return rows


class TraceText:
    """Text for a trace's block ids: the same id, the same text."""

    def __init__(self) -> None:
        self._lang = Language(0)
        self._blocks: dict[int, str] = {}

    def prompt(self, input_length: int, hash_ids: list[int]) -> str:
        """The prompt of a request: its blocks' text, cut to ``input_length`` tokens' worth."""
        parts = []
        for h in hash_ids:
            text = self._blocks.get(h)
            if text is None:
                self._lang.rng = random.Random(h)
                text = self._blocks[h] = self._lang.text(BLOCK_CHARS) + " "
            parts.append(text)
        return "".join(parts)[: input_length * BLOCK_CHARS // TRACE_BLOCK]


def run(trace: Path, requests: int, workers: int, in_flight: int) -> dict[str, Any]:
    """Route the trace's requests; return the estimate's errors and the changed decisions."""
    from openai_request.prompts import build_prompt
    from openai_request.segment_cache import SegmentedTokenizer
    from openai_request.tokenizer import HFTokenizer, load_tokenizer
    from router.fleet.worker_table import WorkerInfo
    from router.service import RouterService
    from router.settings import RouterSettings

    folder = tokenizer_dir()
    service = RouterService(RouterSettings(tokenizer=str(folder), block_size=32, seed=1,
                                           tokenize="match"), httpx.AsyncClient())
    for w in range(workers):
        service.registry.adopt(WorkerInfo(url=f"http://w{w}", model=MODEL, block_size=32,
                                          tokenizer=service.tokenizer.identity,
                                          instance_id=f"i{w}", max_model_len=1 << 22))
    # The exact counts come from a tokenizer of their own, so that the router's ratio learns
    # only from what the router itself encoded.
    inner = load_tokenizer(str(folder))
    assert isinstance(inner, HFTokenizer), "the bench's tokenizer is a Hugging Face one"
    exact = SegmentedTokenizer(inner)
    text = TraceText()
    remainder: list[float] = []
    whole: list[float] = []
    estimated_sum = actual_sum = missed_sum = changed = walked_short = 0
    booked: deque[Any] = deque()
    rows = trace_rows(trace, requests)
    for length, ids in rows:
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": text.prompt(length, ids)}]}
        truth = build_prompt(body, "chat", exact, mm_tokens_per_image=1,  # type: ignore[arg-type]
                             max_image_bytes=1, fetch=None, check_token_ids=False)
        state = service.rng.getstate()
        route = service.decide(body, "chat")
        after = service.rng.getstate()
        service.rng.setstate(state)
        reference = service.decide(body, "chat", truth)
        service.rng.setstate(after)
        changed += route.worker.id != reference.worker.id
        prompt = route.prompt
        if prompt.estimated_tokens:
            walked_short += 1
            actual = len(truth.token_ids) - len(prompt.token_ids)
            remainder.append(abs(prompt.estimated_tokens - actual) / max(1, actual))
            whole.append(abs(prompt.total_tokens - len(truth.token_ids))
                         / len(truth.token_ids))
            estimated_sum += prompt.estimated_tokens
            actual_sum += actual
            missed_sum += abs(prompt.estimated_tokens - actual)
        service.dispatched(route, route.worker)
        service.index.store_hashes(route.worker.id, reference.hashes)
        booked.append(route)
        if len(booked) > in_flight:
            service.finished(booked.popleft())
    stats = service.tokenizer.stats()  # type: ignore[attr-defined]
    return {
        "requests": len(rows), "workers": workers, "in_flight": in_flight,
        "walked_short": walked_short,
        "remainder_error_p50": _pct(remainder, 50), "remainder_error_p99": _pct(remainder, 99),
        "remainder_error_max": round(max(remainder, default=0.0), 4),
        "prompt_error_p50": _pct(whole, 50), "prompt_error_p99": _pct(whole, 99),
        # Over all remainders: the tokens missed, per token estimated (large ones weigh most).
        "remainder_error_weighted": round(missed_sum / max(1, actual_sum), 4),
        "estimated_tokens": estimated_sum, "actual_tokens": actual_sum,
        "decisions_changed": changed,
        "bytes_per_token": round(service.tokenizer.bytes_per_token, 3),  # type: ignore[attr-defined]
        "segment_estimate_error": round(stats.estimate_error_tokens
                                        / max(1, stats.encoded_tokens), 4),
    }


def _pct(values: list[float], pct: int) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))], 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="a Mooncake-format JSONL trace (default: the packaged one)")
    parser.add_argument("--requests", type=int, default=400,
                        help="the trace's first N requests (default 400)")
    parser.add_argument("--workers", type=int, default=4, help="workers (default 4)")
    parser.add_argument("--in-flight", type=int, default=16,
                        help="requests booked at a time (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.workers < 1 or args.in_flight < 0:
        parser.error("--requests and --workers must be at least 1, --in-flight at least 0")
    try:
        result = run(args.trace, args.requests, args.workers, args.in_flight)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"  {key}={value}")


if __name__ == "__main__":
    main()
