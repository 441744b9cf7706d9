"""Why no worker can take a request, in one line: the 503 body's message, ``GET /ready``'s
reason and the registry's log say it the same way.

A worker's ``last_error`` is long (it names the URL, the call and the client's exception);
:func:`cause_of` reduces it to the cause an operator acts on (``connection refused``, ``no
answer in time``, ``status 500``...), so that workers failing alike are counted together
and a worker failing the same way on every poll is logged once.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.fleet.entry import WorkerEntry

__all__ = ["NO_WORKER_CONFIGURED", "cause_of", "unavailable_reason"]

NO_WORKER_CONFIGURED = ("no worker is configured: give --worker URL (or KVROUTE_WORKERS), "
                        "--discover, or add one with POST /workers")

#: (pattern in the error, cause), first match wins.
_CAUSES = (
    (re.compile(r"connection refused|ConnectError|Errno 111", re.I), "connection refused"),
    (re.compile(r"name or service not known|nodename nor servname|Errno -[23]", re.I),
     "host not found"),
    (re.compile(r"no answer within|timed? ?out|Timeout", re.I), "no answer in time"),
    (re.compile(r"answered (\d{3})|status (\d{3})|'(\d{3}) "), "status {}"),
    (re.compile(r"RemoteProtocolError|ReadError|reset by peer|disconnected", re.I),
     "connection dropped"),
    (re.compile(r"malformed|DecodeError|expected|not a fraction|JSON", re.I),
     "malformed answer"),
)
_URL = re.compile(r"https?://\S*?(?=:\s|\s|$)")
#: Characters of an error kept when no cause above matches.
_KEEP = 80


def cause_of(error: str | None) -> str:
    """The short cause of a worker's ``last_error`` (``"not checked yet"`` for none)."""
    if not error:
        return "not checked yet"
    for pattern, cause in _CAUSES:
        found = pattern.search(error)
        if found:
            return cause.format(next((g for g in found.groups() if g), "")).strip()
    text = _URL.sub("", error).strip(" :")
    text = text.removeprefix("worker").strip().split(": ", 1)[0]
    return text if len(text) <= _KEEP else text[: _KEEP - 3] + "..."


def unavailable_reason(entries: Iterable[WorkerEntry]) -> str:
    """Why none of ``entries`` is a candidate: ``"2 unhealthy (connection refused),
    1 incompatible (block size 16, not the router's 32)"``, or :data:`NO_WORKER_CONFIGURED`.
    """
    by_state: dict[str, Counter[str]] = {}
    for e in entries:
        by_state.setdefault(e.state.value, Counter())[cause_of(e.last_error)] += 1
    if not by_state:
        return NO_WORKER_CONFIGURED
    parts = []
    for state, causes in by_state.items():
        total = sum(causes.values())
        if len(causes) == 1:
            said = next(iter(causes))
        else:
            said = ", ".join(f"{n} {cause}" for cause, n in causes.most_common())
        parts.append(f"{total} {state} ({said})")
    return ", ".join(parts)
