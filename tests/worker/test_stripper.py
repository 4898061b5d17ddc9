"""The usage event the worker asked for is taken out of a stream, and nothing else
(``relay.worker.stripper``), however the backend's reads cut it; no I/O.

The client's bytes are read back with the openai SDK's own SSE decoder: every event it
sees must be one the backend sent, whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec
import pytest
from openai._streaming import SSEDecoder

from relay.worker.stripper import MAX_HELD, UsageStripper

CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
PLAIN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


def stripped(*reads: bytes) -> bytes:
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    for data in reads:
        stripper.feed(data)
    stripper.finish()
    return b"".join(out)


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_the_usage_event_and_nulls_are_taken_out_whatever_the_reads(piece: int) -> None:
    stream = CHUNK + CHUNK.replace(b"hi", b'\\"usage\\":null') + USAGE + DONE
    reads = [stream[at : at + piece] for at in range(0, len(stream), piece)]
    assert stripped(*reads) == PLAIN + PLAIN.replace(b"hi", b'\\"usage\\":null') + DONE


def test_each_whole_event_is_passed_on_at_once() -> None:
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    stripper.feed(PLAIN)
    assert out == [PLAIN]
    stripper.feed(PLAIN[:10])
    assert out == [PLAIN]  # not yet known not to be the usage event
    stripper.feed(PLAIN[10:] + USAGE[:20])
    assert out == [PLAIN, PLAIN]
    stripper.feed(USAGE[20:] + DONE)
    stripper.finish()
    assert out == [PLAIN, PLAIN, DONE]


# -- every split point ---------------------------------------------------------------

LF, CRLF, CR = b"\n", b"\r\n", b"\r"
#: (a line's ending, the ending of the blank line after it), for each event in turn.
#: A CR is never followed by an LF-ended blank line: together they are one CRLF.
ENDINGS = {
    "lf": [(LF, LF)],
    "crlf": [(CRLF, CRLF)],
    "cr": [(CR, CR)],
    "mixed": [(LF, CRLF), (CRLF, LF), (CR, CR), (CRLF, CR), (LF, CR), (CR, CRLF)],
}


def _chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


@dataclass
class Stream:
    """A backend's stream, asked for its usage, and what its client must receive."""

    sent: bytes = b""
    expected: bytes = b""
    #: (start, end) in ``sent`` of the usage event.
    usage: tuple[int, int] = (0, 0)
    #: Each kept event's (start, decided, end) in ``sent``: from ``decided`` on it is
    #: known not to be the usage event (past ``"choices":[{`` or the ``[`` of
    #: ``[DONE]``; an event without data at its end).
    kept: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, lines: list[bytes], ends: tuple[bytes, bytes], kept: list[bytes] | None) -> None:
        """One event; ``kept``: its lines as the client gets them (None: left out)."""
        line_end, blank_end = ends
        event = b"".join(line + line_end for line in lines) + blank_end
        start, self.sent = len(self.sent), self.sent + event
        if kept is None:
            self.usage = (start, len(self.sent))
            return
        self.expected += b"".join(line + line_end for line in kept) + blank_end
        decided = len(event)
        for marker in (b'"choices":[{', b"data: ["):
            if marker in event:
                decided = event.index(marker) + len(marker)
        self.kept.append((start, start + decided, len(self.sent)))


def openai_stream(endings: list[tuple[bytes, bytes]], nulls: bool = True) -> Stream:
    """What OpenAI (or vLLM) streams once asked for usage: ``"usage":null`` in every
    chunk (``nulls``), then the usage chunk, then ``[DONE]``; a comment and an event
    with an ``id`` too."""
    cycle = iter(endings * 10)
    stream = Stream()
    stream.add([b": keep-alive"], next(cycle), [b": keep-alive"])
    chunks = [_chunk({"role": "assistant", "content": ""})]
    chunks += [_chunk({"content": f" t{i}\u20ac"}) for i in range(3)]
    chunks.append(_chunk({}, "stop"))
    for i, chunk in enumerate(chunks):
        data = b"data: " + msgspec.json.encode(chunk)
        asked = data[:-1] + b',"usage":null}' if nulls else data
        named = [b"id: %d" % i] if i == 2 else []
        stream.add([*named, asked], next(cycle), [*named, data])
    usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
    last = b"data: " + msgspec.json.encode({"id": "chatcmpl-1", "choices": [], "usage": usage})
    stream.add([last], next(cycle), None)
    stream.add([b"data: [DONE]"], next(cycle), [b"data: [DONE]"])
    return stream


def assert_valid_events(received: bytes) -> None:
    """The client's bytes as the openai SDK reads them: every chunk whole, then [DONE]."""
    events = list(SSEDecoder().iter_bytes(iter([received])))
    assert [e.data for e in events][-1] == "[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert len(chunks) == 5
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert [e.id for e in events[:3]] == [None, None, "2"]


@pytest.mark.parametrize("endings", ENDINGS.values(), ids=ENDINGS.keys())
def test_whatever_byte_two_reads_are_cut_at_only_the_usage_event_is_left_out(
    endings: list[tuple[bytes, bytes]],
) -> None:
    stream = openai_stream(endings)
    assert_valid_events(stream.expected)
    for cut in range(len(stream.sent) + 1):
        received = stripped(stream.sent[:cut], stream.sent[cut:])
        assert received == stream.expected, cut


@pytest.mark.parametrize("endings", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_read_of_one_or_two_bytes_anywhere_changes_nothing(
    endings: list[tuple[bytes, bytes]],
) -> None:
    stream = openai_stream(endings)
    sent = stream.sent
    for cut in range(len(sent)):
        for size in (1, 2):
            three = (sent[:cut], sent[cut : cut + size], sent[cut + size :])
            assert stripped(*three) == stream.expected, (cut, size)


def test_a_blank_line_that_comes_alone_stays_with_its_event() -> None:
    """A backend's blank line after the last chunk in a read of its own, the usage
    event next: the chunk and ``[DONE]`` stay two events."""
    last = PLAIN[:-1]
    received = stripped(last, b"\n", USAGE[:-1], b"\n", DONE)
    assert received == PLAIN + DONE
    events = list(SSEDecoder().iter_bytes(iter([received])))
    assert [e.data for e in events] == [PLAIN[6:-2].decode(), "[DONE]"]


@pytest.mark.parametrize("endings", ENDINGS.values(), ids=ENDINGS.keys())
def test_bytes_go_out_as_soon_as_they_cannot_be_the_usage_events(
    endings: list[tuple[bytes, bytes]],
) -> None:
    """After each prefix of the stream, the client has every byte of it that cannot
    belong to the usage event: all of an event from the moment it is known to be
    another one, but for a member name's start (``,"`` or ``{"``) that may still be
    ``"usage":null``'s."""
    stream = openai_stream(endings, nulls=False)  # (llama-server's shape)
    start, end = stream.usage
    for cut in range(len(stream.sent) + 1):
        out: list[bytes] = []
        UsageStripper(out.append).feed(stream.sent[:cut])
        received = b"".join(out)
        assert stream.expected.startswith(received), cut
        known = cut if cut <= start else max(start, cut - (end - start))
        lag = 0
        for begin, decided, stop in stream.kept:
            if begin <= cut < stop:
                lag = cut - begin if cut < decided else 2
        assert len(received) >= known - lag, cut


# -- what is the usage event ------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"choices":[{"index":0}],"usage":{"prompt_tokens":1}}\n\n',  # choices
        b'data: {"choices":[],"usage":"none"}\n\n',  # no usage object
        b'data: {"usage":{"prompt_tokens":1}}\n\n',  # no choices
        b'data: {"choices":[],"usage":{"prompt_tokens":1}\n\n',  # not JSON
        b'data: ["usage",{"choices":[]}]\n\n',  # not an object
        b'event: usage\ndata: {"choices":[{}],"usage":{}}\n\n',
        b": usage\n\n",
    ],
)
def test_only_the_usage_event_is_left_out(event: bytes) -> None:
    assert stripped(PLAIN + event + DONE) == PLAIN + event + DONE


def test_the_lines_before_the_usage_events_data_go_with_it() -> None:
    usage = b"event: chunk\r\nid: 9\r\n: note\r\n" + USAGE.replace(b"\n", b"\r\n")
    assert stripped(PLAIN, usage, DONE) == PLAIN + DONE
    assert stripped(PLAIN + usage[:30], usage[30:] + DONE) == PLAIN + DONE


def test_a_stream_ending_inside_the_usage_event_leaves_it_out() -> None:
    assert stripped(PLAIN + USAGE[:-2]) == PLAIN
    assert stripped(PLAIN + USAGE[:-1]) == PLAIN
    assert stripped(PLAIN + b"data: [DO") == PLAIN + b"data: [DO"


def test_an_event_undecided_past_the_bound_goes_out_as_it_is() -> None:
    comment = b": " + b"-" * MAX_HELD + b"\n"
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    stripper.feed(comment)
    assert b"".join(out) == comment  # not held for ever
    stripper.feed(USAGE + DONE)
    stripper.finish()
    assert b"".join(out) == comment + USAGE + DONE
    held = b'data: {"id":"' + b"x" * MAX_HELD
    out.clear()
    stripper = UsageStripper(out.append)
    stripper.feed(held[: MAX_HELD - 10])
    assert out == []
    stripper.feed(held[MAX_HELD - 10 :])
    assert b"".join(out) == held


def test_a_whitespace_tail_after_a_comma_is_held_only_up_to_the_bound() -> None:
    start = b'data: {"choices":[{"index":0}],'
    out: list[bytes] = []
    stripper = UsageStripper(out.append)
    stripper.feed(start + b" " * (MAX_HELD - 1))
    assert b"".join(out) == start[:-1]
    stripper.feed(b" " * 2)
    assert b"".join(out) == start + b" " * (MAX_HELD + 1)


# -- llama-server's timings ------------------------------------------------------------

TIMED = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2},'
    b'"timings":{"cache_n":1,"prompt_n":2,"predicted_n":2}}\n\n'
)


@pytest.mark.parametrize("eol", [LF, CRLF, CR])
def test_timings_on_the_usage_event_reach_the_client_without_the_usage(eol: bytes) -> None:
    plain, timed, done = (e.replace(b"\n", eol) for e in (PLAIN, TIMED, DONE))
    received = stripped(plain + timed[:30], timed[30:] + done)
    assert received == (
        plain
        + b'data: {"id":"c","choices":[],"timings":{"cache_n":1,"prompt_n":2,"predicted_n":2}}'
        + eol * 2
        + done
    )
