"""OpenAI Responses background mode (SPEC §18): the events and the response object of a
response the relay runs on its own.

The backend gets an ordinary streaming request. Its events become the response's log,
one record per event, each rewritten in the only two places this mode departs from
byte for byte: ``sequence_number`` is the relay's own count (0 is the ``response.queued``
event the relay writes when it accepts the request, so a client that streams it learns
the id at once), and every response object an event carries gets the id the relay gave
out and ``background: true``. Events are written back with LF line endings, their
``event:`` line first; comments, events without data and data that is not a JSON object
(a ``[DONE]`` some servers add) are left out.

Only the top level of each event's JSON, and of its ``response`` object, is decoded
(:class:`msgspec.Raw` keeps the rest as it was): a large ``response.completed`` costs one
scan, not a parse into Python objects.

What ``GET /v1/responses/{id}`` returns is built from the events: the object of the last
event that carried one, with the status the response ended with; when the stream ended
without its terminal event, the output items it completed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from relay.wire.errors import RelayError
from relay.wire.sse import EventSplitter

_Object = dict[str, msgspec.Raw]
_decode_object = msgspec.json.Decoder(_Object).decode
_encoder = msgspec.json.Encoder()
_encode = _encoder.encode
_TRUE = msgspec.Raw(b"true")
#: Events whose response object is the response as it ended, and the status it says.
TERMINAL = {
    "response.completed": "completed",
    "response.failed": "failed",
    "response.incomplete": "incomplete",
}
#: An event larger than this is rewritten in steps, the loop serving others in between.
PAUSE_BYTES = 256 * 1024
#: The statuses of a response that ended (the others: queued, in_progress).
ENDED = frozenset({"completed", "failed", "incomplete", "cancelled"})


def queued_response(response_id: str, model: str, created_at: int) -> bytes:
    """The response object a background request is answered with at once."""
    return _encode(
        {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "status": "queued",
            "background": True,
            "model": model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
    )


def event(kind: str, sequence_number: int, **fields: Any) -> bytes:
    """One event of the relay's own, as a record of the log."""
    payload = _encode({"type": kind, "sequence_number": sequence_number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def with_status(response: bytes, status: str, error: dict[str, Any] | None = None) -> bytes:
    """``response`` (an object the relay wrote or rewrote) with another status."""
    document = _decode_object(response)
    document["status"] = msgspec.Raw(_encode(status))
    if error is not None:
        document["error"] = msgspec.Raw(_encode(error))
    return _encode(document)


class BackgroundEvents:
    """The log records of one background response, from its backend's stream."""

    __slots__ = ("_items", "_splitter", "ended", "id", "next_seq", "response", "type_seen")

    def __init__(self, response_id: str, queued: bytes, *, next_seq: int = 1) -> None:
        self.id = response_id
        self.next_seq = next_seq
        #: The response object as it stands (set to ``in_progress`` by the first bytes).
        self.response = queued
        #: Set by an event that says how the response ended (completed, failed, ...).
        self.ended: str | None = None
        self.type_seen = False
        self._splitter = EventSplitter()
        self._items: list[msgspec.Raw] = []

    async def feed(self, data: bytes) -> tuple[list[bytes], bytes | None]:
        """The records ``data`` completes, and the response object when it changed."""
        changed = None
        if not self.type_seen:
            self.type_seen = True
            self.response = changed = with_status(self.response, "in_progress")
        records = []
        for raw in self._splitter.feed(data):
            record, response = await self._rewrite(raw)
            if record is not None:
                records.append(record)
            if response is not None:
                self.response = changed = response
        return records, changed

    async def rest(self) -> list[bytes]:
        """A last event the stream did not close with a blank line."""
        raw = self._splitter.rest()
        if not raw:
            return []
        record, response = await self._rewrite(raw)
        if response is not None:
            self.response = response
        return [] if record is None else [record]

    def error(self, err: RelayError) -> bytes:
        """The Responses ``error`` event reporting ``err`` (the stream ends with it)."""
        record = event("error", self.next_seq, code=err.code, message=err.message, param=None)
        self.next_seq += 1
        return record

    def final(self, status: str, error: dict[str, Any] | None = None) -> bytes:
        """The response object once it ended with ``status`` (the backend's own when its
        stream ended with it; otherwise the last one seen, with the items completed)."""
        if self.ended is not None and status == self.ended:
            return self.response
        document = _decode_object(self.response)
        document["status"] = msgspec.Raw(_encode(status))
        if self._items and self.ended is None:
            document["output"] = msgspec.Raw(b"[" + b",".join(self._items) + b"]")
        if error is not None:
            document["error"] = msgspec.Raw(_encode(error))
        return _encode(document)

    async def _rewrite(self, raw: bytes) -> tuple[bytes | None, bytes | None]:
        """One backend event as a record (None: left out), and its response object.

        Each step is one pass over the event; between them, an event larger than
        :data:`PAUSE_BYTES` lets the loop serve others (a response.completed carries the
        whole answer)."""
        large = len(raw) > PAUSE_BYTES
        name, payload = _fields(raw)
        if payload is None:
            return None, None
        try:
            document = _decode_object(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None, None
        kind = _string(document.get("type")) or name.decode("utf-8", "replace")
        document["sequence_number"] = msgspec.Raw(str(self.next_seq).encode())
        self.next_seq += 1
        response = None
        inner = document.get("response")
        if inner is not None:
            if large:
                await asyncio.sleep(0)
            try:
                obj = _decode_object(inner)
            except (msgspec.DecodeError, msgspec.ValidationError):
                obj = None
            if obj is not None:
                obj["id"] = msgspec.Raw(_encode(self.id))
                obj["background"] = _TRUE
                if large:
                    await asyncio.sleep(0)
                response = _encode(obj)
                document["response"] = msgspec.Raw(response)
                ended = TERMINAL.get(kind)
                if ended is not None:
                    self.ended = ended
        elif kind == "response.output_item.done" and "item" in document:
            self._items.append(document["item"])
        head = b"event: " + kind.encode() + b"\ndata: " if kind else b"data: "
        if not large:
            return head + _encode(document) + b"\n\n", response
        await asyncio.sleep(0)
        record = bytearray(head)
        _encoder.encode_into(document, record, -1)
        record += b"\n\n"
        await asyncio.sleep(0)
        return bytes(record), response


def _fields(raw: bytes) -> tuple[bytes, memoryview | bytes | None]:
    """An event's ``event`` name and its data (None: it has none), its lines found
    without copying them (one data line, as servers write it, is a view of the event)."""
    name = b""
    spans: list[tuple[int, int]] = []
    view = memoryview(raw)
    pos, size = 0, len(raw)
    while pos < size:
        end = raw.find(b"\n", pos)
        if end < 0:
            end = size
        colon = raw.find(b":", pos, end)
        field_end, value = (end, end) if colon < 0 else (colon, colon + 1)
        if value < end and raw[value] == 0x20:  # one space after the colon is not part of it
            value += 1
        field = view[pos:field_end]
        if field == b"data":
            spans.append((value, end))
        elif field == b"event":
            name = raw[value:end]
        pos = end + 1
    if not spans:
        return name, None
    if len(spans) == 1:
        return name, view[spans[0][0] : spans[0][1]]
    return name, b"\n".join(raw[start:end] for start, end in spans)


def _string(raw: msgspec.Raw | None) -> str:
    if raw is None:
        return ""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return ""
    return value if isinstance(value, str) else ""


def error_of(body: bytes, status: int) -> dict[str, Any]:
    """The ``error`` of a response whose backend answered ``status`` with ``body`` (the
    backend's own message when its body is an OpenAI error document)."""
    message = f"The backend answered {status}"
    code = "server_error" if status >= 500 else "invalid_request"
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        found = document["error"]
        if isinstance(found.get("message"), str):
            message = found["message"][:1000]
        if isinstance(found.get("code"), str):
            code = found["code"][:100]
    return {"code": code, "message": message}


def backend_body(body: bytes) -> bytes:
    """What the backend gets for a background request: the client's body without
    ``background``, with ``stream: true`` (the backend needs to know nothing of the mode;
    the other members keep their order and bytes)."""
    document = _decode_object(body)
    document.pop("background", None)
    document["stream"] = _TRUE
    return _encode(document)
