"""Writing a response of the fast path: completions, errors in the endpoint's envelope,
small JSON documents. Every response carries :data:`SECURITY_HEADERS`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from relay.core.state import Completion
from relay.wire.errors import Flavor, RelayError, error_response
from relay.wire.headers import response_headers

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

#: Sent with every response of the fast path.
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [(b"x-content-type-options", b"nosniff")]
#: Statuses that never carry a body (RFC 9110 §6.4.1).
BODYLESS = frozenset({204, 304})

_JSON = msgspec.json.Encoder()


async def send_completion(
    send: Send, completion: Completion, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = response_headers(completion.headers)
    body = completion.body
    if completion.status in BODYLESS:
        body = b""  # and no content-length: there is no body to frame
    else:
        headers.append((b"content-length", str(len(body)).encode()))
    await send(
        {
            "type": "http.response.start",
            "status": completion.status,
            "headers": headers + SECURITY_HEADERS + extra,
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, err: RelayError, flavor: Flavor, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    status, headers, body = error_response(err, flavor)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + SECURITY_HEADERS + (extra or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, document: object, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = _JSON.encode(document)
    await send_simple(
        send,
        status,
        [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + (extra or []),
        body,
    )


async def send_simple(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + SECURITY_HEADERS}
    )
    await send({"type": "http.response.body", "body": body})
