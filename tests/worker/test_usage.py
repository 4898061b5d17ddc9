"""Token usage read by the worker from backend responses (``relay.worker.usage``), no I/O."""

from __future__ import annotations

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


def test_counts_are_formatted_for_the_per_request_debug_line() -> None:
    assert format_counts(TokenCounts(9, 4, 13)) == "prompt=9 completion=4 total=13"
    assert format_counts(None) == "none reported"
