"""A lean HTTP/1.1 client for requests from one server process to another.

The cluster link (:mod:`relay.server.cluster.proxy`) sends each request to the process its
worker is connected to, and that process's own fast path answers: a ``Content-Length``
body, a chunked stream, or a body up to the end of the connection. That is all this
client speaks. Connections are kept alive and reused, newest first, per address; one
that ended its response cleanly goes back to the pool, any other is closed. Closing a
connection mid-response is how the other process learns the client left.

A general-purpose client (httpx) checked every pooled connection's socket on every
request: with a few dozen connections between two busy processes that took most of
the sending process's CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: The longest response head accepted (status line and headers).
MAX_HEAD = 64 * 1024
#: Idle connections kept per address.
MAX_IDLE = 256
#: Time allowed to connect, and to write a request.
CONNECT_SECS = 5.0
WRITE_SECS = 30.0


class PeerError(Exception):
    """The other process could not be reached, or its answer broke off."""


class PeerRefused(PeerError):
    """The connection was refused: nothing listens at the address (the process is gone)."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.transport.abort()


@dataclass
class PeerResponse:
    status: int
    headers: list[tuple[str, str]]
    _conn: _Conn
    _client: PeerClient
    _address: str
    _length: int | None = None
    _chunked: bool = False
    _reusable: bool = True
    _done: bool = False
    _left: int = 0
    _header_map: dict[str, str] = field(default_factory=dict)

    def header(self, name: str) -> str:
        """A header's value ("" when absent)."""
        return self._header_map.get(name.lower(), "")

    def has(self, name: str) -> bool:
        return name.lower() in self._header_map

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed)."""
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip() or b"x", 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    async for data in _exactly(reader, size, "a chunk"):
                        yield data
                    if await reader.readexactly(2) != b"\r\n":
                        raise PeerError("bad chunk framing")
            elif self._length is not None:
                async for data in _exactly(reader, self._length, "the body"):
                    yield data
            else:
                self._reusable = False
                while data := await reader.read(65536):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise PeerError(f"bad response body: {exc.__class__.__name__}") from None
        except OSError as exc:
            raise PeerError(str(exc) or exc.__class__.__name__) from None
        self._done = True

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def release(self) -> None:
        """End the exchange: a connection whose response was read to its end goes back
        to the pool; otherwise it is closed (telling the other process)."""
        if self._done and self._reusable:
            self._client._idle(self._address, self._conn)
        else:
            self._conn.close()


async def _exactly(reader: asyncio.StreamReader, size: int, what: str) -> AsyncIterator[bytes]:
    """``size`` bytes from ``reader`` as they arrive."""
    left = size
    while left:
        data = await reader.read(min(left, 65536))
        if not data:
            raise PeerError(f"connection ended inside {what}")
        left -= len(data)
        yield data


class PeerClient:
    def __init__(self) -> None:
        self._pool: dict[str, list[_Conn]] = {}

    def _idle(self, address: str, conn: _Conn) -> None:
        idle = self._pool.setdefault(address, [])
        if len(idle) < MAX_IDLE and not conn.writer.transport.is_closing():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, address: str) -> tuple[_Conn, bool]:
        """A connection to ``address`` and whether it was reused."""
        idle = self._pool.get(address)
        while idle:
            conn = idle.pop()
            # A reused connection the other side closed meanwhile shows it here (EOF
            # already read) or fails on the first read; the caller retries once.
            if not conn.writer.transport.is_closing() and not conn.reader.at_eof():
                return conn, True
            conn.close()
        url = urlsplit(address)
        try:
            async with asyncio.timeout(CONNECT_SECS):
                reader, writer = await asyncio.open_connection(
                    url.hostname, url.port or 80, limit=MAX_HEAD
                )
        except ConnectionRefusedError as exc:
            raise PeerRefused(str(exc)) from None
        except (OSError, TimeoutError) as exc:
            raise PeerError(str(exc) or exc.__class__.__name__) from None
        return _Conn(reader, writer), False

    async def post(
        self, address: str, path: str, headers: dict[str, str], body: bytes
    ) -> PeerResponse:
        """Send a POST and read the response head; the body is read from the result."""
        url = urlsplit(address)
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", f"Content-Length: {len(body)}"]
        lines += [
            f"{name}: {value}"
            for name, value in headers.items()
            if name.lower() not in ("host", "content-length", "transfer-encoding", "connection")
        ]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        for attempt in (1, 2):
            conn, reused = await self._connect(address)
            try:
                conn.writer.write(request)
                async with asyncio.timeout(WRITE_SECS):
                    await conn.writer.drain()
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.CancelledError:
                conn.close()
                raise
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                conn.close()
                if reused and attempt == 1:
                    continue  # the other side had closed the idle connection: a new one
                raise PeerError(str(exc) or exc.__class__.__name__) from None
            except asyncio.LimitOverrunError:
                conn.close()
                raise PeerError("response head too large") from None
            return self._response(address, conn, head)
        raise AssertionError("unreachable")

    def _response(self, address: str, conn: _Conn, head: bytes) -> PeerResponse:
        status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            conn.close()
            raise PeerError(f"bad status line {status_line[:80]!r}")
        headers = []
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers.append((name.strip(), value.strip()))
        response = PeerResponse(int(parts[1]), headers, conn, self, address)
        response._header_map = {k.lower(): v for k, v in headers}
        encoding = response.header("transfer-encoding").lower()
        if "chunked" in encoding:
            response._chunked = True
        elif (length := response.header("content-length")).isdigit():
            response._length = int(length)
        elif response.status in (204, 304) or 100 <= response.status < 200:
            response._length = 0
        if response.header("connection").lower() == "close" or parts[0] == "HTTP/1.0":
            response._reusable = False
        return response

    async def aclose(self) -> None:
        for idle in self._pool.values():
            for conn in idle:
                conn.close()
        self._pool.clear()
