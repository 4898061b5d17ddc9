"""The core's promises under real conditions, against a live server (daphne, or uvicorn
on the second pass) with raw WebSocket workers and raw TCP clients: requests that
outlive the heartbeat, clients that stop reading, hostile frames, bodies and headers
one byte over each limit."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest

from relay.wire import protocol
from tests.live import LiveServer
from tests.rawworker import closed, connect, expect, register

pytestmark = pytest.mark.live

MIB = 1024 * 1024


def rss(server: LiveServer) -> int:
    """The server process's resident memory, in bytes."""
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def queue_depth(client: httpx.AsyncClient) -> int:
    return (await client.get("/health")).json()["queue_depth"]


async def until_queued(client: httpx.AsyncClient, depth: int) -> None:
    async with asyncio.timeout(10):
        while await queue_depth(client) != depth:
            await asyncio.sleep(0.02)


class RawClient:
    """An HTTP/1.1 client on a raw socket with a small receive buffer, which reads the
    response only when told to (a client that stops reading, as a test needs it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def post(cls, server: LiveServer, path: str, body: bytes, *, head: str = "") -> RawClient:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{head}\r\n"
            ).encode()
            + body
        )
        await writer.drain()
        return cls(reader, writer)

    async def head(self) -> tuple[int, bytes]:
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        return int(raw.split(b" ", 2)[1]), raw

    async def read_all(self, timeout: float = 20) -> bytes:
        """Everything until the server closes or ends the chunked body."""
        parts = []
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(1 << 16)
                except ConnectionResetError:
                    break
                if not data:
                    break
                parts.append(data)
                if b"".join(parts[-2:]).endswith(b"0\r\n\r\n"):
                    break
        return b"".join(parts)

    def close(self) -> None:
        self.writer.close()


def dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out.append(rest[:size])
        data = rest[size + 2 :]
    return b"".join(out)


def stream_body() -> bytes:
    return json.dumps({"model": "m", "stream": True}).encode()


async def test_a_completion_frees_its_slot_before_the_next_pong(relay_server_factory):
    # A generation that outlives the heartbeat: the worker's last pong counted it.
    with relay_server_factory(
        HEARTBEAT_INTERVAL_SECS="600", HEARTBEAT_TIMEOUT_SECS="1800"
    ) as server:
        async with (
            await connect(server) as ws,
            httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        ):
            await register(ws, max_concurrent=1)
            first = asyncio.ensure_future(
                client.post("/v1/chat/completions", json={"model": "m", "n": 1})
            )
            one = await expect(ws, protocol.Request)
            await ws.send(protocol.encode(protocol.Pong(current_load=1)))
            second = asyncio.ensure_future(
                client.post("/v1/chat/completions", json={"model": "m", "n": 2})
            )
            await until_queued(client, 1)
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(request_id=one.request_id, status_code=200, body="1")
                )
            )
            two = await expect(ws, protocol.Request, timeout=5)  # no pong in between
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(request_id=two.request_id, status_code=200, body="2")
                )
            )
            assert [(await first).text, (await second).text] == ["1", "2"]


async def test_a_client_that_stops_reading_costs_a_bounded_amount_of_memory(relay_server_factory):
    with relay_server_factory(STREAM_BUFFER_BYTES=str(MIB), STALL_TIMEOUT_SECS="600") as server:
        async with await connect(server) as ws:
            await register(ws)  # an old worker: no flow control
            client = await RawClient.post(server, "/v1/chat/completions", stream_body())
            request = await expect(ws, protocol.Request)
            before = rss(server)
            part = "data: " + "x" * (64 * 1024) + "\n\n"
            for _ in range(1024):  # 64 MiB, as fast as the socket takes it
                await ws.send(protocol.encode(protocol.ResponseChunk(request.request_id, part)))
            cancel = await expect(ws, protocol.Cancel, timeout=20)
            assert cancel == protocol.Cancel(
                request_id=request.request_id, reason="client_disconnect"
            )
            grown = rss(server) - before
            assert grown < 24 * MIB, f"the server grew by {grown / MIB:.1f} MiB"
            status, _ = await client.head()
            assert status == 200
            body = dechunk(await client.read_all())  # reading again: the stream's end comes
            assert body.startswith(b"data: xxx")
            event = body.rsplit(b"\n\n", 2)[-2]
            assert json.loads(event.split(b"data: ", 1)[1])["error"]["code"] == "slow_client"
            client.close()


async def test_a_paused_stream_resumes_intact_when_the_client_reads_again(relay_server_factory):
    with relay_server_factory(STREAM_BUFFER_BYTES=str(MIB), STALL_TIMEOUT_SECS="600") as server:
        async with await connect(server) as ws:
            await ws.send(
                protocol.encode(
                    protocol.Register(
                        worker_name="fc",
                        models=["m"],
                        max_concurrent=2,
                        protocol_version="1",
                        features=[protocol.FLOW_CONTROL],
                    )
                )
            )
            ack = await expect(ws, protocol.RegisterAck)
            assert ack.features == [protocol.FLOW_CONTROL]
            client = await RawClient.post(server, "/v1/chat/completions", stream_body())
            request = await expect(ws, protocol.Request)
            sent = 0
            paused = None
            while paused is None:  # write until the relay says stop (it reads as we write)
                part = f"data: {sent:06d}{'y' * 16_000}\n\n"
                await ws.send(protocol.encode(protocol.ResponseChunk(request.request_id, part)))
                sent += 1
                try:
                    frame = protocol.decode_server_message(await asyncio.wait_for(ws.recv(), 0.001))
                except TimeoutError:
                    continue
                assert isinstance(frame, protocol.Pause), frame
                paused = frame
                assert sent < 1000, "never paused"
            # While that client sleeps, another request on the same worker is served.
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as other:
                call = asyncio.ensure_future(
                    other.post("/v1/chat/completions", json={"model": "m"})
                )
                quick = await expect(ws, protocol.Request)
                await ws.send(
                    protocol.encode(
                        protocol.ResponseComplete(
                            request_id=quick.request_id, status_code=200, body="ok"
                        )
                    )
                )
                assert (await call).text == "ok"
            status, _ = await client.head()
            assert status == 200
            reading = asyncio.ensure_future(client.read_all())
            assert await expect(ws, protocol.Resume, timeout=20) == protocol.Resume(
                request.request_id
            )
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(
                        request_id=request.request_id, status_code=200, body="data: [DONE]\n\n"
                    )
                )
            )
            text = dechunk(await reading).decode()
            numbers = [int(line[6:12]) for line in text.split("\n\n") if line.startswith("data: 0")]
            assert numbers == list(range(sent))
            assert text.endswith("data: [DONE]\n\n")
            client.close()


async def test_a_client_that_reads_nothing_is_cut_off_after_the_stall_timeout(relay_server_factory):
    with relay_server_factory(STREAM_BUFFER_BYTES=str(MIB), STALL_TIMEOUT_SECS="0.5") as server:
        async with await connect(server) as ws:
            await ws.send(
                protocol.encode(
                    protocol.Register(
                        worker_name="fc",
                        models=["m"],
                        protocol_version="1",
                        features=[protocol.FLOW_CONTROL],
                    )
                )
            )
            await expect(ws, protocol.RegisterAck)
            client = await RawClient.post(server, "/v1/chat/completions", stream_body())
            request = await expect(ws, protocol.Request)
            part = "data: " + "z" * 60_000 + "\n\n"
            frames: list[protocol.ServerMessage] = []

            async def listen() -> None:
                while True:
                    frame = protocol.decode_server_message(await ws.recv())
                    frames.append(frame)
                    if isinstance(frame, protocol.Cancel):
                        return

            listener = asyncio.ensure_future(listen())
            for _ in range(200):  # 12 MB: past every buffer on the way
                if listener.done():
                    break
                await ws.send(protocol.encode(protocol.ResponseChunk(request.request_id, part)))
            await asyncio.wait_for(listener, 20)
            assert frames[-1] == protocol.Cancel(
                request_id=request.request_id, reason="slow_client"
            )
            await client.read_all()  # ends: the server dropped the connection
            client.close()
            async with httpx.AsyncClient(base_url=server.url) as http:
                assert (await http.get("/health")).json()["queue_depth"] == 0


async def test_bodies_and_headers_one_byte_over_the_limits(relay_server_factory):
    limit = 64 * 1024
    with relay_server_factory(MAX_REQUEST_BYTES=str(limit)) as server:
        async with await connect(server) as ws:
            await register(ws)

            async def answer_everything() -> None:
                while True:
                    frame = protocol.decode_server_message(await ws.recv())
                    if isinstance(frame, protocol.Request):
                        await ws.send(
                            protocol.encode(
                                protocol.ResponseComplete(
                                    request_id=frame.request_id, status_code=200
                                )
                            )
                        )

            answering = asyncio.ensure_future(answer_everything())

            async def post(body: bytes, head: str = "") -> int:
                client = await RawClient.post(server, "/v1/chat/completions", body, head=head)
                status, _ = await client.head()
                client.close()
                return status

            prefix = b'{"model":"m","pad":"'
            at_limit = prefix + b"a" * (limit - len(prefix) - 2) + b'"}'
            assert len(at_limit) == limit
            assert await post(at_limit) == 200
            assert await post(at_limit[:-2] + b'a"}') == 413
            header_room = 16 * 1024 - 200
            assert await post(b'{"model":"m"}', f"X-Pad: {'p' * header_room}\r\n") == 200
            assert await post(b'{"model":"m"}', f"X-Pad: {'p' * 17_000}\r\n") == 431
            many = "".join(f"X-H{i}: v\r\n" for i in range(101))
            assert await post(b'{"model":"m"}', many) == 431
            answering.cancel()


async def test_a_hostile_frame_closes_only_its_worker_and_nothing_lingers(relay_server_factory):
    with relay_server_factory() as server:
        async with await connect(server) as good, await connect(server) as bad:
            await register(good)
            await register(bad)
            await bad.send('{"type":"pong","x":' + "[" * 200_000 + "]" * 200_000 + "}")
            code, _ = await closed(bad)
            assert code == 1002
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                call = asyncio.ensure_future(
                    client.post("/v1/chat/completions", json={"model": "m"})
                )
                request = await expect(good, protocol.Request)
                await good.send(
                    protocol.encode(
                        protocol.ResponseComplete(request_id=request.request_id, status_code=200)
                    )
                )
                assert (await call).status_code == 200
                assert (await client.get("/metrics")).status_code == 200
        assert server.stop() == 0
        log = server.log()
        assert "Traceback" not in log
        assert "did not close in time" not in log
