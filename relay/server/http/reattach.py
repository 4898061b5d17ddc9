"""The routes that reattach to a resumable response (SPEC §18); how the request that
creates one is answered, and how every client reads a log, is
:mod:`relay.server.http.resume`.

=============================================  ============================================
``GET /v1/responses/{id}``                     the response as it stands (the whole of it
                                               once done); ``?stream=true&starting_after=N``
                                               its events after number N, then live ones
``POST /v1/responses/{id}/cancel``             stop it; the response as it stands
``GET /v1/stream/{id}?from=N``                 its bytes from offset N, then live ones
                                               (also ``/v1/stream?conv_id={id}&from=N``)
``DELETE /v1/stream/{id}`` (or ``?conv_id=``)  stop it and forget it: 204 whatever it was
``POST /v1/streams/lookup``                    ``{"conversation_ids": [...]}``: those kept,
                                               ``[{conversation_id, is_done, total_bytes,
                                               started_at, completed_at}]``
=============================================  ============================================

A response belongs to the API key that created it; for any other key it does not exist
(404). Where llama.cpp answers 400 for an offset its ring buffer dropped, the relay
answers 410 (:class:`~relay.wire.errors.StreamGone`).

Bounds on what a caller sends: an id (path or query) of at most
:data:`~relay.core.streamlog.MAX_ID_LEN` characters of printable ASCII; offsets and
sequence numbers of at most :data:`MAX_DIGITS` digits; a lookup of at most
:data:`MAX_LOOKUP_IDS` ids in a body of at most :data:`MAX_BODY_BYTES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec

from relay.core.background import queued_response, with_status
from relay.core.streamlog import Entry
from relay.server import runtime
from relay.server.http.request import ClientGone, header, read_body
from relay.server.http.resume import read_log, send_object, stream_id, until_gone
from relay.server.http.send import Receive, Scope, Send, send_error, send_json, send_simple
from relay.wire.errors import BadRequest, MethodNotAllowed, RelayError, StreamNotFound

if TYPE_CHECKING:
    from relay.server.runtime import Runtime

RESPONSES_PREFIX = "/v1/responses/"
STREAM_PATH = "/v1/stream"
LOOKUP_PATH = "/v1/streams/lookup"
#: The most ids one lookup may name, and the largest body any of these routes reads
#: (that many ids of the longest length, every character escaped).
MAX_LOOKUP_IDS = 64
MAX_BODY_BYTES = 128 * 1024
#: Offsets and sequence numbers: digits only, at most this many.
MAX_DIGITS = 19


class _Lookup(msgspec.Struct):
    conversation_ids: Any = None


_lookup_decoder = msgspec.json.Decoder(_Lookup)


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
        await send_object(send, _as_it_stands(entry), extra)
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
    await send_object(send, _as_it_stands(entry), extra)


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
