"""``POST /v1/responses`` (OpenAI's Responses API) and ``POST /v1/messages`` (Anthropic's
Messages API), routed as the chat request they render as and forwarded as sent.

Each is a :class:`~router.http.request_path.Forward` whose decision reads the whole body and
routes its chat conversion (:mod:`openai_request.translated`) through the chat path: the
same tokenizer, chat template, hashing, flow control and quotas as ``/v1/chat/completions``.
The client's bytes go to the worker unchanged, and its answer (a stream of the API's own
events, or one JSON object) comes back as the worker sends it. No body of these is decided
before its end: the early decision reads a chat or completions prompt's first bytes, and
these put theirs elsewhere. A Responses request naming ``previous_response_id`` goes to the
worker that made that response, when the router saw it made (:mod:`router.http.response_homes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from openai_request.bodies import ApiError, parse_body
from openai_request.translated import chat_of_messages, chat_of_responses
from router.http.client_fields import refuse_transfer_fields
from router.http.incoming_body import IncomingBody
from router.http.request_path import Departure, Forward, decide
from router.http.response_homes import SNIFFED_BYTES, ResponseHomes, response_id
from router.http.state import RouterState
from router.routing.scheduler import Decision
from router.service import Route

__all__ = ["TRANSLATED_PATHS", "TranslatedForward", "translated_routes"]

#: Each endpoint and the conversion it is routed by.
TRANSLATED_PATHS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "/v1/responses": chat_of_responses, "/v1/messages": chat_of_messages}


class TranslatedForward(Forward):
    """A :class:`Forward` that routes a body by its chat conversion ``translate``."""

    __slots__ = ("homes", "translate")

    def __init__(self, state: RouterState, path: str,
                 translate: Callable[[dict[str, Any]], dict[str, Any]],
                 homes: ResponseHomes | None = None) -> None:
        super().__init__(state, "chat", path)
        self.translate = translate
        #: Where each stored response was made (Responses only).
        self.homes = homes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        homes = self.homes
        if homes is None:
            await super().__call__(scope, receive, send)
            return
        worker: int | None = None
        head = b""

        async def reading(message: Message) -> None:  # the answer's id, as it passes
            nonlocal worker, head
            if message["type"] == "http.response.start" and message["status"] == 200:
                worker = next((int(v) for k, v in message["headers"]
                               if k == b"x-kvroute-worker-id"), None)
            elif message["type"] == "http.response.body" and worker is not None:
                head = (head + message.get("body", b""))[:SNIFFED_BYTES]
                found = response_id(head)
                if found is not None or len(head) >= SNIFFED_BYTES:
                    if found is not None:
                        homes.made(found, worker)
                    worker = None
            await send(message)

        await super().__call__(scope, receive, reading)

    async def _decided(self, incoming: IncomingBody, headers: Mapping[str, str], trusted: bool,
                       departure: Departure
                       ) -> tuple[Route, dict[str, Any] | None, asyncio.Future[None] | None]:
        """Read the whole body, route its chat conversion; the body returned is the
        client's (its ``stream`` says how the answer comes back), forwarded as sent, so the
        router's own transfer fields are refused in it as in a chat body
        (:mod:`router.http.client_fields`).

        Raises:
            ApiError: the body's refusals; 400 for one the conversion cannot read;
                :func:`~router.http.request_path.decide`'s.
        """
        while not incoming.complete:
            await incoming.read_more()
        raw = incoming.whole()
        body = parse_body(raw, self.state.settings.max_body_bytes)
        if not self.state.settings.allow_client_transfer_fields:
            refuse_transfer_fields(body)
        try:
            chat = self.translate(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        route = await decide(self.state, chat, "chat", len(raw), headers, trusted, departure)
        previous = body.get("previous_response_id")
        if self.homes is not None and isinstance(previous, str):
            home = self.homes.home(previous)
            if home is not None and home in route.entries and home != route.decision.worker:
                route = dataclasses.replace(route, decision=Decision(home,
                                                                     route.decision.costs))
        return route, body, None


def translated_routes(state: RouterState) -> dict[str, TranslatedForward]:
    """The two endpoints as raw routes (:func:`httpapi.app.new_app`)."""
    return {path: TranslatedForward(state, path, translate,
                                    ResponseHomes() if path == "/v1/responses" else None)
            for path, translate in TRANSLATED_PATHS.items()}
