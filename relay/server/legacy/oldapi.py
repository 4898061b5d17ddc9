"""The old client API, ``POST /api/chat`` (SPEC §12), served by any worker.

An old client's request is translated (:mod:`relay.core.legacy.oldapi`) into a
streaming chat completion and submitted like any other request, so it is queued,
routed, cancelled and timed exactly as ``/v1/chat/completions`` is, to a modern
worker or a legacy node alike. What streams back is read as chat-completion events
and written as the old newline-delimited JSON lines: ``{"o":…}``…, then
``{"done":true}`` or ``{"err":…}``.

A request refused before it is queued (its method, API key or size, checked before
its body is read; then its body; then the key's limits, SPEC §13) gets the error's
status — 400, 401, 403, 405, 413, 429, 503 … — with its one old error line as the
body. Once queued, the answer is ``200 text/event-stream`` whatever happens, errors
included (old clients read the lines, not the status). API keys are checked and
charged as on the inference routes (``Authorization: Bearer``) when they are
required; the old client's token is never forwarded to a backend.
"""

from __future__ import annotations

import asyncio
import logging

from relay.core.legacy import oldapi
from relay.core.limits import Ticket
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, RelayRequest
from relay.server import runtime
from relay.server.http.early import old_api_head
from relay.server.http.request import ClientGone, host_allowed, read_body
from relay.server.http.send import SECURITY_HEADERS, Receive, Scope, Send
from relay.wire.errors import BadRequest, RelayError

logger = logging.getLogger("relay.oldapi")

_HEADERS = [
    (b"content-type", oldapi.CONTENT_TYPE),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Lines:
    """The response: started with the first line, flushed line group by line group."""

    def __init__(self, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.extra = extra
        self.started = False

    async def write(self, data: bytes, *, last: bool) -> None:
        if not self.started:
            self.started = True
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": _HEADERS + SECURITY_HEADERS + self.extra,
                }
            )
        if data or last:
            await self.send({"type": "http.response.body", "body": data, "more_body": not last})


class OldChatApp:
    """ASGI app for ``POST /api/chat`` (hooked into :class:`relay.server.http.RelayHttpApp`)."""

    path = oldapi.PATH

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = runtime.current()
        relay = rt.relay
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        origin = next((v for k, v in headers if k == b"origin"), None)
        cors = rt.cors.headers(origin)
        method = scope["method"]
        if method == "OPTIONS" and cors is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": cors + rt.cors.preflight(),
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        lines = _Lines(send, cors or [])
        await rt.ready()
        key_id: int | None = None
        model = ""
        ticket: Ticket | None = None
        try:
            # Refused on its headers: before the body is read, as the daphne shim
            # does before the body arrives (relay.server.http.early).
            if not host_allowed(scope):
                raise BadRequest("Invalid Host header")
            key_id = old_api_head(method, headers)
            raw = await read_body(receive, rt.config.max_request_bytes)
            old = oldapi.parse_request(raw)
            model = old.model
            if len(old.model) > rt.config.max_model_name_len:
                raise BadRequest(
                    f"'model' is longer than {rt.config.max_model_name_len} characters"
                )
            if key_id is not None:  # the key's limits (SPEC §13), as on /v1 routes
                ticket = await rt.admit(key_id, old.model)
        except ClientGone:
            return
        except RelayError as err:
            relay.record_rejection(err, model, self.path, True, key_id)
            await _refuse(send, err, cors or [])
            return
        try:
            request = relay.submit(
                model=old.model,
                endpoint_path=oldapi.ENDPOINT,
                flavor="openai",
                is_streaming=True,
                body=old.body,
                headers={"content-type": "application/json"},
                key_id=key_id,
                ticket=ticket,
                service_class=rt.service_class(key_id, None),
            )
        except BaseException as exc:
            # Until submit returns the ticket is ours: free the key's slot on every
            # way out, a bug included.
            if ticket is not None:
                ticket.close()
            if not isinstance(exc, RelayError):
                raise
            await _refuse(send, exc, cors or [])  # already counted by the core
            return
        logger.info(
            "old API request %s: model=%s conversation_id=%s user_id=%s",
            request.id,
            old.model,
            old.conversation_id,
            old.user_id,
        )
        await _relay(relay, request, receive, lines)


async def _refuse(send: Send, err: RelayError, extra: list[tuple[bytes, bytes]]) -> None:
    """Answer a request refused before it was queued: the error's status, one old line."""
    status, headers, body = oldapi.refusal(err)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + SECURITY_HEADERS + extra,
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _relay(relay: Relay, request: RelayRequest, receive: Receive, lines: _Lines) -> None:
    """Write ``request``'s text as old lines until it ends or the client leaves."""
    reader = oldapi.ChatStreamReader()
    watcher = asyncio.ensure_future(_watch_disconnect(relay, request, receive))
    stall = relay.config.stall_timeout
    try:
        while True:
            out: list[bytes] = []
            size = 0
            end: bytes | None = None
            for event in await request.next_events():
                if type(event) is bytes:
                    size += len(event)
                    out += map(oldapi.text_line, reader.feed(event))
                elif isinstance(event, Completion):
                    texts, end = _ending(event, reader)
                    out += map(oldapi.text_line, texts)
                elif isinstance(event, RelayError):
                    end = oldapi.error_line(oldapi.old_error(event))
                elif event is CANCELLED:
                    return
            if end is None and reader.failed:
                end = oldapi.error_line(oldapi.BACKEND_FAILED)
            if end is not None:
                out.append(end)
            try:
                async with asyncio.timeout(stall):
                    await lines.write(b"".join(out), last=end is not None)
            except TimeoutError:
                logger.warning(
                    "client of %s read nothing for %gs; cutting it off", request.id, stall
                )
                relay.stalled(request)
                return
            if size:
                relay.delivered(request, size)
            if end is not None:
                return
    finally:
        relay.cancel(request, "client_disconnect")  # no-op once it ended
        relay.release(request)
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass


def _ending(completion: Completion, reader: oldapi.ChatStreamReader) -> tuple[list[str], bytes]:
    """The last texts and the final line for a request's completion."""
    if not 200 <= completion.status < 300:
        return [], oldapi.error_line(oldapi.status_error(completion.status))
    content_type = next(
        (v for k, v in completion.headers.items() if k.lower() == "content-type"), ""
    )
    if "json" in content_type:  # a backend that answered in one piece
        text = oldapi.completion_text(completion.body)
        texts = [text] if text else []
    else:
        texts = reader.feed(completion.body) + reader.close()
    if reader.failed:
        return texts, oldapi.error_line(oldapi.BACKEND_FAILED)
    return texts, oldapi.done_line()


async def _watch_disconnect(relay: Relay, request: RelayRequest, receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            relay.cancel(request, "client_disconnect")
            return
