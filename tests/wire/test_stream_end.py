"""Where a stream's last event begins (:class:`relay.wire.sse.StreamEnd`), wherever the
relayed bytes are cut."""

from __future__ import annotations

import pytest

from relay.wire.errors import Flavor
from relay.wire.sse import StreamEnd
from tests.upstream import _events

#: Each kind of stream as the fake upstream writes it, with the offset at which its
#: last event's marker begins.
STREAMS: list[tuple[Flavor, str]] = [
    ("openai", "/v1/chat/completions"),
    ("openai", "/v1/completions"),
    ("anthropic", "/v1/messages"),
    ("responses", "/v1/responses"),
]
MARKERS = {
    "openai": b"data: [DONE]",
    "anthropic": b"event: message_stop",
    "responses": b"event: response.completed",
}


def stream(path: str) -> bytes:
    return b"".join(_events(path, "m", 3, 5, include_usage=True))


def fed(flavor: Flavor, *chunks: bytes) -> list[bool]:
    end = StreamEnd.of(flavor)
    return [end.feed(chunk) for chunk in chunks]


@pytest.mark.parametrize(("flavor", "path"), STREAMS)
def test_the_last_event_is_found_at_every_split_point_and_not_before(flavor, path):
    whole = stream(path)
    begins = whole.rindex(MARKERS[flavor])
    needed = begins + len(MARKERS[flavor])  # the marker's last byte fed
    for cut in range(1, len(whole)):
        assert fed(flavor, whole[:cut], whole[cut:]) == [cut >= needed, True], cut
    # One byte at a time: seen exactly when the marker's last byte arrives.
    end = StreamEnd.of(flavor)
    seen = [end.feed(whole[i : i + 1]) for i in range(len(whole))]
    assert seen.index(True) == needed - 1 and all(seen[needed - 1 :])


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_any_line_break_starts_a_line_and_so_does_the_stream_itself(eol):
    assert fed("openai", b'data: {"x":1}' + eol + eol + b"data: [DONE]" + eol + eol) == [True]
    assert fed("openai", b"data:[DONE]\n\n") == [True]  # the field without its space
    assert fed("anthropic", b"event: message_stop" + eol) == [True]
    assert fed("responses", b"x" + eol, b"event:response.incomplete" + eol) == [False, True]
    assert fed("responses", b"\nevent: response.failed\ndata: {}\n\n") == [True]


def test_an_event_that_names_its_type_only_in_its_json_ends_the_stream_too():
    # Backends that send no ``event:`` lines: the data line's type says it.
    assert fed("anthropic", b'data: {"type":"message_stop"}\n\n') == [True]
    assert fed("responses", b'data: {"type": "response.incomplete", "x": 1}\n\n') == [True]
    assert fed("anthropic", b'data: {"ty', b'pe":"message_stop"}\n\n') == [False, True]


def test_a_marker_inside_a_payload_or_a_field_is_not_the_end():
    # Text a model wrote: inside a JSON string a line break is escaped, never raw.
    text = b'data: {"delta":"see\\ndata: [DONE]\\n and data: [DONE]"}\n\n'
    assert fed("openai", text, text) == [False, False]
    # A type named inside a string a model wrote is escaped: not the end.
    assert fed("anthropic", b'data: {"text":"{\\"type\\":\\"message_stop\\"}"}\n\n') == [False]
    assert fed("responses", b'data: {"d":"\\"type\\": \\"response.completed\\""}\n\n') == [False]
    assert fed("anthropic", b"event: message_start\n", b"xevent: message_stop\n") == [
        False,
        False,
    ]
    # Another flavor's end is not this one's.
    assert fed("responses", b"data: [DONE]\n\n", b"event: message_stop\n") == [False, False]
    assert fed("openai", b"event: response.completed\n") == [False]
