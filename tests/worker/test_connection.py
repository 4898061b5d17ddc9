"""The worker's backend connections and frame encoding, against scripted raw servers.

Each test runs on asyncio's event loop and on uvloop's (the worker's when installed);
malformed and stale responses are in test_http1.py.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import zlib
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.streams import StreamReader

from relay.wire.http1 import LENGTH, NO_BODY
from relay.wire.protocol import ResponseChunk, encode
from relay.worker.connection import BodyTooLarge
from relay.worker.http1 import Origin, request_head
from relay.worker.outbox import Outbox, chunk_frame, chunk_prefix, masked_text_frames
from tests.wire.responses import OK
from tests.worker.rawbackend import Backend, answering, chunked, collect, post, read_request

# --------------------------------------------------------------------------- framing


def test_bodies_are_read_whatever_their_framing(run: Any) -> None:
    async def main() -> None:
        responses = [
            OK,
            chunked(b"hel", b"lo"),
            b"HTTP/1.1 100 Continue\r\n\r\n" + OK,  # an interim response first
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        ]
        async with Backend(answering(*responses)) as pool:
            head, body = await collect(pool)
            assert (head.status, head.headers, body) == (
                200,
                [("content-type", "application/json"), ("content-length", "2")],
                b"ok",
            )
            assert (head.framing, head.length, head.keep_alive) == (LENGTH, 2, True)
            assert (await collect(pool))[1] == b"hello"
            assert (await collect(pool))[1] == b"ok"
            assert (await collect(pool))[0].status == 204
            head, body = await collect(pool)
            assert (head.status, head.framing, body) == (200, NO_BODY, b"")
        async with Backend(
            answering(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", then_close=True)
        ) as pool:
            assert (await collect(pool))[1] == b"until the end"

    run(main())


def test_a_keepalive_connection_is_reused_and_one_the_backend_closed_is_not(run: Any) -> None:
    async def main() -> None:
        backend = Backend(answering(OK, OK, OK))
        async with backend as pool:
            for _ in range(3):
                assert (await collect(pool))[1] == b"ok"
            assert backend.connections == 1
        backend = Backend(answering(OK, then_close=True))
        async with backend as pool:
            assert (await collect(pool))[1] == b"ok"
            await asyncio.sleep(0.05)  # the close reaches the client
            assert (await collect(pool))[1] == b"ok"
            assert backend.connections == 2
        closing = OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
        backend = Backend(answering(closing, OK))
        async with backend as pool:
            await collect(pool)
            await collect(pool)
            assert backend.connections == 2

    run(main())


def test_a_compressed_body_split_across_reads_is_decoded_once(run: Any) -> None:
    text = os.urandom(8000).hex().encode()  # compresses only by half
    zipped = gzip.compress(text)
    cut = len(zipped) // 2

    async def split(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
            % (len(zipped), zipped[:cut])
        )
        await writer.drain()
        await asyncio.sleep(0.05)  # the head and a first piece arrive before the rest
        writer.write(zipped[cut:])
        await reader.read()

    async def main() -> None:
        async with Backend(split) as pool:
            conn, _ = await post(pool)
            await asyncio.sleep(0.02)
            conn.collect(1 << 20)
            await conn.finished()
            assert conn.body() == text

    run(main())


def test_gzip_and_deflate_bodies_are_decoded(run: Any) -> None:
    text = b"data: hello\n\n" * 50
    zipped = gzip.compress(text)
    deflated = zlib.compress(text)

    def encoded(name: bytes, body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-encoding: %s\r\ncontent-length: %d\r\n\r\n%s" % (
            name,
            len(body),
            body,
        )

    async def main() -> None:
        async with Backend(answering(encoded(b"gzip", zipped), encoded(b"deflate", deflated))) as (
            pool
        ):
            assert (await collect(pool))[1] == text
            assert (await collect(pool))[1] == text

    run(main())


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nok",  # then the connection closes
        b"",  # closed without an answer
    ],
)
def test_broken_responses_raise_protocol_errors(run: Any, response: bytes) -> None:
    async def main() -> None:
        async with Backend(answering(response, then_close=True)) as pool:
            with pytest.raises(httpx.RemoteProtocolError):
                await collect(pool)

    run(main())


def test_a_body_over_the_limit_is_refused(run: Any) -> None:
    async def main() -> None:
        async with Backend(answering(chunked(b"x" * 600, b"y" * 600))) as pool:
            with pytest.raises(BodyTooLarge):
                await collect(pool, limit=1000)

    run(main())


def test_unsendable_request_headers_are_refused() -> None:
    origin = Origin.parse("http://127.0.0.1:8000/base/")
    head = request_head(origin, "/v1/chat/completions", {"authorization": "Bearer k"}, 2)
    assert head.startswith(b"POST /base/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n")
    assert b"\r\nauthorization: Bearer k\r\ncontent-length: 2\r\n\r\n" in head
    for headers in ({"x-a": "1\r\nx-injected: 1"}, {"bad name": "1"}, {"x-a": "caf\u00e9"}):
        with pytest.raises(httpx.LocalProtocolError):
            request_head(origin, "/v1/chat/completions", headers, 2)


# --------------------------------------------------------------------------- streaming


def test_streamed_reads_reach_the_sink_as_they_arrive_and_holds_stop_reading(run: Any) -> None:
    async def main() -> None:
        steps = [asyncio.Event() for _ in range(3)]

        async def stepped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            for i, piece in enumerate((b"second", b"third")):
                await steps[i].wait()
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            await steps[2].wait()
            writer.write(b"0\r\n\r\n")
            await reader.read()

        async with Backend(stepped) as pool:
            conn, _ = await post(pool)
            got: list[bytes] = []
            conn.stream(got.append)
            assert got == [b"first"]  # what came with the head, at once
            steps[0].set()
            async with asyncio.timeout(5):
                while got == [b"first"]:
                    await asyncio.sleep(0.005)
            assert got == [b"first", b"second"]
            conn.hold()
            steps[1].set()
            await asyncio.sleep(0.1)
            assert got == [b"first", b"second"]  # nothing is read while held
            conn.release()
            steps[2].set()
            async with asyncio.timeout(5):
                await conn.finished()
            assert got == [b"first", b"second", b"third"]
            assert conn.reusable
            pool.release(conn)

    run(main())


def test_a_silent_backend_times_out_and_an_absent_one_is_a_connect_error(run: Any) -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            await reader.read()

        async with Backend(silent) as pool:
            with pytest.raises(httpx.ReadTimeout):
                await post(pool, read_timeout=0.1)
        with pytest.raises(httpx.ConnectError):
            await collect(pool)  # the server is gone

    run(main())


# --------------------------------------------------------------------------- frames


@pytest.mark.parametrize(
    "text", ["", 'data: {"a": 1}\n\n', 'quote " backslash \\ tab \t nul \0', "€ 🎉 \u2028"]
)
def test_chunk_frames_are_exactly_the_encoded_message(text: str) -> None:
    expected = encode(ResponseChunk(request_id="req-1", chunk=text)).encode()
    assert chunk_frame(chunk_prefix("req-1"), text) == expected
    assert msgspec.json.decode(expected)["chunk"] == text


def test_frames_are_masked_text_frames_websockets_reads_back() -> None:
    payloads = [b"x" * n for n in (0, 1, 125, 126, 65535, 65536, 70000)]
    reader = StreamReader()
    reader.feed_data(masked_text_frames(payloads))
    reader.feed_eof()
    for payload in payloads:
        parser = Frame.parse(reader.read_exact, mask=True, extensions=[])
        with pytest.raises(StopIteration) as done:
            next(parser)
        frame = done.value.value
        assert (frame.opcode, frame.fin, frame.data) == (Opcode.TEXT, True, payload)


# --------------------------------------------------------------------------- outbox


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return len(self.written)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (0, 1000)


class FakeWebSocket:
    """What the outbox uses of a websockets connection; the relay never reads."""

    def __init__(self) -> None:
        self.protocol = SimpleNamespace(state=State.OPEN)
        self.transport = FakeTransport()
        self.sent: list[tuple[bytes, int]] = []
        self.drained = asyncio.Event()

    async def send(self, frame: bytes, text: bool) -> None:
        self.sent.append((frame, len(self.transport.written)))

    async def drain(self) -> None:
        await self.drained.wait()


class FakeStream:
    holds = 0

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1


def payloads(raw: bytes) -> list[bytes]:
    reader = StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    out = []
    while reader.buffer:
        with pytest.raises(StopIteration) as done:
            next(Frame.parse(reader.read_exact, mask=True, extensions=[]))
        out.append(done.value.value.data)
    return out


def test_the_outbox_keeps_order_batches_a_turn_and_holds_streams_while_the_relay_is_full(
    run: Any,
) -> None:
    async def main() -> None:
        ws = FakeWebSocket()
        tasks: list[asyncio.Task[Any]] = []
        outbox = Outbox(ws, lambda coro, name: tasks.append(asyncio.create_task(coro)))  # type: ignore[arg-type]
        stream = FakeStream()
        outbox.watch(stream)  # type: ignore[arg-type]
        outbox.post(b"1")
        outbox.post(b"2")
        assert ws.transport.written == b""  # not before the end of this turn...
        await asyncio.sleep(0)
        assert payloads(ws.transport.written) == [b"1", b"2"]  # ...then in one write
        outbox.post(b"3")
        await outbox.send(b"4")  # after everything posted
        assert payloads(ws.transport.written) == [b"1", b"2", b"3"]
        assert ws.sent == [(b"4", len(ws.transport.written))]
        assert stream.holds == 0
        outbox.post(b"x" * 2000)  # past the high-water mark: the streams wait
        await asyncio.sleep(0)
        assert stream.holds == 1
        ws.drained.set()
        await asyncio.gather(*tasks)
        assert stream.holds == 0

    run(main())
