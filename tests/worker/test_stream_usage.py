"""Every stream is charged: the worker asks an OpenAI chat/completions stream for its
usage when the client did not, and the client still receives exactly the bytes it
would have received without it (relay/worker/usage.py)."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from openai._streaming import SSEDecoder

from relay.wire.protocol import TokenCounts
from relay.worker.usage import UsageScanner, ask_for_usage
from tests.live import live_server
from tests.test_e2e import Stack, body_for, poll, serving, token_metrics
from tests.upstream import FakeUpstream, ThreadedUpstream, upstream_in_thread
from tests.worker.test_worker import CHAT, MESSAGES, FakeRelay, RelaySide, config, direct, running

COMPLETIONS = "/v1/completions"


# -- the body ----------------------------------------------------------------------


def test_the_option_is_added_in_front_keeping_every_byte_of_the_client() -> None:
    body = '{ "model" : "m",\n "stream": true, "messages": [{"role":"user","content":"€"}]}'
    asked = ask_for_usage(CHAT, body)
    assert asked == '{"stream_options":{"include_usage":true},' + body[1:]
    assert json.loads(asked)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "options", [{"include_usage": False}, {"continuous_usage_stats": False}, None]
)
def test_other_stream_options_are_kept_with_usage_turned_on(options: object) -> None:
    body = json.dumps({"model": "m", "stream": True, "stream_options": options})
    asked = ask_for_usage(COMPLETIONS, body)
    assert asked is not None
    expected = {**(options or {}), "include_usage": True}  # type: ignore[dict-item]
    assert json.loads(asked) == {"model": "m", "stream": True, "stream_options": expected}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, '{"model":"m","stream":true,"stream_options":{"include_usage":true}}'),
        (CHAT, '{"model":"m","stream":false}'),
        (CHAT, '{"model":"m"}'),
        (CHAT, '{"model":"m","stream":true,"stream_options":"yes"}'),
        (CHAT, "not json"),
        (MESSAGES, '{"model":"m","stream":true}'),
        ("/v1/responses", '{"model":"m","stream":true}'),
    ],
)
def test_the_body_is_left_alone_when_usage_comes_anyway(path: str, body: str) -> None:
    assert ask_for_usage(path, body) is None


# -- the stream ----------------------------------------------------------------------

PLAIN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_a_stream_without_usage_is_counted_and_marked_an_estimate() -> None:
    scanner = UsageScanner()
    scanner.estimate(40)
    for data in (PLAIN, PLAIN, PLAIN + DONE):
        scanner.count(data)
    scanner.finish()
    assert scanner.counts() == TokenCounts(
        prompt_tokens=10, completion_tokens=3, total_tokens=13, estimated=True
    )
    reported = UsageScanner()
    reported.estimate(40)
    reported.count(PLAIN + USAGE + DONE)
    counts = reported.counts()
    assert counts is not None and not counts.estimated and counts.completion_tokens == 2


# -- through the worker ----------------------------------------------------------------


async def relayed(
    upstream: FakeUpstream,
    path: str,
    extra: dict[str, Any] | None = None,
    mock: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[RelaySide, str]]:
    async with FakeRelay() as relay, running(config(relay.url, upstream.url)):
        side = await relay.registered()
        mock = {"split_utf8": True} if mock is None else mock
        body = await side.request("r-s", path, stream=True, mock=mock, extra=extra)
        yield side, body


#: How a backend may write its stream: each SSE line ending, a blank line apart.
WRITES = {
    "lf": {"split_utf8": True},
    "crlf-blank-apart": {"line_ending": "crlf", "blank_apart": True},
    "cr-blank-apart": {"line_ending": "cr", "blank_apart": True, "split_utf8": True},
}


@pytest.mark.parametrize("mock", WRITES.values(), ids=WRITES.keys())
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_client_that_did_not_ask_gets_the_exact_stream_and_is_charged(
    path: str, mock: dict[str, Any]
) -> None:
    async with FakeUpstream(stream_usage="openai", tokens=6) as upstream:
        async for side, body in relayed(upstream, path, mock=mock):
            complete = await side.complete("r-s")
            assert complete.token_counts == TokenCounts(
                prompt_tokens=7, completion_tokens=6, total_tokens=13
            )
            received = "".join(side.chunks("r-s")).encode()
            (sent,) = upstream.requests_to(path)
            assert msgspec.json.decode(sent.body)["stream_options"] == {"include_usage": True}
            assert received == await direct(upstream, path, body)
            assert b"usage" not in received


async def test_a_client_that_asked_gets_the_usage_and_its_own_body() -> None:
    asked = {"stream_options": {"include_usage": True}}
    async with FakeUpstream(stream_usage="openai") as upstream:
        async for side, body in relayed(upstream, CHAT, asked):
            complete = await side.complete("r-s")
            assert complete.token_counts is not None and not complete.token_counts.estimated
            (sent,) = upstream.requests_to(CHAT)
            assert sent.body == body.encode()
            received = "".join(side.chunks("r-s")).encode()
            assert received == await direct(upstream, CHAT, body)
            assert b'"usage":{' in received


async def test_a_backend_that_ignores_the_option_is_charged_an_estimate() -> None:
    async with FakeUpstream(stream_usage="never", tokens=4) as upstream:
        async for side, body in relayed(upstream, CHAT):
            counts = (await side.complete("r-s")).token_counts
            assert counts is not None and counts.estimated
            # role, 4 tokens, finish: one token per event, [DONE] aside
            assert counts.completion_tokens == 6
            assert counts.prompt_tokens == -(-len(body) // 4)
            received = "".join(side.chunks("r-s")).encode()
            assert received == await direct(upstream, CHAT, body)


# -- llama-server's timings ------------------------------------------------------------


def test_a_stream_reporting_only_timings_is_charged_from_them() -> None:
    scanner = UsageScanner()
    scanner.estimate(400)
    last = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    last += b'"timings":{"cache_n":90,"prompt_n":10,"predicted_n":5}}\n\n'
    scanner.count(PLAIN + last + DONE)
    scanner.finish()
    assert scanner.timings
    assert scanner.counts() == TokenCounts(
        prompt_tokens=100, completion_tokens=5, total_tokens=105, cached_tokens=90
    )


async def test_a_llama_server_stream_keeps_its_timings_and_is_then_left_exactly_as_sent() -> None:
    async with (
        FakeUpstream(stream_usage="llama", tokens=4) as upstream,
        FakeRelay() as relay,
        running(config(relay.url, upstream.url)),
    ):
        side = await relay.registered()
        # The first stream is asked for its usage: llama-server moves its timings onto
        # the usage event, which reaches the client without the usage.
        await side.request("r-1", CHAT, stream=True)
        first = await side.complete("r-1")
        received = "".join(side.chunks("r-1")).encode()
        assert b'"timings":{' in received and b'"usage"' not in received
        assert first.token_counts is not None and first.token_counts.completion_tokens == 4
        # The backend reports timings: later streams are not asked, pass unchanged and
        # are charged from the timings.
        body = await side.request("r-2", CHAT, stream=True)
        second = await side.complete("r-2")
        sent = upstream.requests_to(CHAT)[-1]
        assert sent.body == body.encode()
        received = "".join(side.chunks("r-2")).encode()
        assert received == await direct(upstream, CHAT, body)
        assert b'"timings":{' in received
        assert second.token_counts is not None and not second.token_counts.estimated
        assert second.token_counts.completion_tokens == 4
        assert second.token_counts.prompt_tokens == first.token_counts.prompt_tokens


# -- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A live server and the real worker.py before an upstream that reports usage only
    when asked (as llama-server does)."""
    with (
        upstream_in_thread(total_slots=2) as up,
        live_server(tmp_path_factory.mktemp("stream-usage") / "server") as server,
        serving(server, up) as stack,
    ):
        yield stack


def _writes(up: ThreadedUpstream, body: bytes, ending: bytes) -> list[tuple[bytes, bool, bool]]:
    """The upstream's writes of the stream it sends the worker for ``body`` (asked for
    usage, each closing blank line apart): each with whether its event reaches the
    client (all but the usage event) and whether it is the event's line."""
    document = json.loads(body)
    document["stream_options"] = {"include_usage": True}
    answer = httpx.post(up.url + CHAT, json=document, timeout=10).content
    writes = []
    for event in answer.split(ending * 2)[:-1]:
        kept = b'"choices":[]' not in event
        writes += [(event + ending, kept, True), (ending, kept, False)]
    return writes


@pytest.mark.live
@pytest.mark.parametrize("name", ["lf", "crlf", "cr"])
def test_a_blank_line_read_apart_stays_with_its_event_through_the_relay(
    live: Stack, name: str
) -> None:
    """The backend writes each event's closing blank line apart, and the worker reads
    it apart (it is written once the client has the line before it): the client gets
    the stream exactly as if it had not been asked for usage, its last chunk and
    ``[DONE]`` two events, and the request is charged the usage."""
    ending = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}[name]
    mock = {"tokens": 3, "line_ending": name, "blank_apart": True}
    expected = httpx.post(
        live.upstream.url + CHAT, content=body_for(CHAT, stream=True, **mock), timeout=10
    ).content
    writes = _writes(live.upstream, body_for(CHAT, stream=True, **mock), ending)
    metered = token_metrics(live.server)
    seen = len(live.upstream.requests_to(CHAT))
    received = bytearray()
    arrived: queue.Queue[bytes | None] = queue.Queue()

    def take(size: int) -> None:
        deadline = time.monotonic() + 10
        while len(received) < size:
            try:
                data = arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the client has {bytes(received)!r} of {size}") from None
            if data is None:
                return
            received.extend(data)

    body = body_for(CHAT, stream=True, stepped=True, **mock)

    def client() -> None:  # (the response starts once the first write went out)
        with live.client.stream("POST", CHAT, content=body) as streamed:
            for data in streamed.iter_raw():
                arrived.put(data)
        arrived.put(None)

    reader = threading.Thread(target=client, daemon=True)
    reader.start()
    sent = live.upstream.wait_requests(seen + 1, CHAT)[-1]
    written = kept = 0
    for data, reaches_client, is_line in writes:
        live.upstream.release()
        written += len(data)
        kept += len(data) if reaches_client else 0
        if reaches_client and is_line:
            take(kept)  # the worker read it: what comes next is another read
        else:
            poll(lambda size=written: sent.bytes_written >= size, what="the upstream's write")
    take(len(expected) + 1)
    reader.join(10)
    assert bytes(received) == expected
    events = list(SSEDecoder().iter_bytes(iter([bytes(received)])))
    assert [e.data for e in events][-1] == "[DONE]"
    assert [json.loads(e.data)["choices"][0]["index"] for e in events[:-1]] == [0] * 5
    charged = {
        "prompt": metered.get("prompt", 0) + 7,
        "completion": metered.get("completion", 0) + 3,
    }
    poll(lambda: token_metrics(live.server) == charged, what="the request's tokens in /metrics")
