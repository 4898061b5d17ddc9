"""Token usage read by the worker from backend responses (``relay.worker.usage``), no I/O."""

from __future__ import annotations

import pytest

from relay.wire import protocol
from relay.wire.protocol import TokenCounts
from relay.worker.usage import UsageScanner, format_counts


def test_usage_is_found_in_every_api_shape_however_the_stream_is_cut() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"usage"}}],"usage":null}\n\n'
        b"event: message_start\n"
        b'data: {"type":"message_start",'
        b'"message":{"usage":{"input_tokens":9,"output_tokens":1}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":4}}\n\n'
    )
    for size in (1, 2, 7, len(stream)):
        scanner = UsageScanner()
        for start in range(0, len(stream), size):
            scanner.feed(stream[start : start + size])
        scanner.finish()
        assert scanner.counts() == TokenCounts(9, 4, 13), size
    responses = UsageScanner()
    responses.feed(b'data: {"type":"response.completed","response":{"usage":')
    responses.feed(b'{"input_tokens":3,"output_tokens":2,"total_tokens":6}}}')  # no final newline
    responses.finish()
    assert responses.counts() == TokenCounts(3, 2, 6)
    plain = UsageScanner()
    plain.feed_document(
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}', "application/json"
    )
    assert plain.counts() == TokenCounts(1, 2, 3)
    assert UsageScanner().counts() is None


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_usage_is_found_whatever_the_streams_line_endings(eol: bytes) -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
        b"data: [DONE]\n\n"
    ).replace(b"\n", eol)
    for size in (1, 2, 7, len(stream)):
        scanner = UsageScanner()
        for start in range(0, len(stream), size):
            scanner.feed(stream[start : start + size])
        scanner.finish()
        assert scanner.counts() == TokenCounts(3, 2, 5), size


def test_counts_are_formatted_for_the_per_request_debug_line() -> None:
    assert format_counts(TokenCounts(9, 4, 13)) == "prompt=9 completion=4 total=13"
    assert format_counts(None) == "none reported"


@pytest.mark.parametrize(
    ("document", "content_type"),
    [
        (  # OpenAI chat, and vLLM / SGLang with prefix caching
            b'{"usage": {"prompt_tokens": 90, "completion_tokens": 2,'
            b' "prompt_tokens_details": {"cached_tokens": 64}}}',
            "application/json",
        ),
        (  # the Responses API
            b'{"response": {"usage": {"input_tokens": 90, "output_tokens": 2,'
            b' "input_tokens_details": {"cached_tokens": 64}}}}',
            "application/json",
        ),
        (  # Anthropic: message_start
            b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
            b'{"input_tokens":26,"cache_read_input_tokens":64,"output_tokens":1}}}\n\n',
            "text/event-stream",
        ),
        (  # llama-server's last chunk without usage: timings only
            b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],'
            b'"timings":{"cache_n":64,"prompt_n":26}}\n\ndata: [DONE]\n\n',
            "text/event-stream",
        ),
    ],
)
def test_cached_prompt_tokens_are_read_from_every_backend_shape(
    document: bytes, content_type: str
) -> None:
    scanner = UsageScanner()
    scanner.feed_document(document, content_type)
    counts = scanner.counts()
    assert counts is not None and counts.cached_tokens == 64


def test_a_cached_count_of_the_wrong_type_is_ignored() -> None:
    scanner = UsageScanner()
    scanner.feed_document(
        b'{"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": -3}},'
        b' "timings": {"cache_n": "many"}}',
        "application/json",
    )
    assert scanner.counts() == TokenCounts(5, None, None)


@pytest.mark.parametrize("absurd", [10**12 + 1, 2**64 - 1, 2**70])
def test_a_count_past_any_real_figure_is_dropped_and_the_rest_marked_an_estimate(
    absurd: int,
) -> None:
    """(A backend's unsigned underflow: the relay would drop it too.)"""
    scanner = UsageScanner()
    scanner.feed_document(
        b'{"usage": {"prompt_tokens": %d, "completion_tokens": 2,'
        b' "prompt_tokens_details": {"cached_tokens": %d}}}' % (absurd, absurd),
        "application/json",
    )
    counts = scanner.counts()
    assert counts == TokenCounts(completion_tokens=2, estimated=True)
    assert format_counts(counts) == "prompt=None completion=2 total=None (estimated)"
    streamed = UsageScanner()
    streamed.estimate(40)
    streamed.count(b'data: {"choices":[],"usage":{"total_tokens":%d}}\n\n' % absurd)
    streamed.finish()
    # Nothing usable reported: the stream is counted instead.
    assert streamed.counts() == TokenCounts(10, 0, 10, estimated=True)


def test_llama_timings_carry_the_prompt_and_generation_times() -> None:
    scanner = UsageScanner()
    scanner.feed_document(
        b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":64,'
        b'"prompt_n":26,"prompt_ms":13.5,"predicted_n":8,"predicted_ms":160}}\n\n'
        b"data: [DONE]\n\n",
        "text/event-stream",
    )
    counts = scanner.counts()
    assert counts is not None
    assert (counts.prompt_tokens, counts.cached_tokens) == (90, 64)
    assert (counts.prefill_ms, counts.decode_ms) == (13.5, 160.0)


@pytest.mark.parametrize("value", [b"-1", b'"13"', b"true", b"1e300", b"86400001", b"null"])
def test_a_timing_the_relay_would_refuse_is_left_out(value: bytes) -> None:
    scanner = UsageScanner()
    scanner.feed_document(
        b'{"timings":{"prompt_n":26,"predicted_n":8,"prompt_ms":%s,"predicted_ms":5}}' % value,
        "application/json",
    )
    counts = scanner.counts()
    assert counts is not None and counts.prefill_ms is None and counts.decode_ms == 5.0
    # What is sent decodes at the relay (a refused number would close the connection).
    frame = protocol.ResponseComplete(request_id="r", status_code=200, token_counts=counts)
    assert protocol.decode_worker_message(protocol.encode(frame)) == frame
