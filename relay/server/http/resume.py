"""Responses that outlive their connection (SPEC §18): how a resumable request is
answered, and the routes that reattach to it.

=============================================  ============================================
``POST /v1/responses`` with ``background``     the response object at once (``queued``);
                                               with ``stream``, its events from the first
``GET /v1/responses/{id}``                     the response as it stands (the whole of it
                                               once done); ``?stream=true&starting_after=N``
                                               its events after number N, then live ones
``POST /v1/responses/{id}/cancel``             stop it; the response as it stands
streaming POST with ``X-Conversation-Id``      the stream is kept (llama.cpp's protocol,
(chat/completions, completions, messages)      ``tools/server/server-stream.cpp``)
``GET /v1/stream/{id}?from=N``                 its bytes from offset N, then live ones
                                               (also ``/v1/stream?conv_id={id}&from=N``)
``DELETE /v1/stream/{id}`` (or ``?conv_id=``)  stop it and forget it: 204 whatever it was
``POST /v1/streams/lookup``                    ``{"conversation_ids": [...]}``: those kept,
                                               ``[{conversation_id, is_done, total_bytes,
                                               started_at, completed_at}]``
=============================================  ============================================

A response belongs to the API key that created it; for any other key it does not exist
(404). Where llama.cpp answers 400 for an offset its ring buffer dropped, the relay
answers 410 (:class:`~relay.wire.errors.StreamGone`). Every client connection here is a
reader of the response's log (:mod:`relay.core.streamlog`): it leaving stops nothing.

Bounds on what a caller sends: an id (path, query or header) of at most
:data:`~relay.core.streamlog.MAX_ID_LEN` characters of printable ASCII; offsets and
sequence numbers of at most 19 digits; a lookup of at most :data:`MAX_LOOKUP_IDS` ids in
a body of at most :data:`MAX_BODY_BYTES`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec

from relay.core.background import queued_response, with_status
from relay.core.keeper import Tee
from relay.core.state import Completion, RelayRequest
from relay.core.streamlog import MAX_ID_LEN, Entry
from relay.server import runtime
from relay.server.http.request import ClientGone, Head, header, read_body
from relay.server.http.send import (
    SECURITY_HEADERS,
    Receive,
    Scope,
    Send,
    send_completion,
    send_error,
    send_json,
    send_simple,
)
from relay.wire.errors import (
    BadRequest,
    Flavor,
    MethodNotAllowed,
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
RESPONSES_PREFIX = "/v1/responses/"
STREAM_PATH = "/v1/stream"
LOOKUP_PATH = "/v1/streams/lookup"
#: The most ids one lookup may name, and the largest body any of these routes reads
#: (that many ids of the longest length, every character escaped).
MAX_LOOKUP_IDS = 64
MAX_BODY_BYTES = 128 * 1024
#: Offsets and sequence numbers: digits only, at most this many.
MAX_DIGITS = 19
JSON_HEADERS = [(b"content-type", b"application/json")]


class _Lookup(msgspec.Struct):
    conversation_ids: Any = None


_lookup_decoder = msgspec.json.Decoder(_Lookup)


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
        await _send_object(send, entry.response, extra)
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


# ----------------------------------------------------------------------------- routes


def serves(path: str) -> bool:
    return path.startswith((RESPONSES_PREFIX, STREAM_PATH + "/")) or path in (
        STREAM_PATH,
        LOOKUP_PATH,
    )


async def handle(scope: Scope, receive: Receive, send: Send) -> None:
    rt = runtime.current()
    cors = rt.cors.headers(header(scope, b"origin"))
    method: str = scope["method"]
    if method == "OPTIONS" and cors is not None:
        await send_simple(send, 204, cors + rt.cors.preflight(), b"")
        return
    await rt.ready()
    extra = cors or []
    try:
        key_id, _ = rt.authenticate(scope["headers"], "openai")
        if key_id is not None:
            rt.limiter.check_expiry(key_id, rt.key_limits(key_id))
        await _route(rt, scope, receive, send, key_id, method, extra)
    except ClientGone:
        return
    except RelayError as err:
        await send_error(send, err, "openai", extra)


async def _route(
    rt: Runtime,
    scope: Scope,
    receive: Receive,
    send: Send,
    owner: int | None,
    method: str,
    extra: list[tuple[bytes, bytes]],
) -> None:
    path: str = scope["path"]
    query = _query(scope)
    if path == LOOKUP_PATH:
        if method != "POST":
            raise MethodNotAllowed(f"Use POST for {LOOKUP_PATH}", allow="POST")
        await _lookup(rt, receive, send, owner, extra)
        return
    if path.startswith(RESPONSES_PREFIX):
        rest = path[len(RESPONSES_PREFIX) :]
        if rest.endswith("/cancel"):
            if method != "POST":
                raise MethodNotAllowed("Use POST to cancel a response", allow="POST")
            await _cancel_response(rt, send, owner, stream_id(rest[:-7], "The response id"), extra)
            return
        if method != "GET":
            raise MethodNotAllowed("Use GET for a response", allow="GET")
        response_id = stream_id(rest, "The response id")
        await _get_response(rt, receive, send, owner, response_id, query, extra)
        return
    raw = query.get("conv_id") if path == STREAM_PATH else path[len(STREAM_PATH) + 1 :]
    if raw is None:
        raise BadRequest("Missing conversation id")
    conversation = stream_id(raw, "The conversation id")
    if method == "DELETE":
        await rt.streams.cancel(owner, conversation, delete=True)
        await send_simple(send, 204, list(extra), b"")
    elif method == "GET":
        start = _count(query.get("from"), "from", default=0)
        entry = await _kept(rt, owner, conversation, "replay")
        rt.streams.counters.reattaches += 1
        await until_gone(receive, read_log(rt, send, entry, start, extra, reattach=True))
    else:
        raise MethodNotAllowed("Use GET or DELETE for a stream", allow="GET, DELETE")


async def _kept(rt: Runtime, owner: int | None, stream_id: str, kind: str) -> Entry:
    entry = await rt.streams.store.get(owner, stream_id)
    if entry is None or entry.kind != kind:
        raise StreamNotFound()
    return entry


async def _get_response(
    rt: Runtime,
    receive: Receive,
    send: Send,
    owner: int | None,
    response_id: str,
    query: dict[str, str],
    extra: list[tuple[bytes, bytes]],
) -> None:
    entry = await _kept(rt, owner, response_id, "background")
    if not _flag(query.get("stream"), "stream"):
        await _send_object(send, _as_it_stands(entry), extra)
        return
    after = _count(query.get("starting_after"), "starting_after", default=-1)
    rt.streams.counters.reattaches += 1
    await until_gone(receive, read_log(rt, send, entry, after + 1, extra, reattach=True))


async def _cancel_response(
    rt: Runtime, send: Send, owner: int | None, response_id: str, extra: list[tuple[bytes, bytes]]
) -> None:
    entry = await _kept(rt, owner, response_id, "background")
    if not entry.done:
        await rt.streams.cancel(owner, response_id)
        entry.response = with_status(_as_it_stands(entry), "cancelled")
    await _send_object(send, _as_it_stands(entry), extra)


def _as_it_stands(entry: Entry) -> bytes:
    """The response object to show: as the log has it (its records may be gone)."""
    if entry.response:
        return entry.response
    # Dropped to stay within the total bound: what is still known.
    status = entry.outcome if entry.done else "in_progress"
    return with_status(queued_response(entry.id, "", int(entry.created)), status)


async def _lookup(
    rt: Runtime, receive: Receive, send: Send, owner: int | None, extra: list[tuple[bytes, bytes]]
) -> None:
    raw = await read_body(receive, MAX_BODY_BYTES)
    try:
        asked_for = _lookup_decoder.decode(raw).conversation_ids
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise BadRequest("The body must be a JSON object with 'conversation_ids'") from None
    ids: list[str] = []
    if isinstance(asked_for, list):
        if len(asked_for) > MAX_LOOKUP_IDS:
            raise BadRequest(f"At most {MAX_LOOKUP_IDS} conversation ids per lookup")
        # As llama.cpp: what is not a non-empty string is left out.
        ids = [
            stream_id(item, "A conversation id")
            for item in asked_for
            if isinstance(item, str) and item
        ]
    found = await rt.streams.store.lookup(owner, ids) if ids else []
    await send_json(send, 200, [entry.describe() for entry in found], extra)


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


async def _send_object(send: Send, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]
    await send_simple(send, 200, headers, body)


def _query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    try:
        parsed = parse_qs(raw, max_num_fields=16)
    except ValueError:
        raise BadRequest("Too many query parameters") from None
    return {name: values[0] for name, values in parsed.items()}


def _count(value: str | None, name: str, *, default: int) -> int:
    """A non-negative integer query parameter."""
    if value is None:
        return default
    if not value.isdigit() or not value.isascii() or len(value) > MAX_DIGITS:
        raise BadRequest(f"'{name}' must be a non-negative integer of at most {MAX_DIGITS} digits")
    return int(value)


def _flag(value: str | None, name: str) -> bool:
    if value is None or value in ("false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise BadRequest(f"'{name}' must be true or false")
