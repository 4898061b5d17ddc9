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
#: field's name, then the value after one optional space, as the SSE grammar allows) or,
#: for the APIs whose events name their type, that type in the event's JSON (for backends
#: that send no ``event:`` lines). Each alternative starts with a literal, which ``re``
#: looks for at C speed.
_LAST_EVENTS: dict[Flavor, re.Pattern[bytes]] = {
    # chat/completions and completions end with the [DONE] sentinel.
    "openai": re.compile(rb"data: ?\[DONE\]"),
    "anthropic": re.compile(rb'event: ?message_stop|"type" ?: ?"message_stop"'),
    "responses": re.compile(
        rb"event: ?response\.(?:completed|failed|incomplete)"
        rb'|"type" ?: ?"response\.(?:completed|failed|incomplete)"'
    ),
}
#: The endpoints whose streams end with one of those events (other streams are not
#: checked: :meth:`StreamEnd.for_endpoint`).
_ENDPOINTS: dict[str, Flavor] = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
}
#: Bytes kept between chunks: enough for the longest marker and the byte before it.
_REACH = 48
_LINE_BREAKS = b"\r\n"
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")

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
    ``data: [DONE]`` (OpenAI chat/completions and completions), ``message_stop``
    (Anthropic messages), ``response.completed`` / ``.failed`` / ``.incomplete``
    (Responses), as an ``event:`` line or as the ``type`` of the event's JSON. A backend
    that wrote it generates nothing more for that stream. The relay's edge uses it to tell
    a client that left after the end from one that cancelled; the worker, to tell a stream
    its backend cut short from one that ended.

    Exact wherever the chunks are cut: a field line counts only at the start of a line (a
    line break before it, or the stream's first byte), and a JSON ``type`` only where its
    quote is not escaped, which no text a model wrote can fake (JSON escapes line breaks
    and quotes in strings); when a chunk ends inside a line, its last bytes are searched
    again with the next chunk, so a marker split between two chunks is found. The cost per
    chunk is one ``re`` search for a literal over it (C speed, O(chunk)); nothing is
    parsed, and nothing is copied while chunks end with whole lines, as backends write them.
    """

    __slots__ = ("_last", "_search", "_tail", "seen")

    def __init__(self, marker: re.Pattern[bytes] | None) -> None:
        self._search = None if marker is None else marker.search
        #: The stream's last bytes when it stopped inside a line; empty at a line start
        #: (where the stream begins).
        self._tail = b""
        #: The stream's last few bytes (:attr:`between_events`).
        self._last = b"\n\n"
        #: True once the last event's start was fed (from the start for a stream whose
        #: end is not checked).
        self.seen = marker is None

    @classmethod
    def of(cls, flavor: Flavor) -> StreamEnd:
        """The detector for a stream answered in ``flavor``'s format."""
        return cls(_LAST_EVENTS[flavor])

    @classmethod
    def for_endpoint(cls, endpoint_path: str) -> StreamEnd:
        """The detector for a stream of ``endpoint_path``; one that is always
        :attr:`seen` for an endpoint whose streams end with no event of their own."""
        flavor = _ENDPOINTS.get(endpoint_path)
        return cls(None if flavor is None else _LAST_EVENTS[flavor])

    @property
    def between_events(self) -> bool:
        """Whether what was fed so far ends with a whole event (or nothing was fed): an
        event written now reaches a client as an event of its own; otherwise it must
        follow a blank line, or the client would read it as part of the torn one."""
        return self._last.endswith(_EVENT_ENDS)

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes of the stream; True once its last event has begun."""
        if chunk:
            self._last = chunk[-4:] if len(chunk) >= 4 else (self._last + chunk)[-4:]
        if self.seen:
            return True
        tail = self._tail
        if tail:
            # From 1: the byte before a match is then always there, and a marker wholly
            # within the tail was judged with the chunk that brought it.
            data, start = tail + chunk, 1
        elif chunk:
            data, start = chunk, 0
        else:
            return False
        assert self._search is not None
        found = self._search(data, start)
        while found is not None:
            at = found.start()
            before = data[at - 1] if at else None
            if (
                before is None
                or (data[at] != _QUOTE and before in _LINE_BREAKS)
                or (data[at] == _QUOTE and before != _BACKSLASH)
            ):
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


class EventSplitter:
    """Whole server-sent events out of a stream's bytes, however its reads cut it.

    Lines may end with CRLF, LF or CR (the WHATWG ``text/event-stream`` rules), in any
    mix; a blank line ends an event. Each event comes out with its lines' endings made
    LF and without its closing blank line (a CR last in a read ends its line at once;
    an LF first in the next read is then the rest of that CRLF). The cost is linear in
    the bytes fed: an event's pieces are kept apart until a read completes it, and only
    new bytes are searched for its end.
    """

    __slots__ = ("_cr", "_parts")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._cr = False

    def feed(self, data: bytes) -> list[bytes]:
        """The events ``data`` completes, in order."""
        if not data:
            return []
        if self._cr and data.startswith(b"\n"):
            data = data[1:]
            if not data:
                return []
        self._cr = data.endswith(b"\r")
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = self._parts
        # A blank line's two LFs may straddle what was pending and what came.
        if parts and parts[-1].endswith(b"\n") and data.startswith(b"\n"):
            first = parts[-1][:-1] if len(parts) > 1 or len(parts[-1]) > 1 else b""
            parts[-1] = first
            at, start = 0, 1
        else:
            at = data.find(b"\n\n")
            if at < 0:
                parts.append(data)
                return []
            start = at + 2
        # The first event ends in ``data``: joined once (no earlier part holds an end).
        events: list[bytes] = []
        first_event = b"".join([*parts, data[:at]]) if parts else data[:at]
        self._add(events, first_event)
        at = data.find(b"\n\n", start)
        while at >= 0:
            self._add(events, data[start:at])
            start = at + 2
            at = data.find(b"\n\n", start)
        rest = data[start:]
        self._parts = [rest] if rest else []
        return events

    @staticmethod
    def _add(events: list[bytes], event: bytes) -> None:
        event = event.lstrip(b"\n")
        if event:
            events.append(event)

    def rest(self) -> bytes:
        """What was fed after the last whole event (a stream cut inside one)."""
        rest = b"".join(self._parts)
        self._parts = []
        self._cr = False
        return rest.strip(b"\n")
