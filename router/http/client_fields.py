"""What a client may not set because the router sets it: the fields of disaggregated serving
and the header that pins a data-parallel rank.

The router speaks two protocols to its workers through the request itself:

- disaggregated serving (:mod:`router.http.disaggregated`, :mod:`router.http.bootstrap`):
  vLLM's ``kv_transfer_params`` (which name a prefill worker, its engine and the KV blocks a
  decode worker is to pull) and SGLang's ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room`` (which name the bootstrap server and the transfer);
- data-parallel ranks (:mod:`router.fleet.ranks`): the ``X-data-parallel-rank`` header.

A client that wrote them would speak for the router: point a decode worker at KV another
request holds, or at a host of its choosing, or pin its request to a rank the router did not
choose. So, unless ``allow_client_transfer_fields`` says the operator's clients speak these
protocols themselves (a router behind another P/D orchestrator):

1. a body that sets one of :data:`TRANSFER_FIELDS` (to anything but ``null``) is refused
   with a 400 naming the field (:func:`refuse_transfer_fields`): a body is forwarded as its
   bytes, so refusing is exact where dropping would mean rewriting it;
2. the client's ``X-data-parallel-rank`` is dropped before the request goes upstream
   (:func:`without_rank_header`); a rank the router chose is still pinned
   (:func:`router.http.failover.pinned`).

A long body decided before its end (:mod:`openai_request.early_body`) is checked again once
whole (:func:`whole_body_check`), before its last bytes go upstream: a field after its prompt
is refused the same way, and the worker never receives a complete body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from openai_request.bodies import ApiError, parse_body
from router.fleet.ranks import RANK_HEADER

__all__ = ["ALLOW_FLAG", "TRANSFER_FIELDS", "refuse_transfer_fields", "whole_body_check",
           "without_rank_header"]

#: The body fields the router sets for disaggregated serving.
TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
#: The flag that lets clients set them.
ALLOW_FLAG = "--allow-client-transfer-fields"


def refuse_transfer_fields(body: Mapping[str, Any]) -> None:
    """Refuse a client's body that sets a field the router sets (rule 1).

    Raises:
        ApiError: 400 naming the first such field.
    """
    for name in TRANSFER_FIELDS:
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is set by the router for disaggregated serving; a "
                           f"client may not send it (the router's {ALLOW_FLAG} allows it)",
                           param=name)


def without_rank_header(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` without a client's ``X-data-parallel-rank`` (rule 2); the same dict when
    it has none. ``headers`` has lower-cased names, as an ASGI scope gives them."""
    if RANK_HEADER not in headers:
        return headers
    return {k: v for k, v in headers.items() if k != RANK_HEADER}


def whole_body_check(max_bytes: int, allow_transfer_fields: bool
                     ) -> Callable[[bytes], dict[str, Any]]:
    """The check a body decided before its end passes once whole: it parses
    (:func:`~openai_request.bodies.parse_body`) and sets no transfer field unless allowed.

    Returns:
        A function of the whole body that returns it parsed, or raises :class:`ApiError`
        (400, 413) to refuse it.
    """
    def check(raw: bytes) -> dict[str, Any]:
        body = parse_body(raw, max_bytes)
        if not allow_transfer_fields:
            refuse_transfer_fields(body)
        return body
    return check
