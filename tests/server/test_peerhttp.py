"""The cluster link's HTTP/1.1 client against a raw socket server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from relay.server.cluster.peerhttp import PeerClient, PeerError, PeerRefused

Reply = Callable[[bytes], bytes | None]


async def _server(reply: Reply) -> AsyncIterator[tuple[str, list[int]]]:
    """Answer each request with ``reply(request)`` (None: close the connection; so
    does an answer with ``Connection: close``, once written);
    yields the address and the number of requests seen per connection."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(0)
        index = len(seen) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                seen[index] += 1
                answer = reply(head + body)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


async def _run(reply: Reply, calls: int = 1) -> tuple[list[tuple[int, bytes]], list[int]]:
    client = PeerClient()
    out = []
    async for address, seen in _server(reply):
        for _ in range(calls):
            response = await client.post(address, "/v1/x", {"x-a": "1"}, b'{"n":1}')
            out.append((response.status, await response.read()))
            response.release()
        await client.aclose()
        return out, seen
    raise AssertionError


async def test_content_length_bodies_reuse_one_connection():
    reply = lambda req: b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"  # noqa: E731
    out, seen = await _run(reply, calls=3)
    assert out == [(200, b"hello")] * 3
    assert seen == [3]


async def test_chunked_bodies_are_unframed():
    body = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nTrailer: x\r\n\r\n"
    reply = lambda req: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body  # noqa: E731
    out, seen = await _run(reply, calls=2)
    assert out == [(200, b"hello, world")] * 2
    assert seen == [2]


async def test_a_body_without_length_ends_with_the_connection_which_is_not_reused():
    reply = lambda req: b"HTTP/1.1 503 No\r\nConnection: close\r\n\r\nbusy"  # noqa: E731
    out, seen = await _run(reply, calls=2)
    assert out == [(503, b"busy")] * 2
    assert seen == [1, 1]


async def test_a_pooled_connection_the_server_closed_is_replaced_transparently():
    count = 0

    def reply(req: bytes) -> bytes | None:
        nonlocal count
        count += 1
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    client = PeerClient()
    async for address, _ in _server(reply):
        first = await client.post(address, "/", {}, b"")
        assert await first.read() == b"ok"
        first.release()
        # The server drops the idle connection; the next request must not fail.
        for conn in client._pool[address]:
            conn.writer.transport.abort()
        second = await client.post(address, "/", {}, b"")
        assert await second.read() == b"ok"
        second.release()
        assert count == 2
    await client.aclose()


async def test_a_response_cut_mid_body_is_an_error_and_its_connection_is_closed():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()  # three bytes of ten, then the connection ends

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    address = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = PeerClient()
    try:
        response = await client.post(address, "/", {}, b"")
        with pytest.raises(PeerError):
            async with asyncio.timeout(5):
                await response.read()
        response.release()
        assert not client._pool.get(address)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_nothing_listening_is_refused():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(PeerRefused):
        await PeerClient().post(f"http://127.0.0.1:{port}", "/", {}, b"")


async def test_a_garbled_status_line_is_an_error():
    out_err = None
    client = PeerClient()
    async for address, _ in _server(lambda req: b"SPDY/9 what\r\n\r\n"):
        with pytest.raises(PeerError) as caught:
            await client.post(address, "/", {}, b"")
        out_err = caught.value
    assert "bad status line" in str(out_err)
    await client.aclose()
