"""Live mode: replay a workload against a running router over HTTP, measured from the client.

Each request is sent at its (rate-scaled) arrival time as a streaming ``/v1/completions`` call
whose prompt is the list of token ids (the workloads' ids are already in ``[4, 260)``, the
byte tokenizer's non-special range), with ``max_tokens`` = the request's output length and
``stream_options.include_usage`` so the worker reports its cached prompt tokens. TTFT is the
time from the request's scheduled arrival to the first streamed token, end-to-end latency to
``[DONE]``: a request held back by the client's ``concurrency`` limit is late, and its wait
counts (an open-loop load, so a slow server cannot hide its queue by slowing the client down);
``late_sends`` counts the requests sent more than 10 ms after their arrival time, so a run
that the client held back says so.

The router decides where each request goes, so the report has one row (``live``) per run, and
the columns a client cannot see (load imbalance, decision time) are empty. The hit rate's
share of the pooled bound, and the plots, use the bounds of the cluster the flags describe.
Images are not sent (token-id prompts carry no image parts): image workloads replay as text
here.

The HTTP client is aiohttp, created and closed here (one boundary: connection errors and bad
statuses become a failed request, counted, never a crash).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.bounds import Bounds
from bench.figures import mean
from bench.report import percentile, prediction_error, write_json
from bench.workloads import WorkloadRequest

__all__ = ["LATE_S", "Decorate", "LiveRecord", "read_stream", "replay_live", "run_live",
           "summarize_live"]

#: A request sent more than this many seconds after its scheduled arrival counts as late.
LATE_S = 0.010


@dataclass(slots=True)
class LiveRecord:
    """One request as the client saw it (seconds from its scheduled arrival; -1 when never
    seen)."""

    request_id: str
    prompt_tokens: int
    send_delay_s: float = 0.0  # sent this long after its scheduled arrival
    ttft_s: float = -1.0
    e2e_s: float = -1.0
    tokens_out: int = 0
    cached_tokens: int = 0
    #: The router's predicted time to first token (its ``x-kvroute-predicted-ttft-ms``
    #: header; -1 when it sent none).
    predicted_ttft_s: float = -1.0
    #: Every gap between two consecutive streamed tokens (seconds; inter-token latency).
    token_gaps_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


#: Extra body fields and headers for one request (``bench.flow``'s priorities and tenants).
Decorate = Callable[[WorkloadRequest], tuple[dict[str, Any], dict[str, str]]]


async def read_stream(lines: AsyncIterable[bytes], rec: LiveRecord, due: float,
                      clock: Callable[[], float] = time.perf_counter) -> None:
    """Read a ``/v1/completions`` event stream into ``rec``: its first token's time (from
    ``due``, on ``clock``), each gap between two consecutive token chunks, the tokens, the
    usage, and its end (``[DONE]``) or error. A chunk with choices is one token, as kvroute's
    workers and vLLM stream them, so the gaps are the simulation's inter-token latencies
    (:data:`bench.report.METRIC_KEYS`).

    Raises:
        json.JSONDecodeError: a data line that is not JSON (the caller counts it a failure).
    """
    last = -1.0
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            rec.e2e_s = clock() - due
            break
        chunk = json.loads(data)
        if "error" in chunk:
            rec.error = str(chunk["error"].get("message", chunk["error"]))
            break
        if chunk.get("choices"):
            now = clock()
            if rec.ttft_s < 0:
                rec.ttft_s = now - due
            else:
                rec.token_gaps_s.append(now - last)
            last = now
            rec.tokens_out += 1
        usage = chunk.get("usage")
        if usage:
            # A text prompt is as long as the engine tokenized it.
            rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest,
               model: str | None, due: float,
               as_text: Callable[[Sequence[int]], str] | None = None,
               decorate: Decorate | None = None) -> LiveRecord:
    """Send one request; times count from ``due`` (its scheduled arrival, perf_counter)."""
    tokens = req.token_ids()
    rec = LiveRecord(req.request_id, len(tokens), max(0.0, time.perf_counter() - due))
    prompt: str | list[int] = as_text(tokens) if as_text else list(tokens)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": req.output_length,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    extra, headers = decorate(req) if decorate is not None else ({}, {})
    body.update(extra)
    try:
        async with session.post(f"{url.rstrip('/')}/v1/completions", json=body,
                                headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return rec
            predicted = resp.headers.get("x-kvroute-predicted-ttft-ms")
            if predicted is not None:
                with contextlib.suppress(ValueError):
                    rec.predicted_ttft_s = float(predicted) / 1e3
            await read_stream(resp.content, rec, due)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    if rec.error is None and rec.e2e_s < 0:
        rec.error = "stream ended without [DONE]"
    return rec


async def replay_live(url: str, requests: Sequence[WorkloadRequest], *,
                      concurrency: int = 512, model: str | None = None,
                      progress: Any = None,
                      as_text: Callable[[Sequence[int]], str] | None = None,
                      decorate: Decorate | None = None
                      ) -> tuple[list[LiveRecord], float]:
    """Send every request at its arrival time; return the records and the wall makespan.

    Args:
        url: the router's (or one worker's) base URL.
        requests: the workload, in arrival order, already rate-scaled.
        concurrency: requests in flight at most (later ones wait; their latency counts from
            their scheduled arrival, and ``send_delay_s`` says how long they waited).
        model: the ``model`` field to send, if any.
        progress: a tqdm-like object updated per finished request.
        as_text: sends each prompt as this text instead of token ids (for routers that take
            text only); the prompt's length is then the one the engine reports.
        decorate: each request's extra body fields and headers.
    """
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=concurrency)
    start = time.perf_counter()
    first = requests[0].arrival_s if requests else 0.0

    async def fire(session: aiohttp.ClientSession, req: WorkloadRequest) -> LiveRecord:
        due = start + (req.arrival_s - first)
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            rec = await _one(session, url, req, model, due, as_text, decorate)
        if progress is not None:
            progress.update(1)
        return rec

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        records = await asyncio.gather(*(fire(session, r) for r in requests))
    return list(records), time.perf_counter() - start


def summarize_live(records: Sequence[LiveRecord], makespan_s: float,
                   label: str = "live") -> dict[str, Any]:
    """Return the report row of a live run (``bench.report.METRIC_KEYS`` plus ``errors``)."""
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    gaps = [g for r in ok for g in r.token_gaps_s]
    return {
        "policy": label,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan,
        "hit_vs_pooled": math.nan,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_mean_s": mean(e2e),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "output_tok_s": sum(r.tokens_out for r in ok) / makespan_s if makespan_s else math.nan,
        "load_imbalance": math.nan,
        "decision_us_mean": math.nan,
        "decision_us_p99": math.nan,
        "requests": len(records),
        "preemptions": math.nan,
        "makespan_s": makespan_s,
        "wall_s": makespan_s,
        "errors": len(records) - len(ok),
        "late_sends": sum(1 for r in records if r.send_delay_s > LATE_S),
        "first_errors": [r.error for r in records if r.error is not None][:5],
        **prediction_error([(r.predicted_ttft_s, r.ttft_s) for r in ok
                            if r.predicted_ttft_s >= 0] or None),
    }


def run_live(args: argparse.Namespace, requests: Sequence[WorkloadRequest], name: str,
             bounds: Bounds | None = None) -> int:
    """Run live mode for :func:`bench.replay.run_bench`; return the exit status (0, or 1 when
    a request failed). ``bounds`` are the hit-rate ceilings of the cluster the flags describe
    (``--workers`` x ``--capacity-tokens``, ``--block-size``): the live cluster is not asked,
    so they are only as right as those flags."""
    from bench.hit_by_wait import DEFAULT_OVER, HEADER, line, split
    from bench.report import LIVE_COLUMNS, plot, table

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="live", file=sys.stderr, unit="req")
    try:
        records, makespan = asyncio.run(replay_live(args.live, requests,
                                                    concurrency=args.concurrency,
                                                    model=args.model, progress=bar))
    finally:
        if bar is not None:
            bar.close()
    row = summarize_live(records, makespan)
    if bounds is not None and bounds.pooled_lru > 0:
        row["hit_vs_pooled"] = row["hit_rate"] / bounds.pooled_lru
    served = [r for r in records if r.error is None]
    splits = [split(served, over) for over in DEFAULT_OVER]
    row["hit_by_wait"] = [dataclasses.asdict(s) for s in splits]
    print(table([row], f"{name} live against {args.live}, rate x{args.rate_scale:g}",
                LIVE_COLUMNS))
    print("the hit by the TTFT paid for it (bench.hit_by_wait):")
    print("\n".join([HEADER, *(line("live", s) for s in splits)]))
    if row["errors"]:
        print(f"{row['errors']} requests failed, e.g. {row['first_errors']}", file=sys.stderr)
    if row["late_sends"]:
        print(f"{row['late_sends']} requests were sent over {LATE_S * 1e3:g} ms late (the "
              f"client's --concurrency {args.concurrency} held them; their wait is in their "
              "latency)", file=sys.stderr)
    plots: list[str] = []
    if args.plot_dir:
        ttft = [r.ttft_s for r in records if r.error is None]
        plots = [str(p) for p in plot(args.plot_dir, {row["policy"]: ttft}, [row], bounds)]
    if args.json_path:
        document: dict[str, Any] = {"workload": name, "live": args.live,
                                    "requests": len(requests),
                                    "runs": [{"rows": [row], "plots": plots}]}
        if bounds is not None:
            document["bounds"] = dataclasses.asdict(bounds)
        write_json(args.json_path, document)
    return 0 if not row["errors"] else 1
