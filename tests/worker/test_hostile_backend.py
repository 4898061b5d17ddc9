"""The real ``worker.py`` process against a backend that answers with broken HTTP/1.1.

A scripted relay (``websockets.serve``, as in test_worker.py) assigns requests; a raw
backend on 127.0.0.1 answers each with the malformed bytes its body names, then closes.
Every such request ends in a 502 for that request alone: the worker answers the next
request, and a ping within a second (a worker stuck in a parsing loop answers none).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from relay.wire.protocol import ResponseComplete
from tests.wire.responses import MALFORMED
from tests.worker.rawbackend import read_request
from tests.worker.test_worker import FAST, SECRET, FakeRelay, RelaySide, WorkerProcess

SSE = b"data: {}\n\ndata: [DONE]\n\n"
JSON_OK = b'{"ok":true}'


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Each request's body says what to answer: ``case`` from MALFORMED (then the
    connection closes), or a well-formed answer, streamed when ``stream`` is true."""
    try:
        while True:
            request = await read_request(reader)
            body = json.loads(request.split(b"\r\n\r\n", 1)[1])
            case = body.get("case")
            if case is not None:
                writer.write(MALFORMED[case])
                await writer.drain()
                return
            if body.get("stream"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(SSE), SSE)
                )
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(JSON_OK), JSON_OK)
                )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def worker_side() -> AsyncIterator[RelaySide]:
    """A registered ``worker.py`` process in front of the scripted backend."""
    backend = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{backend.sockets[0].getsockname()[1]}"
    async with FakeRelay() as relay:
        argv = ["--proxy-url", relay.url, "--worker-secret", SECRET, "--backend-url", url]
        argv += ["--models", "mock-model", "--max-concurrent", "4", *FAST]
        process = await WorkerProcess.start(*argv)
        try:
            yield await relay.registered(timeout=30)
            assert len(relay.sides) == 1, "the worker reconnected: its connection broke"
        finally:
            await process.stop()
            backend.close()


async def ask(side: RelaySide, rid: str, *, stream: bool, case: str | None) -> ResponseComplete:
    await side.request(rid, stream=stream, extra={"case": case} if case else None)
    return await side.complete(rid)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_each_malformed_response_is_a_502_and_the_worker_keeps_serving(
    worker_side: RelaySide, stream: bool
) -> None:
    for n, case in enumerate(MALFORMED):
        failed = await ask(worker_side, f"bad-{n}", stream=stream, case=case)
        assert failed.status_code == 502, case
        served = await ask(worker_side, f"ok-{n}", stream=stream, case=None)
        assert served.status_code == 200, case
        if stream:
            assert "".join(worker_side.chunks(f"ok-{n}")) == SSE.decode(), case
        else:
            assert served.body == JSON_OK.decode(), case
        async with asyncio.timeout(1):  # not stuck in a loop: the relay's ping is answered
            await worker_side.ping(n)
