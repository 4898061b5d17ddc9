"""The usage event the worker asked for, taken out of a stream before the client.

Used by :mod:`relay.worker.backend` for a chat/completions stream whose client did not
ask for its usage while the worker did (:func:`relay.worker.usage.ask_for_usage`): the
client must receive exactly the bytes it would have received without the worker's
ask. Imports nothing from Django.

The body is read as server-sent events (the WHATWG ``text/event-stream`` rules):
lines end with CRLF, LF or CR, and a blank line ends an event, whatever mix of endings
the backend writes and however its reads cut the stream, a CRLF included. One event
is taken out: the usage event, whose ``data`` is a JSON object with ``choices: []``
and a ``usage`` object (llama-server's, which also carries ``timings``, is passed on
with its ``usage`` member removed). Of every other event, the bytes go out as they
were received, line endings included, but for the ``"usage":null`` member that
OpenAI-style servers add to every chunk once usage is asked for.

Bytes go out as soon as they cannot belong to the usage event: an event's lines are
held only until its first ``data`` line tells what it is (at once when that line
starts as a chunk with choices does, or is not a JSON object), and of a kept ``data``
line only a tail that may be the start of a ``"usage":null`` member waits for more.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

#: An event, or a line tail, still undecided after this many bytes goes out as it is.
MAX_HELD = 64 * 1024

#: Where an event's bytes go: held (while undecided), out to the client, or nowhere.
_IDLE, _HOLD, _KEEP, _DROP = range(4)
#: One line ending: CRLF, LF or CR (a CR last in a read may still be a CRLF's start).
_EOL = re.compile(rb"\r\n?|\n")
#: How a read that ends an event may end (a CR last may be half a CRLF).
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
#: A data line that starts as a chunk with choices: never the usage event.
_CONTENT = re.compile(rb'"choices"\s*:\s*\[\s*\{')
#: ``"usage":null`` as a member of an object (with its comma), once what follows it
#: shows it whole.
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,')
#: What may still become a ``"usage":null`` member: from the ``,`` or ``{`` before it.
_NULL_START = re.compile(
    rb'[,{]\s*(?:"(?:u(?:s(?:a(?:g(?:e(?:"\s*(?::\s*(?:n(?:u(?:l(?:l\s*)?)?)?)?)?)?)?)?)?)?)?)?'
)


def _value(line: bytes) -> bytes:
    """A ``data`` line's value (one space after the colon is not part of it)."""
    return line[6:] if line.startswith(b"data: ") else line[5:]


def _is_data(line: bytes) -> bool:
    return line.startswith(b"data:") or line == b"data"


def _may_be_data(start: bytes) -> bool:
    """Whether a line starting with ``start`` may still be a ``data`` line."""
    return b"data:".startswith(start) if len(start) < 5 else start.startswith(b"data:")


def _without_nulls(line: bytes) -> bytes:
    return _NULL_USAGE.sub(b"", line) if b'"usage"' in line else line


def _usage_event(line: bytes) -> bytes | None:
    """What replaces an event's whole first ``data`` line: None (the line as it is)
    for any event but the usage event, b"" (the event left out) for the usage event,
    and for llama-server's (with ``timings``) the line re-encoded without its ``usage``."""
    value = _value(line)
    if b'"usage"' not in value or _CONTENT.search(value) is not None:
        return None
    try:
        doc = msgspec.json.decode(value)
    except msgspec.DecodeError:
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("choices") != []
        or not isinstance(doc.get("usage"), dict)
    ):
        return None
    if "timings" not in doc:
        return b""
    del doc["usage"]
    return line[: len(line) - len(value)] + msgspec.json.encode(doc)


def _decided_early(line: bytes) -> bool:
    """Whether an unfinished first ``data`` line is already known not to be the usage
    event: its value is no JSON object, or a chunk with choices."""
    if not line.startswith(b"data:"):
        return False
    value = _value(line).lstrip(b" \t")
    if not value:
        return False
    return value[:1] != b"{" or _CONTENT.search(value) is not None


class UsageStripper:
    """Passes a stream on without what asking for its usage added.

    Fed each read of an SSE body (:meth:`feed`), then :meth:`finish` once it ended;
    hands ``sink`` what may go out at once, at most one call per read. A read of whole
    events with no ``"usage"`` in it costs two searches and passes unchanged.
    """

    __slots__ = ("_begun", "_cr_to", "_data", "_held", "_line", "_sink", "_state")

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self._sink = sink
        #: What becomes of the current event (``_IDLE``: between events).
        self._state = _IDLE
        #: ``_HOLD``: the event's whole lines so far.
        self._held = bytearray()
        #: The unfinished line's bytes not yet passed on (``_HOLD``: all of them).
        self._line = b""
        #: Part of the unfinished line went out already (so it is not blank).
        self._begun = False
        #: ``_KEEP``: whether the unfinished line is a ``data`` line (None: not known yet).
        self._data: bool | None = None
        #: A CR ended the last read: where an LF starting the next one goes (it is the
        #: same line ending), or None.
        self._cr_to: int | None = None

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if (
            self._state == _IDLE
            and self._cr_to is None
            and data.endswith(_EVENT_ENDS)
            and b'"usage"' not in data
        ):
            self._sink(data)  # whole events, nothing to take out: the usual read
            return
        out = bytearray()
        at = 0
        if self._cr_to is not None:
            if data[:1] == b"\n":
                if self._cr_to == _KEEP:
                    out += b"\n"
                elif self._cr_to == _HOLD:
                    self._held += b"\n"
                at = 1
            self._cr_to = None
        end = len(data)
        while at < end:
            eol = _EOL.search(data, at)
            if eol is None:
                self._unfinished(data[at:], out)
                break
            start, stop = eol.span()
            went = self._ended(data[at:start], data[start:stop], out)
            if stop == end and data[start:stop] == b"\r":
                self._cr_to = went
            at = stop
        if out:
            self._sink(bytes(out))

    def finish(self) -> None:
        """The stream ended: an unfinished event goes out (but the usage event)."""
        out = bytearray()
        if self._state == _HOLD:
            line = self._line
            kept = _usage_event(line) if _is_data(line) else None
            if kept != b"":
                out += self._held
                out += line if kept is None else kept
        elif self._state == _KEEP:
            out += _without_nulls(self._line) if self._data else self._line
        self._reset(_IDLE)
        self._cr_to = None
        if out:
            self._sink(bytes(out))

    # -- one line at a time -------------------------------------------------------------

    def _ended(self, text: bytes, eol: bytes, out: bytearray) -> int:
        """A line ended with ``eol``; returns where its bytes went (``_HOLD``,
        ``_KEEP`` or ``_DROP``)."""
        line = self._line + text if self._line else text
        blank = not line and not self._begun
        state = self._state
        if state == _IDLE:
            if blank:
                out += eol  # a stray blank line between events: not the usage event's
                return _KEEP
            state = self._state = _HOLD
        if state == _HOLD:
            if blank:  # an event without data: nothing to take out
                out += self._held
                out += eol
                self._reset(_IDLE)
                return _KEEP
            if _is_data(line):
                kept = _usage_event(line)
                if kept == b"":
                    self._reset(_DROP)
                    return _DROP
                out += self._held
                out += _without_nulls(line) if kept is None else kept
                out += eol
                self._reset(_KEEP)
                return _KEEP
            self._held += line
            self._held += eol
            self._line = b""
            if len(self._held) > MAX_HELD:
                out += self._held
                self._reset(_KEEP)
                return _KEEP
            return _HOLD
        if state == _KEEP:
            if not blank:
                if self._data is None:
                    self._data = _is_data(line)
                out += _without_nulls(line) if self._data else line
            out += eol
            self._line, self._begun, self._data = b"", False, None
            if blank:
                self._state = _IDLE
            return _KEEP
        # _DROP: the usage event's lines, up to and with the blank line that ends it
        self._line, self._begun = b"", False
        if blank:
            self._state = _IDLE
        return _DROP

    def _unfinished(self, text: bytes, out: bytearray) -> None:
        """The read ended inside a line."""
        state = self._state
        if state == _IDLE:
            state = self._state = _HOLD
        if state == _HOLD:
            line = self._line + text if self._line else text
            if _decided_early(line):
                out += self._held
                self._reset(_KEEP)
                self._data = True
                self._pass(line, out)
            elif len(self._held) + len(line) > MAX_HELD:
                out += self._held
                out += line
                self._reset(_KEEP)
                self._begun, self._data = True, False
            else:
                self._line = line
        elif state == _KEEP:
            self._pass(self._line + text if self._line else text, out)
        else:
            self._begun = True

    def _pass(self, line: bytes, out: bytearray) -> None:
        """Of the unfinished line of a kept event, what may go out now."""
        if self._data is None:
            if not _may_be_data(line[:5]):
                self._data = False
            elif len(line) < 5:
                self._line = line  # "dat" may still be "data:"
                return
            else:
                self._data = True
        if self._data:
            line = _without_nulls(line)
            cut = max(line.rfind(b","), line.rfind(b"{"))
            if cut >= 0 and len(line) - cut <= MAX_HELD and _NULL_START.fullmatch(line, cut):
                self._line = line[cut:]
                line = line[:cut]
            else:
                self._line = b""
        else:
            self._line = b""
        if line:
            out += line
            self._begun = True

    def _reset(self, state: int) -> None:
        self._state = state
        self._held = bytearray()
        self._line, self._begun, self._data = b"", False, None
