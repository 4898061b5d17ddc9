"""Whether a stream reached its API's last event (``relay.wire.sse.StreamEnd``), and the
worker's answer to a backend that ends a stream cleanly but short: the endpoint's error
event and a 502, for every API, through the real worker and a raw backend."""

from __future__ import annotations

import asyncio

import pytest

from relay.wire.protocol import ResponseChunk
from relay.wire.sse import StreamEnd
from tests.stall import STALL_BUDGET_MS, LoopStalls
from tests.upstream import _events
from tests.worker.test_worker import CHAT, MESSAGES, RESPONSES, FakeRelay, config, running

PATHS = [CHAT, "/v1/completions", MESSAGES, RESPONSES]


def whole(path: str) -> bytes:
    return b"".join(_events(path, "m", tokens=3, prompt=2, include_usage=False))


@pytest.mark.parametrize("path", PATHS)
def test_a_whole_stream_reaches_its_end_however_it_is_cut_into_reads(path: str) -> None:
    stream = whole(path)
    for cut in range(1, len(stream)):
        end = StreamEnd.for_endpoint(path)
        end.feed(stream[:cut])
        end.feed(stream[cut:])
        assert end.seen, cut
    for size in (1, 7):
        end = StreamEnd.for_endpoint(path)
        for i in range(0, len(stream), size):
            end.feed(stream[i : i + size])
        assert end.seen


@pytest.mark.parametrize("path", PATHS)
def test_a_stream_without_its_last_event_does_not(path: str) -> None:
    events = _events(path, "m", tokens=3, prompt=2, include_usage=False)
    end = StreamEnd.for_endpoint(path)
    for event in events[:-1] if path != CHAT and path != "/v1/completions" else events[:-2]:
        end.feed(event)
    assert not end.seen


def test_it_knows_whether_the_stream_ended_between_events() -> None:
    end = StreamEnd.for_endpoint("/v1/audio/stream")  # whether or not its end is checked
    assert end.between_events
    end.feed(b"data: {}\n")
    assert not end.between_events
    end.feed(b"\n")
    assert end.between_events
    end.feed(b"proxy error: Failed to read connection")
    assert not end.between_events
    end.feed(b"\r\n\r\n")
    assert end.between_events


def test_other_endpoints_are_not_checked() -> None:
    assert StreamEnd.for_endpoint("/v1/audio/speech").seen
    assert StreamEnd.for_endpoint("/v1/embeddings").seen and not StreamEnd.for_endpoint(CHAT).seen


async def test_checking_a_large_stream_costs_no_loop_stall() -> None:
    end = StreamEnd.for_endpoint(RESPONSES)
    read = b'data: {"type":"response.output_text.delta","delta":"' + b"x" * 65_000 + b'"}\n\n'
    async with LoopStalls() as stalls:
        for _ in range(50):
            end.feed(read)
            await asyncio.sleep(0)
    assert not end.seen
    assert stalls.longest_ms < STALL_BUDGET_MS


# --------------------------------------------------------------------------- through the worker


class ShortBackend:
    """Answers every stream with all its events but the last, then a clean end;
    ``torn``: after a bare line that ends no event (as llama-server's router)."""

    def __init__(self, path: str, torn: bool = False) -> None:
        self.path = path
        self.torn = torn
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ShortBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length")
        )
        await reader.readexactly(length)
        events = _events(self.path, "m", tokens=3, prompt=2, include_usage=False)[:-1]
        if self.path in (CHAT, "/v1/completions"):
            events = events[:-1]  # not the finish chunk either: cut mid-answer
        body = b"".join(events)
        if self.torn:
            body += b"proxy error: Failed to read connection"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("torn", [False, True])
@pytest.mark.parametrize("path", PATHS)
async def test_a_stream_the_backend_ends_short_ends_with_the_endpoints_error_event(
    path: str, torn: bool
) -> None:
    async with (
        ShortBackend(path, torn) as backend,
        FakeRelay() as relay,
        running(config(relay.url, backend.url, "--models", "m", "--max-concurrent", "1")),
    ):
        side = await relay.registered()
        await side.request("r-1", path, stream=True)
        complete = await side.complete("r-1")
        assert complete.status_code == 502
        chunks = [
            m.chunk for m in side.received if isinstance(m, ResponseChunk) and m.request_id == "r-1"
        ]
        last = chunks[-1]
        # An event of its own, whatever the stream broke off in.
        assert last.startswith("\n\n") == torn
        last = last.removeprefix("\n\n")
        if path == MESSAGES:
            assert last.startswith("event: error\n") and '"type":"error"' in last
        elif path == RESPONSES:
            assert last.startswith("event: error\n") and '"code":' in last
        else:
            assert last.startswith('data: {"error":')
        assert "ended the stream before its last event" in last
