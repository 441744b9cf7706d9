"""HTTP/1.1 spoken by hand over a loopback socket, for what an HTTP client library will not do:
declare a body and not send it, stream a body without end, leave mid-body, or say nothing.

Every wait is bounded; a timeout raises ``TimeoutError`` in the test.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Answer", "closed_by_peer", "get_with_header", "leave_mid_body", "open_idle",
           "post_chunked_then_pause", "post_declared", "stream_chunked"]

WAIT = 10.0


class Answer:
    """A response's status line and headers (lower-cased names)."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split()[1]), headers)


async def post_declared(port: int, path: str, content_length: int) -> Answer:
    """Send only the head of a POST declaring ``content_length`` bytes; return the answer
    that comes back without any of the body sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head(path, {"Content-Length": str(content_length)}))
        await writer.drain()
        return await _read_answer(reader)
    finally:
        writer.close()


async def stream_chunked(port: int, path: str, *, chunk: int, cap: int) -> tuple[Answer, int]:
    """POST a chunked body of ``b" "`` bytes, ``chunk`` at a time, until the server answers or
    ``cap`` bytes are sent (the body is never ended). Returns the answer and the bytes sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0

    async def send() -> None:
        nonlocal sent
        writer.write(_head(path, {"Transfer-Encoding": "chunked"}))
        piece = f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n"
        with contextlib.suppress(ConnectionError):
            while sent < cap:
                writer.write(piece)
                await writer.drain()
                sent += chunk

    sender = asyncio.create_task(send())
    try:
        answer = await _read_answer(reader)
        return answer, sent
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.close()


async def leave_mid_body(port: int, path: str) -> None:
    """Declare a 1000-byte body, send 10 bytes of it, and close the connection."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head(path, {"Content-Length": "1000"}) + b'{"prompt":')
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def open_idle(port: int, count: int) -> list[tuple[asyncio.StreamReader,
                                                           asyncio.StreamWriter]]:
    """Open ``count`` connections that send nothing."""
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection within ``within`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True



async def _closes_after_answer(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection after its answer (within ``WAIT``)."""
    try:
        await asyncio.wait_for(reader.read(), WAIT)  # the answer's body, then end of stream
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def post_chunked_then_pause(port: int, path: str, piece: bytes) -> tuple[Answer, bool]:
    """POST a chunked body's first ``piece`` and then send nothing more; return the answer
    and whether the server closed the connection after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head(path, {"Transfer-Encoding": "chunked"})
                     + f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        await writer.drain()
        answer = await _read_answer(reader)
        return answer, await _closes_after_answer(reader)
    finally:
        writer.close()


async def get_with_header(port: int, path: str, value_bytes: int, *, piece: int = 16 * 1024
                          ) -> tuple[Answer, bool]:
    """GET ``path`` with one ``X-Padding`` header of ``value_bytes`` bytes, sent ``piece`` at
    a time until the server answers; return the answer and whether the server closed the
    connection after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\nX-Padding: ".encode())
        with contextlib.suppress(ConnectionError):
            for start in range(0, value_bytes, piece):
                writer.write(b"a" * min(piece, value_bytes - start))
                await writer.drain()
            writer.write(b"\r\n\r\n")
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        answer = await _read_answer(reader)
        return answer, await _closes_after_answer(reader)
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.close()
