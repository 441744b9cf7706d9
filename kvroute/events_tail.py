"""``kvroute events tail``: print an engine's KV event stream as the router sees it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import msgspec

from router.events.subscriber import (
    Delivered,
    EventSubscriber,
    GapDetected,
    HistoryLost,
    MalformedInput,
    Notice,
    Restarted,
)
from router.events.transport import DEFAULT_MAX_MESSAGE_BYTES, CurveClientKeys, EventTransport


def notice_record(notice: Notice) -> dict[str, Any]:
    """Return one notice as the JSON object ``events tail --json`` prints."""
    match notice:
        case Delivered(seq, batch, replayed):
            record: dict[str, Any] = {
                "seq": seq,
                "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank,
                "events": [_event_record(e) for e in batch.events],
            }
            if replayed:
                record["replayed"] = True
            return record
        case GapDetected(expected, received):
            return {"notice": "gap", "expected": expected, "received": received}
        case HistoryLost(first_missing, resumed_at, reason):
            return {"notice": "history_lost", "first_missing": first_missing,
                    "resumed_at": resumed_at, "reason": reason}
        case Restarted(last_seq, seq):
            return {"notice": "restart", "last_seq": last_seq, "seq": seq}
        case MalformedInput(seq, reason):
            return {"notice": "malformed", "seq": seq, "reason": reason}
    raise AssertionError(f"unknown notice {notice!r}")


def _event_record(event: object) -> dict[str, Any]:
    fields = {k: v for k, v in msgspec.to_builtins(event).items() if v is not None}
    return {"type": type(event).__name__, **fields}


def _readable(record: dict[str, Any]) -> str:
    if "notice" in record:
        details = " ".join(f"{k}={v}" for k, v in record.items() if k != "notice")
        return f"!! {record['notice']} {details}"
    parts = []
    for e in record["events"]:
        hashes = e.get("block_hashes", [])
        tier = e.get("medium") or "GPU"
        parts.append(f"{e['type']}({len(hashes)} blocks, {tier})" if hashes else e["type"])
    tag = " (replayed)" if record.get("replayed") else ""
    return (f"seq={record['seq']} ts={record['ts']:.3f} rank={record['data_parallel_rank']}"
            f"{tag}: {', '.join(parts) or 'no events'}")


def _transport(args: argparse.Namespace) -> EventTransport:
    """The socket options the flags ask for.

    Raises:
        ValueError: a CURVE key file is missing or unusable.
    """
    curve = None
    if getattr(args, "curve_secret_key", None) and getattr(args, "curve_server_key", None):
        curve = CurveClientKeys.load(args.curve_secret_key, args.curve_server_key)
    limit = getattr(args, "max_message_bytes", None) or DEFAULT_MAX_MESSAGE_BYTES
    return EventTransport(max_message_bytes=limit, curve=curve)


async def _tail(args: argparse.Namespace, transport: EventTransport) -> int:
    done = asyncio.Event()
    activity = asyncio.Event()
    batches = 0

    def on_notice(notice: Notice) -> None:
        nonlocal batches
        record = notice_record(notice)
        line = json.dumps(record) if args.json else _readable(record)
        print(line, flush=True)
        activity.set()
        if isinstance(notice, Delivered):
            batches += 1
            if args.count is not None and batches >= args.count:
                done.set()

    sub = EventSubscriber(args.connect, on_notice, replay_endpoint=args.replay,
                          topic=args.topic, from_seq=args.from_seq, transport=transport)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await sub.start()
    status = 0
    try:
        while not done.is_set():
            activity.clear()
            waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(activity.wait())]
            _, pending = await asyncio.wait(waiters, timeout=args.timeout,
                                            return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            if not done.is_set() and not activity.is_set():
                print(f"kvroute events tail: nothing for {args.timeout}s", file=sys.stderr)
                status = 3
                break
    finally:
        await sub.stop()
    return status


def run_tail(args: argparse.Namespace) -> int:
    """Run ``events tail`` until ``--count`` batches, a signal, or ``--timeout`` idle."""
    try:
        transport = _transport(args)
    except ValueError as exc:
        print(f"kvroute events tail: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_tail(args, transport))
    return 130
