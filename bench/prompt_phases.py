"""Where a long prompt's decision spends its CPU: ``python -m bench.prompt_phases
[--shapes repeat,next_turn] [--sizes 32k,128k] [--requests N] [--json]``.

``bench.prompts``' in-process part, broken into phases: one ``RouterService`` under
``--tokenize match`` (two workers, the worker chosen then told to hold the whole prompt, as
its events would), the sizes and shapes taking turns request by request so that a loaded
machine weighs on all of them alike, and the process CPU time of each phase summed:

- ``parse``: the body's JSON (msgspec);
- ``render``: the chat template, with the messages' checks (``normalize``, inside it);
- ``split``: cutting the rendered text into segments;
- ``lookups``: the segment cache's look-ups (and any encoding of segments not cached);
- ``walk``: the walk over the segments, ``lookups`` included, the ids gathered;
- ``reach``: hashing blocks as they become known and asking the index how far they are held;
- ``decide``: the whole decision (all of the above but ``parse`` and ``book``, and the
  match and the scoring);
- ``book``: booking the request on its worker (load, predicted residency, session).

Printed per cell: milliseconds a request and microseconds a KB of body. Each phase is timed
by wrapping the function that does it, which adds about a microsecond a call.

What it taught (figures in ``docs/benchmarks.md``, long prompts): every phase grows with the
body, none faster; at 600 KB a repeat's decision is about 5-6 ms of CPU, 9-10 µs a KB,
against 11-14 µs a KB at 150 KB.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from bench.prompts import SIZES, bodies, services_by_mode, tokenizer_dir

#: Phase name, the module or class holding the function, the function's name.
_PHASES = [("render", "openai_request.prompts", "render_chat_with_images"),
           ("normalize", "openai_request.chat", "normalize_messages"),
           ("split", "openai_request.segment_cache:SegmentedTokenizer", "walk"),
           ("lookups", "openai_request.segment_cache:SegmentedTokenizer", "_encode"),
           ("walk", "openai_request.segment_cache:Walk", "advance"),
           ("reach", "router.routing.prompt_path:PrefixReach", "extend"),
           ("reach", "router.routing.prompt_path:PrefixReach", "finish"),
           ("reach", "router.service:RouterService", "_held")]


def _timed(spent: collections.defaultdict[str, float]) -> None:
    """Wrap each phase's function so that its CPU time is added to ``spent``."""
    import importlib

    for name, where, attr in _PHASES:
        module, _, cls = where.partition(":")
        owner: Any = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        inner = getattr(owner, attr)

        def wrapper(*args: Any, _inner: Callable[..., Any] = inner, _name: str = name,
                    **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] += time.process_time() - started

        setattr(owner, attr, functools.wraps(inner)(wrapper))


def run(shapes: list[str], sizes: dict[str, int], n: int) -> list[dict[str, Any]]:
    """The phases' CPU per request of each (shape, size), the cells taking turns."""

    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    _timed(spent)
    http = httpx.AsyncClient()
    services = services_by_mode(tokenizer_dir(), http)
    match, full = services["match"], services["full"]
    cells = [(shape, label) for shape in shapes for label in sizes]
    raws = {(shape, label): [msgspec.json.encode(b) for b in bodies(
        shape, sizes[label], n + 2, 4.8, seed=sizes[label])] for shape, label in cells}
    totals: dict[tuple[str, str], collections.defaultdict[str, float]] = {
        c: collections.defaultdict(float) for c in cells}
    whole: dict[bytes, list[int]] = {}
    gc.collect()
    for k in range(n + 2):  # the first two prime the repeat and the conversation
        for cell in cells:
            raw = raws[cell][k]
            spent.clear()
            started = time.process_time()
            body = msgspec.json.decode(raw)
            parsed = time.process_time()
            route = match.decide(body, "chat")
            decided = time.process_time()
            match.dispatched(route, route.worker)
            match.finished(route)
            spent.update(parse=parsed - started, decide=decided - parsed,
                         book=time.process_time() - decided)
            if k >= 2:
                for phase, seconds in spent.items():
                    totals[cell][phase] += seconds
            if raw not in whole:
                whole[raw] = full.decide(msgspec.json.decode(raw), "chat").hashes
            match.index.store_hashes(route.worker.id, whole[raw])
    rows = []
    for (shape, label), total in totals.items():
        kb = len(raws[(shape, label)][-1]) / 1000
        row: dict[str, Any] = {"shape": shape, "size": label, "kb": round(kb)}
        for phase in ("parse", "render", "normalize", "split", "lookups", "walk", "reach",
                      "decide", "book"):
            row[f"{phase}_ms"] = round(total[phase] / n * 1e3, 3)
        row["decide_us_per_kb"] = round(total["decide"] / n * 1e6 / kb, 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_phases",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="repeat,next_turn",
                        help="comma-separated of first,repeat,next_turn,shared_doc")
    parser.add_argument("--sizes", default="32k,128k", help="comma-separated of 1k,8k,32k,128k")
    parser.add_argument("--requests", type=int, default=20, help="measured requests a cell")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = (set(shapes) - {"first", "repeat", "next_turn", "shared_doc"}) | (
        set(args.sizes.split(",")) - set(SIZES))
    if unknown:
        parser.error(f"unknown shapes or sizes: {sorted(unknown)}")
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    rows = run(shapes, {k: SIZES[k] for k in args.sizes.split(",")}, args.requests)
    rows.append({"load_average": [round(x, 2) for x in os.getloadavg()]})
    for row in rows:
        print(json.dumps(row) if args.json else "  " + "  ".join(f"{k}={v}"
                                                                 for k, v in row.items()))


if __name__ == "__main__":
    main()
