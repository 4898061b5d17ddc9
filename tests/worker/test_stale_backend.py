"""No request lost to a kept-alive backend connection the backend closed.

A live server (``manage.py serve``), the real ``worker.py`` and a scripted backend on
127.0.0.1 that closes kept-alive connections as real ones do: after a short idle
period and a few requests per connection (llama-server's cpp-httplib, its timings
shrunk), or right as the next request arrives (the race an idle timeout loses). A
thousand requests through the relay each, streamed and not: not one client error.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.live import LiveServer
from tests.test_e2e import poll, routable, running_worker
from tests.worker.rawbackend import read_request

pytestmark = pytest.mark.live

REQUESTS = 1000
CONCURRENCY = 8
MODEL = "mock-model"
JSON_ANSWER = b'{"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}'
SSE_ANSWER = [b'data: {"n":%d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]


class ClosingBackend:
    """A backend on its own event loop in a thread, closing kept-alive connections.

    ``idle``: a connection idle for ``idle_secs`` is closed, and the ``max_requests``-th
    answer on one says ``connection: close`` (cpp-httplib's keep-alive timeout and
    count). ``arrival``: each connection answers its first request; when the next
    arrives it is closed, by turns after reading it (a FIN) and with it unread (a
    reset).
    """

    def __init__(self, mode: str, idle_secs: float = 0.01, max_requests: int = 5) -> None:
        self.mode = mode
        self.idle_secs = idle_secs
        self.max_requests = max_requests
        self.connections = self.answered = self.closed_idle = self.closed_on_arrival = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> ClosingBackend:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self._server = server
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                if served and self.mode == "arrival":
                    self.closed_on_arrival += 1
                    if self.closed_on_arrival % 2:
                        await read_request(reader)
                    else:
                        await reader.read(1)
                        sock = writer.get_extra_info("socket")
                        linger = struct.pack("ii", 1, 0)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    return
                if served and self.mode == "idle":
                    try:
                        async with asyncio.timeout(self.idle_secs):
                            request = await read_request(reader)
                    except TimeoutError:  # whatever part of a request came stays unread
                        self.closed_idle += 1
                        return
                else:
                    request = await read_request(reader)
                served += 1
                last = self.mode == "idle" and served == self.max_requests
                writer.write(self._answer(request, close=last))
                await writer.drain()
                self.answered += 1
                if last:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _answer(request: bytes, *, close: bool) -> bytes:
        streamed = json.loads(request.split(b"\r\n\r\n", 1)[1]).get("stream")
        head = b"HTTP/1.1 200 OK\r\n" + (b"connection: close\r\n" if close else b"")
        if not streamed:
            head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
                JSON_ANSWER
            )
            return head + JSON_ANSWER
        head += b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in SSE_ANSWER) + b"0\r\n\r\n"


@contextmanager
def closing_backend(mode: str) -> Iterator[ClosingBackend]:
    backend = ClosingBackend(mode).start()
    try:
        yield backend
    finally:
        backend.stop()


def relay_load(server: LiveServer, seed: int) -> list[str]:
    """``REQUESTS`` requests, ``CONCURRENCY`` at a time, every other one streamed, with
    pauses around the backend's idle timeout between them; what went wrong, if anything."""
    pace = random.Random(seed)
    pauses = [pace.uniform(0, 0.02) for _ in range(REQUESTS)]
    problems: list[str] = []

    with httpx.Client(base_url=server.url, timeout=30) as client:

        def one(i: int) -> None:
            time.sleep(pauses[i])  # pacing: some connections outlive the idle timeout
            streamed = i % 2 == 1
            body = {"model": MODEL, "stream": streamed, "messages": []}
            response = client.post("/v1/chat/completions", json=body)
            expected = b"".join(SSE_ANSWER) if streamed else JSON_ANSWER
            if response.status_code != 200 or response.content != expected:
                problems.append(f"request {i}: {response.status_code} {response.text[:200]}")

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(REQUESTS)))
    return problems


def test_a_backend_closing_idle_connections_costs_no_request(relay_server: LiveServer) -> None:
    with (
        closing_backend("idle") as backend,
        running_worker(relay_server, backend.url, "--models", MODEL, "--max-concurrent", "8"),
    ):
        poll(lambda: routable(relay_server), what="the worker to register")
        assert relay_load(relay_server, seed=1) == []
    assert backend.answered == REQUESTS
    assert backend.closed_idle > 0 and backend.connections >= REQUESTS // 5


def test_a_backend_closing_as_each_request_arrives_costs_no_request(
    relay_server: LiveServer,
) -> None:
    with (
        closing_backend("arrival") as backend,
        running_worker(
            relay_server, backend.url, "--models", MODEL, "--max-concurrent", "8"
        ) as worker,
    ):
        poll(lambda: routable(relay_server), what="the worker to register")
        assert relay_load(relay_server, seed=2) == []
        assert "sending again" in worker.log
    assert backend.answered == REQUESTS
    assert backend.closed_on_arrival >= REQUESTS // 2
