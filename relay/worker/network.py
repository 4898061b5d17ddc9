"""An asyncio-native network backend for httpcore (the engine under httpx).

httpx on asyncio goes through anyio by default, and its connection pool asks every
pooled connection "has the server closed you?" on every request; through anyio each
of those questions builds a dict of socket attributes. At hundreds of requests a
second that was most of the worker's CPU. This backend answers the same questions
from asyncio's own stream objects.

Only used by the worker's discovery client (``GET /v1/models``, ``/props``): plain
TCP (and TLS when the backend URL is ``https``) to the local model server. Requests
are forwarded on :mod:`relay.worker.connection`.
"""

# ruff: noqa: ASYNC109  (the timeout parameters are httpcore's interface)
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx
from httpcore._utils import is_socket_readable

SocketOption = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("timed out reading from the backend") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(buffer)
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout("timed out writing to the backend") from None
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            await self.aclose()
            raise httpcore.ConnectTimeout("timed out in the TLS handshake") from None
        except (OSError, ssl.SSLError) as exc:
            await self.aclose()
            raise httpcore.ConnectError(str(exc)) from exc
        return self

    def get_extra_info(self, info: str) -> Any:
        writer = self._writer
        match info:
            case "socket":
                return writer.get_extra_info("socket")
            case "is_readable":
                # asyncio reads ahead: a server's close may already sit in the reader
                # (EOF) rather than on the socket, so ask both.
                if self._reader.at_eof() or writer.is_closing():
                    return True
                sock = writer.get_extra_info("socket")
                return sock is None or is_socket_readable(sock)
            case "ssl_object":
                return writer.get_extra_info("ssl_object")
            case "client_addr":
                return writer.get_extra_info("sockname")
            case "server_addr":
                return writer.get_extra_info("peername")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {host}:{port}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = writer.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"timed out connecting to {path}") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """An ``httpx.AsyncHTTPTransport`` whose connection pool uses :class:`AsyncioBackend`.

    httpx has no public switch for the network backend, so the transport's pool is
    rebuilt with the same settings (httpx and httpcore are pinned).
    """
    http = httpx.AsyncHTTPTransport(limits=limits)
    stock = http._pool
    assert isinstance(stock, httpcore.AsyncConnectionPool)
    http._pool = httpcore.AsyncConnectionPool(
        ssl_context=stock._ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return http
