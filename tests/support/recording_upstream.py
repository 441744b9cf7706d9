"""A worker that records the exact bytes of every request it receives, for tests of what the
router sends upstream (framing, headers): it answers ``/model_info`` and ``/load`` as a worker
does and ``POST /v1/completions`` with a small completion, and keeps each completions
request's bytes as they came off the socket, parsed by h11 (a strict HTTP/1.1 parser) for
its framing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import h11

from kvroute.up import free_port

__all__ = ["RecordedRequest", "RecordingUpstream"]


@dataclass
class RecordedRequest:
    """One request as the upstream read it."""

    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    complete: bool = False

    def header(self, name: bytes) -> list[bytes]:
        """Every value of the header ``name`` (lower case)."""
        return [v for k, v in self.headers if k == name]


class RecordingUpstream:
    """The worker (module docstring), on 127.0.0.1 at a free port."""

    def __init__(self, model: str = "kvroute-sim") -> None:
        self.model = model
        self.port = free_port()
        self.requests: list[RecordedRequest] = []
        #: Every connection's bytes as received.
        self.connections: list[bytearray] = []
        #: Anything h11 refused in what the router sent.
        self.protocol_errors: list[str] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def completions(self) -> list[RecordedRequest]:
        """The ``POST /v1/completions`` requests, in arrival order."""
        return [r for r in self.requests if r.target.startswith(b"/v1/")]

    async def __aenter__(self) -> RecordingUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        current: RecordedRequest | None = None
        received = bytearray()
        self.connections.append(received)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    received += data
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(event, h11.Request):
                    current = RecordedRequest(event.target, list(event.headers))
                    self.requests.append(current)
                elif isinstance(event, h11.Data) and current is not None:
                    current.body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage) and current is not None:
                    current.complete = True
                    writer.write(self._answer(conn, current))
                    await writer.drain()
                    current = None
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except h11.RemoteProtocolError as exc:
            self.protocol_errors.append(str(exc))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def _answer(self, conn: h11.Connection, request: RecordedRequest) -> bytes:
        if request.target == b"/model_info":
            payload = {"model": self.model, "block_size": 32, "tokenizer": "bytes-v1",
                       "instance_id": f"recording-{self.port}", "events_endpoint": None,
                       "max_model_len": 100000}
        elif request.target == b"/load":
            payload = {"running": 0, "waiting": 0}
        else:
            payload = {"choices": [{"index": 0, "text": "ok"}],
                       "usage": {"prompt_tokens": 1}}
        body = json.dumps(payload).encode()
        return b"".join([
            conn.send(h11.Response(status_code=200, headers=[
                ("content-type", "application/json"), ("content-length", str(len(body)))])),
            conn.send(h11.Data(data=body)), conn.send(h11.EndOfMessage())])
