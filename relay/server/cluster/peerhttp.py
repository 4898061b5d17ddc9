"""A lean HTTP/1.1 client for requests from one server process to another.

The cluster link (:mod:`relay.server.cluster.proxy`) sends each request to the process its
worker is connected to, and that process's own fast path answers: a ``Content-Length``
body, a chunked stream, or a body up to the end of the connection. Responses are read
as the worker reads its backend's (:mod:`relay.wire.http1`, llhttp): a malformed status
line, header, chunk size or ``Content-Length``, a response framed both ways, or bytes
after its end are a :class:`PeerError`, never a guess. Connections are kept alive and
reused, newest first, per address; one that ended its response cleanly goes back to
the pool, any other is closed. Closing a connection mid-response is how the other
process learns the client left.

A general-purpose client (httpx) checked every pooled connection's socket on every
request: with a few dozen connections between two busy processes that took most of
the sending process's CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from relay.wire.http1 import ResponseReader

#: Idle connections kept per address.
MAX_IDLE = 256
#: Time allowed to connect, and to write a request.
CONNECT_SECS = 5.0
WRITE_SECS = 30.0
#: The most one read takes from a socket.
READ_BYTES = 65536


class PeerError(Exception):
    """The other process could not be reached, or its answer broke off."""


class PeerRefused(PeerError):
    """The connection was refused: nothing listens at the address (the process is gone)."""


class _PeerResponseReader(ResponseReader):
    """The responses of one connection to another process; malformed ones raise
    :class:`PeerError`. What llhttp hands over of a body is kept in :attr:`body` until
    :meth:`PeerResponse.chunks` takes it (all of it, or the connection is closed: a
    reused connection's reader holds none)."""

    __slots__ = ("body",)

    error = PeerError

    def __init__(self) -> None:
        self.body: list[bytes] = []
        super().__init__(None, self._take)

    def _take(self, data: bytes) -> None:
        self.body.append(data)


class _Conn:
    __slots__ = ("parsed", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.parsed = _PeerResponseReader()

    def close(self) -> None:
        self.writer.transport.abort()


class PeerResponse:
    def __init__(
        self, parsed: _PeerResponseReader, conn: _Conn, client: PeerClient, address: str
    ) -> None:
        head = parsed.head
        assert head is not None
        self.status = head.status
        #: ``(lowercased name, value)`` as received (values decoded as ISO-8859-1).
        self.headers = head.headers
        self._parsed = parsed
        self._conn = conn
        self._client = client
        self._address = address
        self._done = False
        self._header_map = dict(head.headers)

    def header(self, name: str) -> str:
        """A header's value ("" when absent)."""
        return self._header_map.get(name.lower(), "")

    def has(self, name: str) -> bool:
        return name.lower() in self._header_map

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed): what each read brought."""
        parsed, reader = self._parsed, self._conn.reader
        try:
            while True:
                if parsed.body:
                    pieces, parsed.body = parsed.body, []
                    yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                if parsed.complete:
                    break
                data = await reader.read(READ_BYTES)
                if not data:
                    if parsed.until_close:
                        break
                    raise PeerError("connection ended inside the body")
                parsed.feed(data)
        except OSError as exc:
            raise PeerError(str(exc) or exc.__class__.__name__) from None
        self._done = True

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def release(self) -> None:
        """End the exchange: a connection whose response was read to its end goes back
        to the pool; otherwise it is closed (telling the other process)."""
        head = self._parsed.head
        if self._done and head is not None and head.keep_alive:
            self._client._idle(self._address, self._conn)
        else:
            self._conn.close()


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
            # already read) or ends before the first byte of the answer; post() then
            # sends once more.
            if not conn.writer.transport.is_closing() and not conn.reader.at_eof():
                return conn, True
            conn.close()
        url = urlsplit(address)
        try:
            async with asyncio.timeout(CONNECT_SECS):
                reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
        except ConnectionRefusedError as exc:
            raise PeerRefused(str(exc)) from None
        except (OSError, TimeoutError) as exc:
            raise PeerError(str(exc) or exc.__class__.__name__) from None
        return _Conn(reader, writer), False

    async def post(
        self, address: str, path: str, headers: dict[str, str], body: bytes
    ) -> PeerResponse:
        """Send a POST and read the response head; the body is read from the result.

        A reused connection that ends before one byte of the answer was closed by the
        other process while idle: the request goes once more, on a new connection.
        """
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
            parsed = conn.parsed
            parsed.expect()
            try:
                conn.writer.write(request)
                async with asyncio.timeout(WRITE_SECS):
                    await conn.writer.drain()
                while parsed.head is None:
                    data = await conn.reader.read(READ_BYTES)
                    if not data:
                        raise ConnectionResetError("connection ended before the response")
                    parsed.feed(data)
            except (OSError, TimeoutError) as exc:
                conn.close()
                if reused and attempt == 1 and not parsed.received:
                    continue  # the other side had closed the idle connection: a new one
                raise PeerError(str(exc) or exc.__class__.__name__) from None
            except BaseException:  # PeerError, cancellation
                conn.close()
                raise
            return PeerResponse(parsed, conn, self, address)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for idle in self._pool.values():
            for conn in idle:
                conn.close()
        self._pool.clear()
