"""The worker's keep-alive connections to its backend.

:class:`relay.worker.backend.Backend` sends every request through
:meth:`ConnectionPool.exchange`. Kept-alive connections go stale: backends close idle
ones after a few seconds (llama-server, and uvicorn under vLLM, after 5), and a close
can cross the next request on the wire. The pool retires a connection before the
backend would (``keepalive_secs``), never takes one whose close already arrived, and
sends a request once more, on a new connection, when a reused one ended without one
byte of answer (docs/WORKER.md says why that is safe). Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import httpx

from relay.wire.http1 import ResponseHead
from relay.worker.connection import BackendConnection
from relay.worker.http1 import Origin

log = logging.getLogger("modelrelay.worker")
#: What a reused connection that ended without answering raises (the backend closed it).
_STALE = (httpx.ReadError, httpx.RemoteProtocolError)


class ConnectionPool:
    """Connections to one backend: idle ones kept for reuse, new ones opened as needed.

    At most ``max_idle`` idle connections are kept, each reused for at most
    ``keepalive_secs`` after its last exchange: less than the backend keeps it open
    (llama-server, and uvicorn under vLLM, close after 5 s), so the backend's close does
    not meet the next request. 0 reuses none. A connection the backend closes while idle
    leaves the pool at once, and one whose close is on its way is not taken.
    """

    def __init__(
        self,
        origin: Origin,
        *,
        connect_timeout: float,
        max_idle: int = 64,
        keepalive_secs: float = 4.0,
    ) -> None:
        self.origin = origin
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.keepalive_secs = keepalive_secs
        self.loop = asyncio.get_running_loop()
        self._idle: list[BackendConnection] = []
        #: Requests sent again because a reused connection closed unanswered.
        self.resent = 0
        self._ssl: ssl.SSLContext | None = None
        if origin.scheme == "https":
            self._ssl = httpx.create_ssl_context()
            self._ssl.set_alpn_protocols(["http/1.1"])

    async def exchange(
        self, head: bytes, body: bytes, *, write_timeout: float, read_timeout: float | None
    ) -> tuple[BackendConnection, ResponseHead]:
        """Send a request on a pooled connection; the connection and the response head.

        A reused connection that ends without one byte of answer was closed by the
        backend before it read the request (its idle timeout crossing the request): the
        request goes once more, on a new connection, and fails as usual if that one
        fails too. Whatever else fails closes the connection and raises.
        """
        conn = await self.acquire()
        try:
            return conn, await conn.start(
                head, body, write_timeout=write_timeout, read_timeout=read_timeout
            )
        except _STALE as exc:
            conn.abort()
            if conn.exchanges < 2 or conn.answered:
                raise
            log.debug("the backend closed a kept-alive connection (%s); sending again", exc)
        except BaseException:
            conn.abort()
            raise
        self.resent += 1
        conn = await self._connect()
        try:
            return conn, await conn.start(
                head, body, write_timeout=write_timeout, read_timeout=read_timeout
            )
        except BaseException:
            conn.abort()
            raise

    async def acquire(self) -> BackendConnection:
        """An idle connection still fresh, else a new one."""
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_secs and conn.quiet():
                return conn
            conn.abort()
        return await self._connect()

    def release(self, conn: BackendConnection) -> None:
        """Return ``conn`` after an exchange: kept when reusable and there is room."""
        if (
            not conn.reusable
            or conn.held
            or len(self._idle) >= self.max_idle
            or self.keepalive_secs <= 0
        ):
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def forget(self, conn: BackendConnection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()

    async def _connect(self) -> BackendConnection:
        o = self.origin
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: BackendConnection(self.loop, self.forget),
                    o.host,
                    o.port,
                    ssl=self._ssl,
                    server_hostname=o.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {o.host}:{o.port}") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return conn
