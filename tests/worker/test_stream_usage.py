"""Every stream is charged: the worker asks an OpenAI chat/completions stream for its
usage when the client did not, and the client still receives exactly the bytes it
would have received without it (relay/worker/usage.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from relay.wire.protocol import TokenCounts
from relay.worker.usage import UsageScanner, UsageStripper, ask_for_usage
from tests.upstream import FakeUpstream
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

CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
PLAIN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_the_usage_event_and_nulls_are_taken_out_whatever_the_reads(piece: int) -> None:
    stream = CHUNK + CHUNK.replace(b"hi", b'\\"usage\\":null') + USAGE + DONE
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    for at in range(0, len(stream), piece):
        stripper.feed(stream[at : at + piece])
    stripper.finish()
    assert b"".join(out) == PLAIN + PLAIN.replace(b"hi", b'\\"usage\\":null') + DONE


def test_each_whole_event_is_passed_on_at_once() -> None:
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    stripper.feed(PLAIN)
    assert out == [PLAIN]
    stripper.feed(PLAIN[:10])
    assert out == [PLAIN]  # an unfinished event waits for its end
    stripper.feed(PLAIN[10:] + USAGE[:20])
    assert out == [PLAIN, PLAIN]
    stripper.feed(USAGE[20:] + DONE)
    stripper.finish()
    assert out == [PLAIN, PLAIN, DONE]


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
    upstream: FakeUpstream, path: str, extra: dict[str, Any] | None = None
) -> AsyncIterator[tuple[RelaySide, str]]:
    async with FakeRelay() as relay, running(config(relay.url, upstream.url)):
        side = await relay.registered()
        body = await side.request("r-s", path, stream=True, mock={"split_utf8": True}, extra=extra)
        yield side, body


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_client_that_did_not_ask_gets_the_exact_stream_and_is_charged(path: str) -> None:
    async with FakeUpstream(stream_usage="openai", tokens=6) as upstream:
        async for side, body in relayed(upstream, path):
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

TIMED = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2},'
    b'"timings":{"cache_n":1,"prompt_n":2,"predicted_n":2}}\n\n'
)


def test_timings_on_the_usage_event_reach_the_client_without_the_usage() -> None:
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    stripper.feed(PLAIN + TIMED[:30])
    stripper.feed(TIMED[30:] + DONE)
    stripper.finish()
    received = b"".join(out)
    assert received == (
        PLAIN
        + b'data: {"id":"c","choices":[],"timings":{"cache_n":1,"prompt_n":2,"predicted_n":2}}'
        + b"\n\n"
        + DONE
    )


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
