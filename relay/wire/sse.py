"""Server-sent-event framing the relay itself emits.

Token chunks from workers are never parsed or re-framed: they are already SSE and
pass through byte for byte. The relay only writes its own events when it must end a
stream that already reached the client (worker lost, stream ceiling, timeout), in
the style each endpoint's SDK understands.
"""

from __future__ import annotations

import msgspec

from relay.wire.errors import Flavor, RelayError

_JSON = msgspec.json.Encoder()

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
