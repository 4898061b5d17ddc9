"""The worker's asyncio network backend behaves like httpx's stock one where it matters."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from relay.worker import network

LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=8)


async def serve(handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def test_a_keepalive_connection_the_server_closed_is_not_reused():
    connections = []

    async def answer_once_then_close(reader, writer):
        connections.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive promised by HTTP/1.1, but the server hangs up

    server, url = await serve(answer_once_then_close)
    async with server, httpx.AsyncClient(transport=network.transport(LIMITS)) as client:
        first = await client.get(url)
        await asyncio.sleep(0)  # let the close reach the client's reader
        for _ in range(3):
            assert (await client.get(url)).text == "ok"
        assert first.text == "ok"
    assert len(connections) == 4  # a fresh connection each time, never a dead one


async def test_keepalive_connections_are_reused():
    connections = []

    async def keep_alive(reader, writer):
        connections.append(writer)
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    server, url = await serve(keep_alive)
    async with server, httpx.AsyncClient(transport=network.transport(LIMITS)) as client:
        for _ in range(5):
            assert (await client.get(url)).text == "ok"
    assert len(connections) == 1


async def test_errors_map_to_httpx_exceptions():
    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(10)

    server, url = await serve(silent)
    async with server, httpx.AsyncClient(transport=network.transport(LIMITS)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url, timeout=httpx.Timeout(5, read=0.05))
    async with httpx.AsyncClient(transport=network.transport(LIMITS)) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url)  # the server is gone
