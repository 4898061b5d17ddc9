"""The old client API, ``POST /api/chat``, as a chat completion and back.

Request: a JSON object with ``model``, ``messages`` (``[{"role": "user"|"assistant",
"content": "…"}]``), and optionally ``system``, ``temperature``, ``max_new_tokens``,
``conversation_id`` and ``user_id``. :func:`parse_request` makes a streaming
``/v1/chat/completions`` body of it, which any worker can serve: a modern worker's
backend, or a legacy node through :mod:`relay.core.legacy.tasks` (the round trip
gives the node the task the old broker would have).

Response: ``text/event-stream`` whose body is newline-delimited JSON: ``{"o":"…"}``
per piece of text, then ``{"done":true}``, or ``{"err":"…"}`` (possibly after some
text) saying what happened: the old broker's five messages where one of them does,
and as short a message in their style where none does (:func:`old_error`).
:class:`ChatStreamReader` pulls the text out of the chat-completion events the worker
streams back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from relay.wire.errors import (
    BadRequest,
    ClientError,
    ConcurrencyLimited,
    GatewayTimeout,
    ModelNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    ProviderDisabled,
    ProviderGone,
    QueueFull,
    QueueTimeout,
    QuotaExceeded,
    RateLimited,
    RelayError,
    RequeueExhausted,
    ServiceUnavailable,
    ShuttingDown,
    SlowClient,
    StreamTooLarge,
    Unauthorized,
    WorkerFailed,
    WorkerLost,
    WorkerUnavailable,
)

PATH = "/api/chat"
#: Where the translated request goes (what a modern worker posts to its backend).
ENDPOINT = "/v1/chat/completions"

UNAUTHORIZED = "unauthorized"
UNKNOWN_MODEL = "unknown model"
INVALID_REQUEST = "invalid request"
NO_NODE = "timeout waiting for node"
NO_FINISH = "timeout waiting for finish"
#: A stream whose backend sent an error event instead of the rest of the answer.
BACKEND_FAILED = "backend error"

#: What an old client reads for each relay error: the first class the error is an
#: instance of (so a subclass comes before its base). The old broker's five messages
#: where one of them says what happened; else a message in their style.
MESSAGES: tuple[tuple[type[RelayError], str], ...] = (
    (Unauthorized, UNAUTHORIZED),  # no key, not a key, an expired key
    (ModelNotAllowed, UNAUTHORIZED),
    (ModelNotFound, UNKNOWN_MODEL),
    (PayloadTooLarge, "request too large"),
    (QueueFull, "queue full"),
    (ConcurrencyLimited, "too many requests at once for this key"),
    (QuotaExceeded, "token budget of this key spent"),
    (RateLimited, "rate limit of this key exceeded"),
    (ClientError, INVALID_REQUEST),
    (QueueTimeout, NO_NODE),
    (GatewayTimeout, NO_FINISH),
    (ProviderDisabled, "provider disabled"),
    (ProviderGone, "no node for this model"),
    (ShuttingDown, "server shutting down"),
    (RequeueExhausted, "nodes lost, gave up"),
    (WorkerLost, "node lost"),
    (WorkerUnavailable, "node lost"),
    (ServiceUnavailable, "service unavailable"),
    (WorkerFailed, "node failed"),
    (StreamTooLarge, "answer too large"),
    (SlowClient, "client too slow"),
)

CONTENT_TYPE = b"text/event-stream"

#: Bounds on the old client's numbers (compared as sent: a 400-digit integer is
#: refused here, never converted): OpenAI's temperature range, a 31-bit token budget.
MAX_TEMPERATURE = 2
MAX_NEW_TOKENS = 2**31 - 1

_JSON = msgspec.json.Encoder()
_DONE = b'{"done":true}\n'


@dataclass(frozen=True, slots=True)
class OldChat:
    model: str
    #: The equivalent streaming chat-completions body.
    body: str
    #: The old client's own labels, kept for the log.
    conversation_id: str | None = None
    user_id: str | None = None


def parse_request(raw: bytes) -> OldChat:
    """The chat completion an old client asked for, or :class:`BadRequest`."""
    try:
        document = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise BadRequest("Request body is not valid JSON") from None
    if not isinstance(document, dict):
        raise BadRequest("Request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("'model' is required")
    raw_messages = document.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("'messages' must be a non-empty list")
    messages: list[dict[str, str]] = []
    system = document.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise BadRequest("'system' must be a string")
        if system:
            messages.append({"role": "system", "content": system})
    for message in raw_messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise BadRequest("each message needs a role (user or assistant) and text content")
        messages.append({"role": role, "content": content})
    chat: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    temperature = document.get("temperature")
    if temperature is not None:
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= MAX_TEMPERATURE
        ):
            raise BadRequest(f"'temperature' must be a number from 0 to {MAX_TEMPERATURE}")
        chat["temperature"] = temperature
    budget = document.get("max_new_tokens")
    if budget is not None:
        if (
            isinstance(budget, bool)
            or not isinstance(budget, int)
            or not 1 <= budget <= MAX_NEW_TOKENS
        ):
            raise BadRequest(f"'max_new_tokens' must be an integer from 1 to {MAX_NEW_TOKENS}")
        chat["max_tokens"] = budget
    return OldChat(
        model=model,
        body=_JSON.encode(chat).decode(),
        conversation_id=_label(document.get("conversation_id")),
        user_id=_label(document.get("user_id")),
    )


def _label(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)[:128]


def old_error(err: RelayError) -> str:
    """What happened, as an old client reads it (:data:`MESSAGES`)."""
    for kind, message in MESSAGES:
        if isinstance(err, kind):
            return message
    return "relay error"


def refusal(err: RelayError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` for a request refused before it was queued: the
    error's own status (401, 413, 429, …), and its one old error line as the body."""
    body = error_line(old_error(err))
    headers = [
        (b"content-type", CONTENT_TYPE),
        (b"cache-control", b"no-cache"),
        (b"content-length", str(len(body)).encode()),
    ]
    if err.retry_after is not None:
        headers.append((b"retry-after", str(err.retry_after).encode()))
    return err.status, headers + err.headers, body


def status_error(status: int) -> str:
    """The old message for a backend that answered ``status`` instead of streaming: it
    refused the request (4xx), or failed (with its status, which says how)."""
    return INVALID_REQUEST if 400 <= status < 500 else f"{BACKEND_FAILED} {status}"


def text_line(text: str) -> bytes:
    return b'{"o":' + _JSON.encode(text) + b"}\n"


def done_line() -> bytes:
    return _DONE


def error_line(message: str) -> bytes:
    return b'{"err":' + _JSON.encode(message) + b"}\n"


class ChatStreamReader:
    """Text out of a chat-completions event stream, fed in arbitrary byte pieces.

    Only ``data:`` lines count; comments, other fields, usage-only chunks and
    ``[DONE]`` yield no text. A data line carrying ``{"error": …}`` sets
    :attr:`failed`. Lines that are not JSON are skipped.
    """

    #: Most bytes kept waiting for the end of one line (a runaway line is dropped).
    MAX_LINE = 1 << 20

    def __init__(self) -> None:
        self._partial = b""
        self.failed = False

    def feed(self, data: bytes) -> list[str]:
        buffer = self._partial + data
        lines = buffer.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self.MAX_LINE:
            self._partial = b""
        out: list[str] = []
        for line in lines:
            text = self._text(line.rstrip(b"\r"))
            if text:
                out.append(text)
        return out

    def close(self) -> list[str]:
        """Whatever the last, unterminated line held."""
        rest, self._partial = self._partial, b""
        text = self._text(rest.rstrip(b"\r"))
        return [text] if text else []

    def _text(self, line: bytes) -> str:
        if not line.startswith(b"data:"):
            return ""
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return ""
        try:
            document = msgspec.json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return ""
        if not isinstance(document, dict):
            return ""
        if "error" in document:
            self.failed = True
            return ""
        return "".join(_choice_texts(document, "delta"))


def completion_text(body: bytes) -> str | None:
    """The assistant text of a whole (non-streamed) chat completion, or ``None``."""
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(document, dict) or not isinstance(document.get("choices"), list):
        return None
    return "".join(_choice_texts(document, "message"))


def _choice_texts(document: dict[str, Any], key: str) -> list[str]:
    out: list[str] = []
    choices = document.get("choices")
    if not isinstance(choices, list):
        return out
    for choice in choices:
        part = choice.get(key) if isinstance(choice, dict) else None
        content = part.get("content") if isinstance(part, dict) else None
        if isinstance(content, str):
            out.append(content)
    return out
