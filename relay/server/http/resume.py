"""Responses that outlive their connection (SPEC §18): how a request asks for one, how
it is answered, and how any client reads a response's log. The routes that reattach
are :mod:`relay.server.http.reattach`.

- ``POST /v1/responses`` with ``"background": true``: the response object at once
  (``status: queued``); with ``"stream": true``, its events from the first (the relay's
  ``response.queued``, number 0, carries its id);
- a streaming ``POST`` to chat/completions, completions or messages with
  ``X-Conversation-Id`` (llama.cpp's protocol, ``tools/server/server-stream.cpp``): the
  stream as the client would have had it, kept for replay.

Every client connection, the one that created the response included, is a reader of its
log (:mod:`relay.core.streamlog`): it leaving stops nothing; the runtime's
:class:`~relay.core.keeper.StreamKeeper` runs the request. An id (a conversation id in
the header) is printable ASCII of at most :data:`~relay.core.streamlog.MAX_ID_LEN`
characters.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay.core.background import queued_response
from relay.core.keeper import Tee
from relay.core.state import Completion, RelayRequest
from relay.core.streamlog import MAX_ID_LEN, Entry
from relay.server.http.request import Head, header
from relay.server.http.send import (
    SECURITY_HEADERS,
    Receive,
    Scope,
    Send,
    send_completion,
    send_error,
    send_simple,
)
from relay.wire.errors import (
    BadRequest,
    Flavor,
    RelayError,
    StreamNotFound,
    StreamsUnavailable,
    WorkerUnavailable,
)
from relay.wire.sse import STREAM_HEADERS, error_event

if TYPE_CHECKING:
    from relay.server.runtime import Runtime

logger = logging.getLogger("relay.streams")

BACKGROUND_PATH = "/v1/responses"
#: The streams llama.cpp's protocol applies to.
REPLAY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
CONVERSATION_HEADER = b"x-conversation-id"
JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(slots=True)
class Plan:
    """A request that asked for its response to be kept: the entry to open, and how
    its own client is answered (``stream``: with the events, else the object at once)."""

    entry: Entry
    stream: bool
    #: llama.cpp: a new stream of a conversation replaces its previous one.
    replace: bool


def asked(scope: Scope, path: str, head: Head, key_id: int | None, flavor: Flavor) -> Plan | None:
    """The plan of a request that asks for a resumable response, None for the others
    (the hot path: one comparison and, for the streams it applies to, one header
    lookup). Raises :class:`BadRequest` for a malformed ask."""
    if path == BACKGROUND_PATH:
        background = head.background
        if background is None or background is False:
            return None
        if background is not True:
            raise BadRequest("'background' must be a boolean")
        response_id = "resp_" + secrets.token_hex(24)
        created = time.time()
        entry = Entry(
            owner=key_id,
            id=response_id,
            kind="background",
            flavor=flavor,
            created=created,
            gen=secrets.token_hex(8),
            response=queued_response(response_id, head.model, int(created)),
        )
        return Plan(entry, head.stream, replace=False)
    if not head.stream or path not in REPLAY_PATHS:
        return None
    value = header(scope, CONVERSATION_HEADER)
    if not value:
        return None
    conversation = stream_id(value.decode("latin-1").strip(), "X-Conversation-Id")
    entry = Entry(
        owner=key_id,
        id=conversation,
        kind="replay",
        flavor=flavor,
        created=time.time(),
        gen=secrets.token_hex(8),
    )
    return Plan(entry, True, replace=True)


def stream_id(value: str, what: str) -> str:
    """``value`` as an id, or :class:`BadRequest` when it is not one."""
    if not value:
        raise BadRequest(f"{what} is empty")
    if len(value) > MAX_ID_LEN:
        raise BadRequest(f"{what} is longer than {MAX_ID_LEN} characters")
    if not value.isascii() or not value.isprintable():
        raise BadRequest(f"{what} must be printable ASCII")
    return value


async def serve(
    rt: Runtime,
    plan: Plan,
    request: RelayRequest,
    receive: Receive,
    send: Send,
    extra: list[tuple[bytes, bytes]],
) -> None:
    """Answer the request that created a resumable response: its pump runs from now
    on, owned by the runtime; this client reads the log like any other reader."""
    entry = plan.entry
    # (Before the request can reach another process: placing it takes a loop turn.)
    request.resume = entry.kind
    request.resume_key = f"{entry.gen} {_owner(entry.owner)} {entry.id}"
    rt.streams.start(request, entry)
    if entry.kind == "background" and not plan.stream:
        await send_object(send, entry.response, extra)
        return
    await until_gone(receive, read_log(rt, send, entry, 0, extra, reattach=False))


async def placed_entry(rt: Runtime, key: bytes) -> Entry:
    """Cluster mode: the log a request another process placed here is to write (its
    ``x-modelrelay-resume`` header). Raises :class:`StreamNotFound` when the log is gone
    (deleted, or replaced, meanwhile)."""
    parsed = parse_key(key.decode("latin-1"))
    if parsed is None:
        raise BadRequest("Malformed internal request")
    gen, owner, stream = parsed
    try:
        entry = await rt.streams.store.get(owner, stream)
    except StreamsUnavailable:
        # The log cannot be written from here now: the other process places it again.
        raise WorkerUnavailable(spend=False) from None
    if entry is None or entry.gen != gen:
        raise StreamNotFound()
    return entry


async def serve_placed(
    rt: Runtime, entry: Entry, request: RelayRequest, receive: Receive, send: Send
) -> None:
    """Run a resumable request another process placed here: this process writes its log
    (its worker is here) and passes the bytes back to that process while it listens.
    That process going away, or its client, stops nothing."""
    request.resume = entry.kind
    request.resume_key = f"{entry.gen} {_owner(entry.owner)} {entry.id}"
    tee = Tee(rt.config.stream_buffer_bytes)
    rt.streams.start(request, entry, tee=tee)
    try:
        await until_gone(receive, _forward(tee, send, request.flavor))
    finally:
        tee.close()


async def _forward(tee: Tee, send: Send, flavor: Flavor) -> None:
    """What the pump passes on, written as a relayed response (see
    :mod:`relay.server.http.respond`); returning early leaves the response unfinished,
    which the other process reads as a broken exchange."""
    started = False
    while True:
        chunks: list[bytes] = []
        terminal: object = None
        for item in await tee.next_events():
            if type(item) is bytes:
                chunks.append(item)
            else:
                terminal = item
        if chunks:
            if not started:
                started = True
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": STREAM_HEADERS + SECURITY_HEADERS,
                    }
                )
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            tee.taken(len(body))
        if terminal is None:
            continue
        if isinstance(terminal, Completion):
            if started:
                await send({"type": "http.response.body", "body": terminal.body})
            else:
                await send_completion(send, terminal, [])
        elif isinstance(terminal, RelayError):
            if started:
                await send({"type": "http.response.body", "body": error_event(terminal, flavor)})
            else:
                await send_error(send, terminal, flavor)
        return


# ----------------------------------------------------------------------------- readers


async def read_log(
    rt: Runtime,
    send: Send,
    entry: Entry,
    start: int,
    extra: list[tuple[bytes, bytes]],
    *,
    reattach: bool,
) -> None:
    """Send ``entry``'s log from unit ``start`` and follow it to its end.

    The response starts with the first bytes (as a relayed stream does), so a response
    that ended before any is answered as it ended: the backend's answer, or the relay's
    error, in full. A send blocked for STALL_TIMEOUT_SECS ends this reader (not the
    response)."""
    store = rt.streams.store
    counters = rt.streams.counters
    stall = rt.config.stall_timeout
    pieces = store.follow(entry.owner, entry.id, start)
    try:
        try:
            piece = await anext(pieces, None)
        except RelayError as err:
            await send_error(send, err, "openai", extra)
            return
        if piece is None:
            ended = await store.get(entry.owner, entry.id)
            if ended is not None and ended.unary is not None:
                unary = ended.unary
                answer = Completion(unary.status, unary.headers, unary.body)
                await send_completion(send, answer, extra)
                return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": STREAM_HEADERS + SECURITY_HEADERS + extra,
            }
        )
        while piece is not None:
            async with asyncio.timeout(stall):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if reattach:
                counters.replayed_bytes += len(piece)
            await asyncio.sleep(0)  # a long replay never holds the loop
            piece = await anext(pieces, None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except TimeoutError:
        logger.info("reader of %s read nothing for %gs; cutting it off", entry.id, stall)
    finally:
        await pieces.aclose()


async def until_gone(receive: Receive, work: Awaitable[None]) -> None:
    """Run ``work`` (a reader) until it ends or its client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for running in (task, watcher):
            running.cancel()
        await asyncio.wait({task, watcher})
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------------------- helpers


def _owner(owner: int | None) -> str:
    return "-" if owner is None else str(owner)


def parse_key(value: str) -> tuple[str, int | None, str] | None:
    """``(gen, owner, id)`` of a ``resume_key`` (None: malformed)."""
    gen, _, rest = value.partition(" ")
    owner, _, stream = rest.partition(" ")
    if not gen or not stream or not (owner == "-" or (owner.isdigit() and len(owner) < 19)):
        return None
    return gen, None if owner == "-" else int(owner), stream


async def send_object(send: Send, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    """A response object (background mode) as a JSON answer."""
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]
    await send_simple(send, 200, headers, body)
