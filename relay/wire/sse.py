"""Server-sent-event framing the relay itself emits.

Token chunks from workers are never parsed or re-framed: they are already SSE and
pass through byte for byte. The relay only writes its own events when it must end a
stream that already reached the client (worker lost, stream ceiling, timeout), in
the style each endpoint's SDK understands, and looks in the bytes it relays for where a
stream's last event begins (:class:`StreamEnd`), so that a client leaving after it is not
taken for one that cancelled.
"""

from __future__ import annotations

import re

import msgspec

from relay.wire.errors import Flavor, RelayError

_JSON = msgspec.json.Encoder()

#: Where the last event of each kind of stream begins: a field line of its own (the
#: field's name, then the value after one optional space, as the SSE grammar allows).
#: Each pattern starts with a literal, which ``re`` looks for at C speed.
_LAST_EVENTS: dict[Flavor, re.Pattern[bytes]] = {
    # chat/completions and completions end with the [DONE] sentinel.
    "openai": re.compile(rb"data: ?\[DONE\]"),
    "anthropic": re.compile(rb"event: ?message_stop"),
    "responses": re.compile(rb"event: ?response\.(?:completed|failed|incomplete)"),
}
#: Bytes kept between chunks: enough for the longest marker and the byte before it.
_REACH = 40
_LINE_BREAKS = b"\r\n"

STREAM_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_event(err: RelayError, flavor: Flavor) -> bytes:
    """One complete SSE event reporting ``err`` to a client mid-stream.

    - ``/v1/messages``: Anthropic's ``event: error`` with ``{"type":"error","error":{...}}``.
    - ``/v1/responses``: the Responses API ``error`` event.
    - ``/v1/chat/completions``: a ``data:`` line carrying OpenAI's ``{"error":{...}}``.
    """
    if flavor == "anthropic":
        payload = _JSON.encode(
            {"type": "error", "error": {"type": err.anthropic_type, "message": err.message}}
        )
        return b"event: error\ndata: " + payload + b"\n\n"
    if flavor == "responses":
        payload = _JSON.encode(
            {"type": "error", "code": err.code, "message": err.message, "param": None}
        )
        return b"event: error\ndata: " + payload + b"\n\n"
    payload = _JSON.encode(
        {"error": {"message": err.message, "type": err.openai_type, "code": err.code}}
    )
    return b"data: " + payload + b"\n\n"


class StreamEnd:
    """Tells when the bytes of a stream, fed in order, reach the start of its last event:
    ``data: [DONE]`` (OpenAI chat/completions and completions), ``event: message_stop``
    (Anthropic messages), ``event: response.completed`` / ``.failed`` / ``.incomplete``
    (Responses). A backend that wrote it generates nothing more for that stream.

    Exact wherever the chunks are cut: a marker counts only at the start of a line (a
    line break before it, or the stream's first byte), which no JSON ``data:`` payload
    can fake since JSON escapes line breaks; and when a chunk ends inside a line, its
    last bytes are searched again with the next chunk, so a marker split between two
    chunks is found. The cost per chunk is one ``re`` search for a literal over it (C
    speed, O(chunk)); nothing is parsed, and nothing is copied while chunks end with
    whole lines, as backends write them.
    """

    __slots__ = ("_search", "_tail", "seen")

    def __init__(self, marker: re.Pattern[bytes]) -> None:
        self._search = marker.search
        #: The stream's last bytes when it stopped inside a line; empty at a line start
        #: (where the stream begins).
        self._tail = b""
        #: True once the last event's start was fed.
        self.seen = False

    @classmethod
    def of(cls, flavor: Flavor) -> StreamEnd:
        """The detector for a stream answered in ``flavor``'s format."""
        return cls(_LAST_EVENTS[flavor])

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes of the stream; True once its last event has begun."""
        tail = self._tail
        if tail:
            # From 1: the byte before a match is then always there, and a marker wholly
            # within the tail was judged with the chunk that brought it.
            data, start = tail + chunk, 1
        elif chunk and not self.seen:
            data, start = chunk, 0
        else:
            return self.seen
        found = self._search(data, start)
        while found is not None:
            at = found.start()
            if at == 0 or data[at - 1] in _LINE_BREAKS:
                self.seen = True
                self._tail = b""
                return True
            found = self._search(data, at + 1)
        if not chunk or chunk[-1] not in _LINE_BREAKS:
            # (From a line start, a line break stands for what came before.)
            self._tail = (data if tail else b"\n" + data)[-_REACH:]
        elif tail:
            self._tail = b""
        return False
