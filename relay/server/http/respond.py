"""Writing a relayed request's outcome to its client, until it ends or the client leaves.

A request's response loop waits on its :class:`~relay.core.state.RelayRequest`
mailbox while a watcher task turns ``http.disconnect`` into a cancel of that same
request object: client disconnects, timeouts and worker loss all end in one place.

A client that leaves a stream after its last event (``data: [DONE]``, ``message_stop``,
``response.completed``) has cancelled nothing: the SDKs close the connection as soon as
they read it, often before the worker's completion arrives. The response loop notes
that event going by (:class:`~relay.wire.sse.StreamEnd`, a search over each part it
writes); from then on a disconnect *detaches* the request
(:meth:`relay.core.relay.Relay.detach`) instead of cancelling it, so that it ends ``ok``
with its usage charged. The loop runs on until then (within STREAM_END_GRACE_SECS),
writing nothing that reaches anyone.

A streamed part is reported to the core as delivered once ``send`` returns, which
both servers hold back while the client's connection is full (uvicorn natively,
daphne through :mod:`modelrelay_site.daphne`): what the core counts as pending
is what the relay buffers for that client, and a ``send`` blocked for
STALL_TIMEOUT_SECS cuts the client off.
"""

from __future__ import annotations

import asyncio
import logging

from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, RelayRequest
from relay.server.http.send import (
    SECURITY_HEADERS,
    Receive,
    Send,
    send_completion,
    send_error,
)
from relay.wire.errors import RelayError
from relay.wire.sse import STREAM_HEADERS, StreamEnd, error_event

logger = logging.getLogger("relay.http")


async def respond(
    relay: Relay,
    request: RelayRequest,
    receive: Receive,
    send: Send,
    extra_headers: list[tuple[bytes, bytes]],
) -> None:
    """Write ``request``'s outcome to the client until it ends or the client leaves."""
    end = StreamEnd.of(request.flavor) if request.is_streaming else None
    watcher = asyncio.ensure_future(_watch_disconnect(relay, request, receive, end))
    try:
        if end is not None:
            await _stream(relay, request, send, extra_headers, end)
        else:
            await _unary(request, send, extra_headers)
    finally:
        # No-op when the request already ended; otherwise the edge is going away
        # (cancelled by the server, or a send failed): free the slot now.
        _left(relay, request, end)
        relay.release(request)
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass


async def _watch_disconnect(
    relay: Relay, request: RelayRequest, receive: Receive, end: StreamEnd | None
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _left(relay, request, end)
            return


def _left(relay: Relay, request: RelayRequest, end: StreamEnd | None) -> None:
    """The client is gone (or the edge gave up on it): cancel the request, unless the
    stream's last event already reached it (then only a late completion is waited for)."""
    if end is not None and end.seen:
        relay.detach(request)
    else:
        relay.cancel(request, "client_disconnect")


async def _unary(request: RelayRequest, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    while True:
        for event in await request.next_events():
            if isinstance(event, Completion):
                await send_completion(send, event, extra)
                return
            if isinstance(event, RelayError):
                await send_error(send, event, request.flavor, extra)
                return
            if event is CANCELLED:
                return


async def _stream(
    relay: Relay,
    request: RelayRequest,
    send: Send,
    extra: list[tuple[bytes, bytes]],
    end: StreamEnd,
) -> None:
    watchdog = _StallWatch(relay.config.stall_timeout)
    try:
        await _relay_stream(relay, request, send, extra, watchdog, end)
    except asyncio.CancelledError:
        if not watchdog.fired:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        logger.warning(
            "client of %s read nothing for %gs; cutting it off", request.id, watchdog.limit
        )
        relay.stalled(request)  # the cancelled send aborted the client's connection
    finally:
        watchdog.close()


class _StallWatch:
    """Cancels the streaming task when one ``send`` stays blocked for ``limit`` seconds.

    One timer per stream rather than one per chunk: a send only notes when it started
    waiting, and the timer checks that mark.
    """

    __slots__ = ("_handle", "_task", "blocked_since", "fired", "limit", "loop")

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.blocked_since: float | None = None
        self.fired = False
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._handle = self.loop.call_later(limit, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        since = self.blocked_since
        if since is not None and now - since >= self.limit:
            self.fired = True
            if self._task is not None:
                self._task.cancel()
            return
        delay = self.limit if since is None else self.limit - (now - since)
        self._handle = self.loop.call_later(delay, self._check)

    def close(self) -> None:
        self._handle.cancel()


async def _relay_stream(
    relay: Relay,
    request: RelayRequest,
    send: Send,
    extra: list[tuple[bytes, bytes]],
    watchdog: _StallWatch,
    end: StreamEnd,
) -> None:
    started = False
    loop = watchdog.loop
    while True:
        events = await request.next_events()
        chunks: list[bytes] = []
        terminal: object = None
        for event in events:
            if type(event) is bytes:
                chunks.append(event)
            else:
                terminal = event
        if chunks:
            if not started:
                started = True
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": STREAM_HEADERS + SECURITY_HEADERS + extra,
                    }
                )
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            watchdog.blocked_since = loop.time()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            watchdog.blocked_since = None
            relay.delivered(request, len(body))
            if not end.seen:  # (nothing to look for after the last event)
                end.feed(body)
        if terminal is None:
            continue
        if terminal is CANCELLED:
            return
        if isinstance(terminal, Completion):
            if not started:
                # Nothing streamed (an upstream error, or a backend that ignored
                # "stream"): the client gets the backend's answer as it was.
                await send_completion(send, terminal, extra)
            else:
                await send(
                    {"type": "http.response.body", "body": terminal.body, "more_body": False}
                )
            return
        if isinstance(terminal, RelayError):
            if not started:
                await send_error(send, terminal, request.flavor, extra)
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": error_event(terminal, request.flavor),
                        "more_body": False,
                    }
                )
            return
