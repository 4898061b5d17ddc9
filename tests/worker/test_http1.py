"""The worker's backend connections against hostile and stale backends on 127.0.0.1.

A malformed response (:mod:`tests.wire.responses`; the reader itself is tested in
``tests/wire/test_http1.py``) fails its own exchange with ``RemoteProtocolError`` and
closes that connection; the pool serves the next request on a new one. A kept-alive
connection the backend closed is never used, and a request that met the backend's
close is sent once more on a new connection. Each test runs on asyncio's event loop
and on uvloop's.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import httpx
import pytest

from relay.wire.http1 import MAX_HEAD_BYTES
from tests.wire.responses import MALFORMED, OK, SHORTEST, padded_head
from tests.worker.rawbackend import Backend, collect, read_request


def first_malformed_then_ok(response: bytes) -> Any:
    """The first connection gets ``response`` and is closed; every later one is served."""
    seen = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            await read_request(reader)
            writer.write(response)
            await writer.drain()
            return  # closed
        while True:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    return handler


@pytest.mark.parametrize("response", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_response_fails_its_request_and_the_next_one_is_served(
    run: Any, response: bytes
) -> None:
    async def main() -> None:
        backend = Backend(first_malformed_then_ok(response))
        async with backend as pool:
            async with asyncio.timeout(5):
                with pytest.raises(httpx.RemoteProtocolError):
                    await collect(pool)
                assert pool._idle == []
                assert (await collect(pool))[1] == b"ok"
            assert backend.connections == 2
            assert pool.resent == 0  # a fresh connection is never sent on twice

    run(main())


def test_a_response_framed_both_ways_is_refused_while_the_backend_keeps_the_connection(
    run: Any,
) -> None:
    both = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )

    first = True

    async def keeps_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal first
        if first:
            first = False
            await read_request(reader)
            writer.write(both)
        while True:  # the connection stays open: whatever comes next is answered
            await read_request(reader)
            writer.write(OK)

    async def main() -> None:
        backend = Backend(keeps_answering)
        async with backend as pool:
            with pytest.raises(httpx.RemoteProtocolError, match="Content-Length"):
                await collect(pool)
            assert (await collect(pool))[1] == b"ok"
            assert backend.connections == 2  # the connection was not reused

    run(main())


@pytest.mark.parametrize("split", [None, 1000, MAX_HEAD_BYTES - 1, MAX_HEAD_BYTES])
def test_a_head_of_the_limit_is_read_and_one_byte_more_is_refused(
    run: Any, split: int | None
) -> None:
    """However the reads cut the response (``split``: where the backend pauses)."""

    def writing(response: bytes) -> Any:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            if split is None:
                writer.write(response)
            else:
                writer.write(response[:split])
                await writer.drain()
                await asyncio.sleep(0.01)
                writer.write(response[split:])
            await writer.drain()
            await reader.read()

        return handler

    async def main() -> None:
        async with Backend(writing(padded_head(MAX_HEAD_BYTES) + b"ok")) as pool:
            head, body = await collect(pool)
            padding = MAX_HEAD_BYTES - len(SHORTEST)
            assert (head.status, len(head.get("x-pad")), body) == (200, padding, b"ok")
        async with Backend(writing(padded_head(MAX_HEAD_BYTES + 1) + b"ok")) as pool:
            with pytest.raises(httpx.RemoteProtocolError, match="head is too large"):
                await collect(pool)

    run(main())


def test_a_head_that_never_ends_is_refused_at_the_limit(run: Any) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        while True:  # header lines forever, in small writes
            writer.write(b"x-more: " + b"m" * 1000 + b"\r\n")
            await writer.drain()

    async def main() -> None:
        async with Backend(endless) as pool:
            async with asyncio.timeout(5):
                with pytest.raises(httpx.RemoteProtocolError, match="head is too large"):
                    await collect(pool)

    run(main())


# --------------------------------------------------------------------------- stale connections


async def rst_close(writer: asyncio.StreamWriter) -> None:
    """Close with a reset, as a server does that closes with unread input."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


def closing_each_reused_connection(how: str) -> Any:
    """Answers the first request of each connection, then closes it when the next
    request arrives (``fin``: after reading it; ``rst``: unread, with a reset)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        if how == "fin":
            await read_request(reader)  # read whole: the close sends a FIN
        else:
            await reader.read(1)
            await rst_close(writer)

    return handler


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_request_that_meets_the_backends_close_is_sent_again_on_a_new_connection(
    run: Any, how: str
) -> None:
    async def main() -> None:
        backend = Backend(closing_each_reused_connection(how))
        async with backend as pool:
            for _ in range(5):
                assert (await collect(pool))[1] == b"ok"
            assert pool.resent == 4  # every request after the first met a close
            assert backend.connections == 5

    run(main())


def test_a_fresh_connection_that_closes_unanswered_is_not_sent_on_again(run: Any) -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def main() -> None:
        backend = Backend(hangs_up)
        async with backend as pool:
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await collect(pool)
            assert (pool.resent, backend.connections) == (0, 1)

    run(main())


def test_a_reused_connection_that_answered_part_of_a_response_is_not_sent_on_again(
    run: Any,
) -> None:
    async def breaks_second_answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")  # then closed

    async def main() -> None:
        backend = Backend(breaks_second_answer)
        async with backend as pool:
            assert (await collect(pool))[1] == b"ok"
            with pytest.raises(httpx.RemoteProtocolError):
                await collect(pool)
            assert (pool.resent, backend.connections) == (0, 1)

    run(main())


def test_a_silent_reused_connection_times_out_and_is_not_sent_on_again(run: Any) -> None:
    async def silent_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        await reader.read()

    async def main() -> None:
        backend = Backend(silent_second)
        async with backend as pool:
            assert (await collect(pool))[1] == b"ok"
            head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
            with pytest.raises(httpx.ReadTimeout):
                await pool.exchange(head, b"", write_timeout=5, read_timeout=0.05)
            assert (pool.resent, backend.connections) == (0, 1)

    run(main())


def test_an_idle_connection_is_retired_after_keepalive_secs(run: Any) -> None:
    async def serves(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    async def main() -> None:
        backend = Backend(serves, keepalive_secs=60)
        async with backend as pool:
            await collect(pool)
            await collect(pool)
            assert backend.connections == 1
            pool._idle[0].idle_since -= 61  # idle longer than keepalive_secs
            await collect(pool)
            assert (backend.connections, pool.resent) == (2, 0)
        backend = Backend(serves, keepalive_secs=0)
        async with backend as pool:
            for _ in range(3):
                await collect(pool)
            assert (backend.connections, pool._idle) == (3, [])

    run(main())


def test_an_idle_connection_whose_close_the_loop_has_not_read_is_not_taken(run: Any) -> None:
    async def main() -> None:
        close = asyncio.Event()

        async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            await close.wait()
            # any further request gets no answer: only a new connection serves

        backend = Backend(once)
        async with backend as pool:
            await collect(pool)
            idle = pool._idle[0]
            assert idle.transport is not None and idle.quiet()
            idle.transport.pause_reading()  # the loop will not see the close by itself
            close.set()
            async with asyncio.timeout(5):
                while idle.quiet():  # the FIN is on its way
                    await asyncio.sleep(0.001)
            assert (await collect(pool))[1] == b"ok"
            assert (backend.connections, pool.resent) == (2, 0)
            assert idle.closed

    run(main())
