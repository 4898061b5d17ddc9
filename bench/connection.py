"""One keep-alive HTTP/1.1 client connection, an asyncio ``Protocol`` (no HTTP library).

httpx cannot saturate a relay from one process, so the load generator speaks HTTP/1.1
itself: one request at a time on a connection (no pipelining), responses framed by
``content-length``, ``transfer-encoding: chunked`` or connection close. Body bytes can
go to a callback with their arrival time (``time.monotonic_ns``, ``CLOCK_MONOTONIC``,
the clock ``bench/upstream.py`` stamps its tokens with).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def chat_request(host: str, port: int, *, stream: bool, max_tokens: int | None = None) -> bytes:
    body = b'{"model":"bench-model","messages":[{"role":"user","content":"Say hi"}]'
    if stream:
        body += b',"stream":true'
    if max_tokens is not None:
        body += b',"max_tokens":%d' % max_tokens
    body += b"}"
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\n"
        b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
        b"content-length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body)
    )


@dataclass
class Response:
    status: int = 0
    headers: bytes = b""
    body: bytearray = field(default_factory=bytearray)


class HttpError(Exception):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive client connection; :meth:`request` sends and reads one exchange."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiter: asyncio.Future[Response] | None = None
        self.response: Response | None = None
        self.on_body: Callable[[bytes, int], None] | None = None
        self.lost = asyncio.get_running_loop().create_future()
        # parser state
        self.mode = "head"  # head | length | chunk-size | chunk-data | chunk-crlf | trailer | eof
        self.remaining = 0

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.mode == "eof" and self.response is not None:
                waiter.set_result(self.response)
            else:
                waiter.set_exception(HttpError(f"connection lost ({exc or 'closed'})"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def request(
        self, raw: bytes, on_body: Callable[[bytes, int], None] | None = None
    ) -> Response:
        if self.transport is None:
            raise HttpError("connection closed")
        self.response = Response()
        self.on_body = on_body
        self.mode = "head"
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        try:
            return await self.waiter
        finally:
            self.waiter = None

    # -- parsing ---------------------------------------------------------------

    def _body(self, data: bytes) -> None:
        if not data:
            return
        assert self.response is not None
        if self.on_body is not None:
            self.on_body(data, time.monotonic_ns())
        else:
            self.response.body += data

    def _done(self) -> None:
        self.mode = "head"
        if self.waiter is not None and not self.waiter.done():
            assert self.response is not None
            self.waiter.set_result(self.response)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while buf:
            mode = self.mode
            if mode == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, buf = buf[:end], buf[end + 4 :]
                response = self.response
                if response is None:
                    raise HttpError("unsolicited response")
                response.status = int(head[9:12])
                response.headers = head
                lower = head.lower()
                if b"transfer-encoding: chunked" in lower:
                    self.mode = "chunk-size"
                    continue
                at = lower.find(b"\r\ncontent-length:")
                if at >= 0:
                    stop = lower.find(b"\r\n", at + 2)
                    self.remaining = int(lower[at + 17 : stop if stop >= 0 else len(lower)])
                    if self.remaining == 0:
                        self._done()
                    else:
                        self.mode = "length"
                    continue
                self.mode = "eof"
            elif mode == "length":
                piece, buf = buf[: self.remaining], buf[self.remaining :]
                self.remaining -= len(piece)
                self._body(piece)
                if self.remaining == 0:
                    self._done()
            elif mode == "chunk-size":
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end].split(b";", 1)[0], 16)
                buf = buf[end + 2 :]
                if size == 0:
                    self.mode = "trailer"
                else:
                    self.remaining = size
                    self.mode = "chunk-data"
            elif mode == "chunk-data":
                piece, buf = buf[: self.remaining], buf[self.remaining :]
                self.remaining -= len(piece)
                self._body(piece)
                if self.remaining == 0:
                    self.mode = "chunk-crlf"
            elif mode == "chunk-crlf":
                if len(buf) < 2:
                    break
                buf = buf[2:]
                self.mode = "chunk-size"
            elif mode == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                line, buf = buf[:end], buf[end + 2 :]
                if not line:
                    self._done()
            else:  # eof-delimited body
                self._body(buf)
                buf = b""
        self.buf = buf
