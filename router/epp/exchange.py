"""One HTTP request's ext_proc conversation, as a state machine with no I/O.

Envoy opens one ``Process`` stream per HTTP request and sends its phases in order; an
:class:`Exchange` takes each :class:`ProcessingRequest` and returns the answers to send:

1. ``request_headers``: remember the path (completions or chat) and the subset hint. Under
   ``BUFFERED`` the headers are let through at once; under ``FULL_DUPLEX_STREAMED`` they are
   held, because the destination header must ride on the headers answer. A request without a
   body (``GET /v1/models``) is sent at once to the least busy worker, unbooked.
2. ``request_body``: under ``BUFFERED`` one message with the whole body; under
   ``FULL_DUPLEX_STREAMED`` chunks, held until the decision: read as they arrive
   (:class:`~openai_request.early_body.EarlyBody`), decided as soon as the prompt's match is settled
   (:meth:`Picker.pick_early`), else at ``end_of_stream`` (or the request trailers); after
   the decision each chunk is sent back as it came, and a body decided early is kept until
   its end, where it must pass the check a buffered body passes (a repeated key, a field
   the router sets: 400; past the limit: 413) before its last chunk is sent on;
   a declared ``content-length`` past the router's ``max_body_bytes`` is refused (413) at
   the headers, and once what is held passes the router's ``max_body_bytes`` the request
   is refused at once with a 413 and the chunks dropped (a body that never ends holds at
   most the limit here).
   Then the body is parsed, :meth:`Picker.pick` decides and books, and the answer names the
   endpoint (header, ``envoy.lb`` metadata, route cache cleared; for disaggregated serving
   the decode worker, with the prefill worker in ``x-prefiller-host-port``). Under
   ``FULL_DUPLEX_STREAMED`` the held body is sent back whole after the headers answer. An
   invalid body gets an immediate 400 (or the picker's 404/503, or flow control's 429 with
   ``Retry-After``). While the fleet is saturated the picker answers :class:`Held`: the
   exchange answers nothing and keeps it in :attr:`Exchange.held`; the stream's owner awaits
   :meth:`Exchange.admitted` for the answers once flow control lets the request go.
3. ``response_headers`` / ``response_body``: the first response body chunk marks the end of
   prefill; the last one, or the stream's end (:meth:`Exchange.close`), releases the booking.

Invariant: a booking is released exactly once, whichever of the response's end or the
stream's close comes first (:meth:`Picker.release` is idempotent).
"""

from __future__ import annotations

import logging

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from openai_request.bodies import ApiError, parse_body
from openai_request.early_body import EarlyBody
from router.epp import messages
from router.epp.picker import ENDPOINT, Held, Pick, Picker
from router.http.client_fields import whole_body_check

__all__ = ["Exchange", "kind_for_path"]

log = logging.getLogger(__name__)

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def kind_for_path(path: str | None) -> str | None:
    """``"chat"`` or ``"completions"`` for an OpenAI path, ``None`` for any other."""
    path = (path or "").split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return None


class Exchange:
    """The EPP's side of one ext_proc stream.

    Args:
        picker: decides and books.
    """

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._kind: str | None = None
        self._subset: frozenset[str] | None = None
        self._duplex = False
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._refused = False
        self._streamed_response = False
        self._early: EarlyBody | None = None
        self._headers: dict[str, str] = {}
        self._held_body: tuple[bytes, bool] = (b"", False)
        self._strip_rank = not picker.service.settings.allow_client_transfer_fields
        #: A body decided early: its chunks so far, for the check at its end.
        self._seen: list[bytes] = []
        self.pick: Pick | None = None
        #: A request flow control holds: :meth:`admitted` answers it.
        self.held: Held | None = None
        #: Whether the decision came before the body's last chunk (full duplex).
        self.early = False

    def on_message(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers to one message from Envoy (none while a full-duplex body is held)."""
        if request.HasField("protocol_config"):
            self._duplex = request.protocol_config.request_body_mode == _FULL_DUPLEX
        if self._subset is None:
            self._subset = messages.subset_hint(request)
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            headers = request.request_headers
            self._headers = messages.header_map(headers)
            self._kind = kind_for_path(self._headers.get(":path"))
            if headers.end_of_stream:  # no body to route by: any worker answers alike
                try:
                    endpoint = self._picker.pick_any(self._subset)
                except ApiError as exc:
                    return [messages.immediate_error(exc)]
                return [messages.routed(endpoint, "request_headers",
                                        strip_rank=self._strip_rank)]
            if not self._duplex:
                return [messages.continue_headers()]
            length = messages.header(headers, "content-length")
            declared = int(length) if length and length.isascii() and length.isdigit() else None
            limit = self._picker.service.settings.max_body_bytes
            if declared is not None and declared > limit:  # refused before any byte is held
                self._refused = True
                self._picker.metrics.request(ENDPOINT, 413)
                return [messages.immediate_error(
                    ApiError(413, f"the request body is over {limit} bytes"))]
            self._early = EarlyBody(self._kind, declared, self._picker.service.only_model())
            return []
        if phase == "request_body":
            return self._on_body(request.request_body)
        if phase == "response_headers":
            return [messages.continue_response_headers()]
        if phase == "response_body":
            chunk = request.response_body
            if self.pick is not None:
                if not self._streamed_response:
                    self._streamed_response = True
                    self._picker.first_byte(self.pick)
                if chunk.end_of_stream:
                    self._picker.release(self.pick)
            return [messages.continue_response_body()]
        if phase == "request_trailers":
            trailers = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            if self._duplex and self.pick is None and not self._refused:
                # the body ended with trailers: decide now
                return [*self._decide(last=False), trailers]
            return [trailers]
        if phase == "response_trailers":
            if self.pick is not None:
                self._picker.release(self.pick)
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        log.warning("ext_proc message with no phase (%s): ignored", phase)
        return []

    def close(self) -> None:
        """The stream ended: whatever was booked and not yet released is released."""
        if self.pick is not None:
            self._picker.release(self.pick)

    def _on_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.pick is not None:  # a body chunk after the decision
            if not self._duplex:
                return [messages.continue_body()]
            if self.early:
                return self._after_early(body)
            return [_streamed(body.body, body.end_of_stream)]
        if self._refused:  # chunks Envoy had sent before it read the refusal
            return []
        self._held.append(body.body)
        self._held_bytes += len(body.body)
        limit = self._picker.service.settings.max_body_bytes
        if self._held_bytes > limit:
            self._drop()
            self._refused = True
            self._picker.metrics.request(ENDPOINT, 413)
            return [messages.immediate_error(
                ApiError(413, f"the request body is over {limit} bytes"))]
        if not body.end_of_stream:
            if not self._duplex:
                return [messages.continue_body()]
            tries = self._early.feed(body.body) if self._early is not None else None
            return self._decide_early(*tries) if tries is not None else []
        return self._decide(last=True)

    def _decide_early(self, partial: object, padded: object) -> list[ep.ProcessingResponse]:
        assert self._kind is not None, "an early try has the path's kind"
        try:
            pick = self._picker.pick_early(partial, padded, self._kind, self._subset,
                                           self._headers)
        except ApiError as exc:  # counted by the picker
            self._drop()
            self._refused = True
            return [messages.immediate_error(exc)]
        if pick is None:
            return []
        self.pick, self.early = pick, True
        raw = b"".join(self._held)
        self._drop()
        self._seen = [raw]  # kept for the check of the whole body at its end
        return [messages.routed(pick.endpoint, "request_headers", pick.prefiller,
                                self._strip_rank),
                _streamed(raw, False)]

    def _after_early(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        """A chunk of a body decided before its end: sent on, but its last chunk only once
        the whole body passes the check a buffered body passes (repeated keys, fields the
        router sets: :func:`router.http.client_fields.whole_body_check`), so a body the
        router would have refused whole never reaches its worker complete."""
        if self._refused:
            return []
        self._seen.append(body.body)
        self._held_bytes += len(body.body)
        settings = self._picker.service.settings
        try:
            if self._held_bytes > settings.max_body_bytes:
                raise ApiError(413, f"the request body is over {settings.max_body_bytes} "
                               "bytes")
            if body.end_of_stream:
                whole_body_check(settings.max_body_bytes,
                                 settings.allow_client_transfer_fields)(b"".join(self._seen))
        except ApiError as exc:
            self._refused = True
            self._seen = []
            self._picker.metrics.request(ENDPOINT, exc.status)
            return [messages.immediate_error(exc)]
        if body.end_of_stream:
            self._seen = []
        return [_streamed(body.body, body.end_of_stream)]

    def _drop(self) -> None:
        self._held.clear()
        if self._early is not None:
            self._early.stop()

    def _decide(self, last: bool) -> list[ep.ProcessingResponse]:
        raw = b"".join(self._held)
        self._drop()
        try:
            parsed = parse_body(raw, self._picker.service.settings.max_body_bytes)
        except ApiError as exc:
            self._picker.metrics.request(ENDPOINT, exc.status)
            return [messages.immediate_error(exc)]
        kind = self._kind or ("chat" if "messages" in parsed else "completions")
        try:
            picked = self._picker.pick(parsed, kind, self._subset, self._headers)
        except ApiError as exc:  # counted by the picker
            return [messages.immediate_error(exc)]
        if isinstance(picked, Held):
            self.held, self._held_body = picked, (raw, last)
            return []
        self.pick = picked
        return self._routed(raw, last)

    async def admitted(self) -> list[ep.ProcessingResponse]:
        """The answers to the request flow control held, once it leaves the queue: where it
        goes, or its refusal. Cancelled (the stream ended): it leaves the queue."""
        held, self.held = self.held, None
        assert held is not None, "admitted() without a held request"
        try:
            self.pick = await self._picker.admit(held)
        except ApiError as exc:  # counted by the picker
            return [messages.immediate_error(exc)]
        return self._routed(*self._held_body)

    def _routed(self, raw: bytes, last: bool) -> list[ep.ProcessingResponse]:
        assert self.pick is not None, "routed without a pick"
        endpoint, prefiller = self.pick.endpoint, self.pick.prefiller
        self._held_body = (b"", False)
        if not self._duplex:
            return [messages.routed(endpoint, "request_body", prefiller, self._strip_rank)]
        return [messages.routed(endpoint, "request_headers", prefiller, self._strip_rank),
                _streamed(raw, last)]


def _streamed(raw: bytes, last: bool) -> ep.ProcessingResponse:
    """A full-duplex body answer: ``raw`` sent on unchanged."""
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
            body=raw, end_of_stream=last)))))
