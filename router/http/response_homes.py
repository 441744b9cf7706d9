"""Which worker holds each stored Responses API answer, for the requests that continue it.

A server that stores responses (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps them
in its own process: a request naming ``previous_response_id`` can only be served where that
response was made. The router reads each ``/v1/responses`` answer's id as it passes (the
first ``"id"`` member of the answer, or of a stream's ``response.created`` event, within its
first 8 KiB) and remembers the worker that sent it; a later request naming that id goes to
that worker when it is a candidate, whatever the prefix match says (the others would answer
404), and to the routing rule's choice otherwise.

Bounded: the last ``capacity`` ids, least recently used first out. Pure: values in, values
out.
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["SNIFFED_BYTES", "ResponseHomes", "response_id"]

#: The bytes of an answer read for its id at most.
SNIFFED_BYTES = 8192
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')


def response_id(head: bytes) -> str | None:
    """The id in the first bytes of a Responses API answer, or None."""
    found = _ID.search(head)
    return found.group(1).decode("utf-8", "replace") if found else None


class ResponseHomes:
    """Response ids and the workers that made them (module docstring).

    Args:
        capacity: ids kept at most.
    """

    __slots__ = ("_homes", "capacity")

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._homes: OrderedDict[str, int] = OrderedDict()

    def made(self, response: str, worker: int) -> None:
        """``worker`` answered with the response ``response``."""
        self._homes[response] = worker
        self._homes.move_to_end(response)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def home(self, response: str) -> int | None:
        """The worker that made ``response``, if it is remembered."""
        worker = self._homes.get(response)
        if worker is not None:
            self._homes.move_to_end(response)
        return worker

    def __len__(self) -> int:
        return len(self._homes)
