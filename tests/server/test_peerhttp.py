"""The cluster link's HTTP/1.1 client against raw socket servers on 127.0.0.1.

Hostile answers (:mod:`tests.wire.responses`: malformed framing, truncation, an
oversized head) are a PeerError for that request only, and the next request is served
on a new connection. The reader both clients share is tested in
``tests/wire/test_http1.py``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from relay.server.cluster.peerhttp import PeerClient, PeerError, PeerRefused
from relay.wire.http1 import MAX_HEAD_BYTES
from tests.wire.responses import MALFORMED

Reply = Callable[[bytes], bytes | None]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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
    assert "malformed response" in str(out_err)
    await client.aclose()


async def test_interim_responses_are_skipped_and_a_body_may_end_with_the_connection():
    answers = [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ]
    out, seen = await _run(lambda req: answers.pop(0), calls=2)
    assert out == [(200, b"ok"), (200, b"until the end")]
    assert seen == [2]


# --------------------------------------------------------------------------- hostile answers

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class RawServer:
    """A server on 127.0.0.1:0 running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.address = ""

    async def __aenter__(self) -> RawServer:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(accept, "127.0.0.1", 0)
        self.address = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


async def _request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))


async def _exchange(client: PeerClient, address: str) -> tuple[int, bytes]:
    response = await client.post(address, "/v1/x", {}, b"{}")
    try:
        return response.status, await response.read()
    finally:
        response.release()


@pytest.mark.parametrize("answer", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_answer_is_a_peer_error_and_the_next_request_is_served(answer: bytes):
    first = True

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal first
        if first:
            first = False
            await _request(reader)
            writer.write(answer)
            return  # then closed
        while True:
            await _request(reader)
            writer.write(OK)

    client = PeerClient()
    async with RawServer(handler) as server:
        async with asyncio.timeout(5):
            with pytest.raises(PeerError):
                await _exchange(client, server.address)
            assert not client._pool.get(server.address)
            assert await _exchange(client, server.address) == (200, b"ok")
        assert server.connections == 2
    await client.aclose()


async def test_an_answer_framed_both_ways_is_refused_and_its_connection_not_reused():
    both = CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n") + (
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    first = True

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal first
        if first:
            first = False
            await _request(reader)
            writer.write(both)
        while True:  # the connection stays open: whatever comes next is answered
            await _request(reader)
            writer.write(OK)

    client = PeerClient()
    async with RawServer(handler) as server:
        with pytest.raises(PeerError, match="Content-Length"):
            await _exchange(client, server.address)
        assert await _exchange(client, server.address) == (200, b"ok")
        assert server.connections == 2
    await client.aclose()


_SHORTEST = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: \r\n\r\n"


@pytest.mark.parametrize("split", [None, 1000, MAX_HEAD_BYTES - 1, MAX_HEAD_BYTES])
async def test_a_head_of_the_limit_is_read_and_one_byte_more_is_refused(split: int | None):
    def padded(size: int) -> bytes:
        return _SHORTEST.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (size - len(_SHORTEST))) + b"ok"

    answers = [padded(MAX_HEAD_BYTES), padded(MAX_HEAD_BYTES + 1)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _request(reader)
            answer = answers.pop(0)
            if split is not None:
                writer.write(answer[:split])
                await writer.drain()
                await asyncio.sleep(0.01)
                answer = answer[split:]
            writer.write(answer)

    client = PeerClient()
    async with RawServer(handler) as server:
        assert await _exchange(client, server.address) == (200, b"ok")
        with pytest.raises(PeerError, match="head is too large"):
            await _exchange(client, server.address)
    await client.aclose()


# --------------------------------------------------------------------------- stale connections


def _closing_each_reused_connection(how: str) -> Handler:
    """Answers the first request of each connection, then closes when the next arrives
    (``fin``: after reading it; ``rst``: with it unread, which sends a reset)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(OK)
        await writer.drain()
        if how == "fin":
            await _request(reader)
        else:
            await reader.read(1)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return handler


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_a_request_that_meets_the_other_sides_close_is_sent_again(how: str):
    client = PeerClient()
    async with RawServer(_closing_each_reused_connection(how)) as server:
        for _ in range(5):
            assert await _exchange(client, server.address) == (200, b"ok")
        assert server.connections == 5  # each reused connection closed, each request served
    await client.aclose()


async def test_an_answer_broken_off_on_a_reused_connection_is_not_sent_again():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(OK)
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")  # then closed

    client = PeerClient()
    async with RawServer(handler) as server:
        assert await _exchange(client, server.address) == (200, b"ok")
        with pytest.raises(PeerError):
            await _exchange(client, server.address)
        assert server.connections == 1
    await client.aclose()
