"""Scripted raw HTTP/1.1 backends on 127.0.0.1:0 for the worker's connection pool.

Each accepted connection runs a handler on asyncio streams, so a test writes exactly
the bytes it wants (malformed ones included, see :mod:`tests.wire.responses`) and
closes when it wants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from relay.wire.http1 import ResponseHead
from relay.worker.connection import BackendConnection
from relay.worker.http1 import Origin, request_head
from relay.worker.pool import ConnectionPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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
