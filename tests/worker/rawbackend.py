"""Scripted raw HTTP/1.1 backends on 127.0.0.1:0 for the worker's connection pool.

Each accepted connection runs a handler on asyncio streams, so a test writes exactly
the bytes it wants (malformed ones included) and closes when it wants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from relay.worker.connection import BackendConnection
from relay.worker.http1 import MAX_HEAD_BYTES, Origin, ResponseHead, request_head
from relay.worker.pool import ConnectionPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\nok"

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


SHORTEST = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-pad: \r\n\r\n"


def length_head(value: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: " + value.encode() + b"\r\n\r\n"


def padded_head(size: int) -> bytes:
    """A response head of exactly ``size`` bytes (an ``x-pad`` header fills it)."""
    return SHORTEST.replace(b"x-pad: ", b"x-pad: " + b"p" * (size - len(SHORTEST)))


#: Responses no exchange may survive; the backend closes after writing each one.
MALFORMED = {
    "negative chunk size": CHUNKED_HEAD + b"1\r\nA\r\n-6\r\nXXXX",
    "chunk size with a plus sign": CHUNKED_HEAD + b"+1\r\nA\r\n0\r\n\r\n",
    "chunk size with 0x": CHUNKED_HEAD + b"0x1\r\nA\r\n0\r\n\r\n",
    "chunk size with an underscore": CHUNKED_HEAD + b"1_0\r\n" + b"A" * 16 + b"\r\n0\r\n\r\n",
    "chunk size not hex": CHUNKED_HEAD + b"zz\r\n",
    "chunk size past 64 bits": CHUNKED_HEAD + b"1" + b"0" * 16 + b"\r\n",
    "chunk data longer than its size": CHUNKED_HEAD + b"1\r\nAB\r\n0\r\n\r\n",
    "superscript two as content-length": length_head("\u00b2") + b"ok",
    "arabic-indic digit as content-length": length_head("\u0662") + b"ok",
    "fullwidth digit as content-length": length_head("\uff12") + b"ok",
    "content-length with a sign": length_head("+2") + b"ok",
    "content-length list": length_head("2, 2") + b"ok",
    "two different content-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
    b"content-length: 3\r\n\r\nok",
    "content-length then transfer-encoding": b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n"
    b"transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "transfer-encoding then content-length": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
    b"content-length: 3\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "a transfer-coding other than chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n"
    b"\r\nabc",
    "truncated mid-chunk": CHUNKED_HEAD + b"a\r\nabc",
    "truncated between chunks": CHUNKED_HEAD + b"3\r\nabc\r\n",
    "truncated mid-head": b"HTTP/1.1 200 OK\r\ncontent-len",
    "truncated mid-body": length_head("10") + b"abc",
    "garbage status line": b"SPDY/9 what\r\n\r\n",
    "status code not digits": b"HTTP/1.1 2x0 OK\r\n\r\n",
    "status code below 100": b"HTTP/1.1 099 Odd\r\ncontent-length: 0\r\n\r\n",
    "an HTTP/2 status line": b"HTTP/2.0 200 OK\r\ncontent-length: 0\r\n\r\n",
    "a header line without a colon": b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    "a folded header line": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n  folded\r\ncontent-length: 0\r\n\r\n",
    "a control byte in a header value": b"HTTP/1.1 200 OK\r\nx-a: \x01\r\n\r\n",
    "switching protocols": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
    "bytes after the end of the response": OK + b"EXTRA",
    "a second response after the first": OK + OK,
    "only interim responses": b"HTTP/1.1 100 Continue\r\n\r\n",
    "a head one byte over the limit": padded_head(MAX_HEAD_BYTES + 1) + b"ok",
}


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


class Backend:
    """A raw server on 127.0.0.1:0; records the connections it accepted.

    ``async with`` yields a :class:`ConnectionPool` to it.
    """

    def __init__(self, handler: Handler, *, keepalive_secs: float = 4.0) -> None:
        self.handler = handler
        self.keepalive_secs = keepalive_secs
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> ConnectionPool:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        origin = Origin.parse(f"http://127.0.0.1:{port}")
        self.pool = ConnectionPool(origin, connect_timeout=5, keepalive_secs=self.keepalive_secs)
        return self.pool

    async def __aexit__(self, *exc: object) -> None:
        self.pool.close()
        assert self.server is not None
        self.server.close()


def answering(*responses: bytes, then_close: bool = False) -> Handler:
    """Answer each request on a connection with the next of ``responses``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await read_request(reader)
            writer.write(response)
            await writer.drain()
        if not then_close:
            await reader.read()  # until the client leaves

    return handler


REQUEST_BODY = b"{}"


async def post(
    pool: ConnectionPool, *, read_timeout: float | None = 5.0
) -> tuple[BackendConnection, ResponseHead]:
    """Send one request through ``pool`` (re-sent once as the pool does); its head."""
    head = request_head(pool.origin, "/v1/chat/completions", {"x-test": "1"}, 2)
    return await pool.exchange(head, REQUEST_BODY, write_timeout=5, read_timeout=read_timeout)


async def collect(pool: ConnectionPool, limit: int = 1 << 20) -> tuple[ResponseHead, bytes]:
    conn, head = await post(pool)
    conn.collect(limit)
    await conn.finished()
    body = conn.body()
    pool.release(conn)
    return head, body


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
