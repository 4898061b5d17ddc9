"""The routes of the Files, Batches and Message Batches APIs, served by the fast path.

=========================================  ===========================================
``POST /v1/files``                         upload (multipart, ``purpose=batch``)
``GET /v1/files``, ``/v1/files/{id}``      list (``purpose``, ``limit``, ``after``), get
``GET /v1/files/{id}/content``             the bytes (an output file: rendered)
``DELETE /v1/files/{id}``                  delete
``POST /v1/batches``                       create (``input_file_id``, ``endpoint``, ...)
``GET /v1/batches``, ``/v1/batches/{id}``  list (``limit``, ``after``), get
``POST /v1/batches/{id}/cancel``           cancel
``POST /v1/messages/batches``              create (``requests``)
``GET /v1/messages/batches[/{id}]``        list (``limit``, ``after_id``, ``before_id``), get
``POST /v1/messages/batches/{id}/cancel``  cancel
``GET /v1/messages/batches/{id}/results``  the results (JSONL)
``DELETE /v1/messages/batches/{id}``       delete an ended batch
=========================================  ===========================================

Who asks decides what they see (:class:`~relay.server.batches.store.Owner`): an API
key its own, the admin token (``Authorization: Bearer $MODELRELAY_ADMIN_TOKEN``)
everyone's. Errors come in the envelope of the API asked (Anthropic's on
``/v1/messages/batches``). The database work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec
from django.conf import settings

from batches.models import ANTHROPIC, OPENAI
from relay.server import runtime
from relay.server.batches import checker, files, lines, store, upload
from relay.server.batches.db import in_thread
from relay.server.batches.store import Owner
from relay.server.batches.upload import write_body
from relay.server.http.request import ClientGone, header, is_json, read_body, route_table
from relay.server.http.send import (
    SECURITY_HEADERS,
    Receive,
    Scope,
    Send,
    send_error,
    send_json,
    send_simple,
)
from relay.wire.errors import (
    BadRequest,
    Flavor,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RelayError,
    UnsupportedMediaType,
)

PREFIXES = ("/v1/files", "/v1/batches", "/v1/messages/batches")
#: The body of ``POST /v1/batches`` (a few ids and the metadata) is small.
MAX_CREATE_BYTES = 64 * 1024
#: What a route that reads no body (GET, DELETE, cancel) lets a client send anyway.
NO_BODY_BYTES = 64 * 1024
MAX_METADATA_KEYS = 16
_decode = msgspec.json.Decoder().decode


def serves(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


def flavor_of(path: str) -> Flavor:
    return "anthropic" if path.startswith("/v1/messages/") else "openai"


def who(scope: Scope, flavor: Flavor) -> Owner:
    """The owner the request speaks for; raises 401 when keys are required and it
    carries no valid one (nor the admin token)."""
    rt = runtime.current()
    admin = settings.MODELRELAY_ADMIN_TOKEN
    given = header(scope, b"authorization") or b""
    if admin and hmac.compare_digest(given, b"Bearer " + admin.encode()):
        return Owner(None, admin=True)
    key_id, _ = rt.authenticate(scope["headers"], flavor)
    if key_id is not None:
        rt.limiter.check_expiry(key_id, rt.key_limits(key_id))
    return Owner(key_id)


def body_limit(method: str, path: str) -> int:
    """The most body bytes a batch route takes (each its own: an upload its file and
    the framing, a batch's creation a few ids, a Message Batch BATCH_FILE_MAX_BYTES, a
    route that reads no body :data:`NO_BODY_BYTES`); raises the 404 or 405 of a
    request no route takes."""
    parts = path.rstrip("/").split("/")[2:]
    if method == "POST" and parts == ["files"]:
        return upload.body_limit(settings.BATCH_FILE_MAX_BYTES)
    if method == "POST" and parts == ["batches"]:
        return MAX_CREATE_BYTES
    if method == "POST" and parts == ["messages", "batches"]:
        return settings.BATCH_FILE_MAX_BYTES
    for pattern, allow in ROUTES:
        if len(pattern) == len(parts) and all(
            p in ("*", q) for p, q in zip(pattern, parts, strict=True)
        ):
            if method in allow.split(", ") or method == "OPTIONS":
                return NO_BODY_BYTES
            break
    raise _no_route(method, path.rstrip("/"), parts)


def check_head(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """Everything a batch route refuses a request for before its body besides the key:
    the method (405) or path (404), the content type (415) and a declared length over
    the route's limit (413). Returns that limit. Called by the application, and under
    daphne by the server as soon as the headers are in."""
    limit = body_limit(method, path)
    if method == "POST" and path.rstrip("/") == "/v1/files":
        upload.check_head(headers, settings.BATCH_FILE_MAX_BYTES)  # multipart, its length
    elif limit != NO_BODY_BYTES and not is_json(header({"headers": headers}, b"content-type")):
        raise UnsupportedMediaType()
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return limit


async def handle(scope: Scope, receive: Receive, send: Send) -> None:
    rt = runtime.current()
    path: str = scope["path"]
    method: str = scope["method"]
    flavor = flavor_of(path)
    cors = rt.cors.headers(header(scope, b"origin"))
    if method == "OPTIONS" and cors is not None:
        await send_simple(send, 204, cors + rt.cors.preflight(), b"")
        return
    await rt.ready()
    try:
        owner = who(scope, flavor)
        check_head(method, path, scope["headers"])
        await _route(scope, receive, send, owner, method, path.rstrip("/"), cors or [])
    except ClientGone:
        return
    except RelayError as err:
        await send_error(send, err, flavor, cors)


async def _route(
    scope: Scope,
    receive: Receive,
    send: Send,
    owner: Owner,
    method: str,
    path: str,
    cors: list[tuple[bytes, bytes]],
) -> None:
    query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
    base = _base_url(scope)
    parts = path.split("/")[2:]
    match (method, parts):
        case ("POST", ["files"]):
            document = await _upload(scope, receive, owner)
        case ("GET", ["files"]):
            limit = _limit(query, 10_000, default=10_000)
            document = await in_thread(
                files.list_files, owner, query.get("purpose"), limit, query.get("after")
            )
        case ("GET", ["files", file_id]):
            document = await in_thread(files.file_info, owner, file_id)
        case ("DELETE", ["files", file_id]):
            document = await in_thread(files.delete_file, owner, file_id)
        case ("GET", ["files", file_id, "content"]):
            await _file_content(send, owner, file_id, cors)
            return
        case ("POST", ["batches"]):
            document = await _create_openai(scope, receive, owner)
        case ("GET", ["batches"]):
            limit = _limit(query, 100)
            document = await in_thread(
                store.list_batches, owner, OPENAI, limit, query.get("after"), None, base
            )
        case ("GET", ["batches", batch_id]):
            document = await in_thread(store.batch_info, owner, OPENAI, batch_id, base)
        case ("POST", ["batches", batch_id, "cancel"]):
            document = await in_thread(store.cancel_batch, owner, OPENAI, batch_id, base)
            runtime.current().batches.poke()
        case ("POST", ["messages", "batches"]):
            document = await _create_anthropic(scope, receive, owner, base)
        case ("GET", ["messages", "batches"]):
            limit = _limit(query, 1000)
            after, before = query.get("after_id"), query.get("before_id")
            document = await in_thread(
                store.list_batches, owner, ANTHROPIC, limit, after, before, base
            )
        case ("GET", ["messages", "batches", batch_id]):
            document = await in_thread(store.batch_info, owner, ANTHROPIC, batch_id, base)
        case ("DELETE", ["messages", "batches", batch_id]):
            document = await in_thread(store.delete_batch, owner, ANTHROPIC, batch_id)
        case ("POST", ["messages", "batches", batch_id, "cancel"]):
            document = await in_thread(store.cancel_batch, owner, ANTHROPIC, batch_id, base)
            runtime.current().batches.poke()
        case ("GET", ["messages", "batches", batch_id, "results"]):
            batch = await in_thread(store.results_source, owner, batch_id)
            await _stream_lines(send, batch, "results", cors)
            return
        case _:
            raise _no_route(method, path, parts)
    await send_json(send, 200, document, cors)


#: Every route's path pattern and the methods it takes (for 405 with ``Allow``).
ROUTES: list[tuple[tuple[str, ...], str]] = [
    (("files",), "GET, POST"),
    (("files", "*"), "GET, DELETE"),
    (("files", "*", "content"), "GET"),
    (("batches",), "GET, POST"),
    (("batches", "*"), "GET"),
    (("batches", "*", "cancel"), "POST"),
    (("messages", "batches"), "GET, POST"),
    (("messages", "batches", "*"), "GET, DELETE"),
    (("messages", "batches", "*", "cancel"), "POST"),
    (("messages", "batches", "*", "results"), "GET"),
]


def _no_route(method: str, path: str, parts: list[str]) -> RelayError:
    for pattern, allow in ROUTES:
        if len(pattern) == len(parts) and all(
            p in ("*", q) for p, q in zip(pattern, parts, strict=True)
        ):
            return MethodNotAllowed(f"Use {allow} for {path[:200]}", allow=allow)
    return NotFound(f"No route for {method} {path[:200]}")


def _limit(query: dict[str, str], most: int, *, default: int = 20) -> int:
    raw = query.get("limit")
    if raw is None:
        return min(default, most)
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise BadRequest(f"limit must be an integer from 1 to {most}")
    return int(raw)


def _base_url(scope: Scope) -> str:
    """Where this server is reached (for Anthropic's ``results_url``)."""
    configured = str(settings.PUBLIC_URL).strip().rstrip("/")
    if configured:
        return configured
    scheme = scope.get("scheme", "http")
    host = (header(scope, b"host") or b"").decode("latin-1")
    if not host:
        name, port = scope.get("server") or ("127.0.0.1", 80)
        default = {"http": 80, "https": 443}.get(scheme)
        host = name if port in (None, default) else f"{name}:{port}"
    return f"{scheme}://{host}"


async def _json_body(scope: Scope, receive: Receive, limit: int) -> Any:
    if not is_json(header(scope, b"content-type")):
        raise UnsupportedMediaType()
    raw = await read_body(receive, limit)
    try:
        return _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise BadRequest("Request body is not valid JSON") from None


async def _upload(scope: Scope, receive: Receive, owner: Owner) -> dict[str, Any]:
    file_limit = settings.BATCH_FILE_MAX_BYTES
    content_type = upload.check_head(scope["headers"], file_limit)
    limits = file_limits()
    # Refused before the body when the owner keeps all it may already (under daphne
    # the server has read the body by now; the answer is the same).
    await in_thread(files.check_room, owner, limits, upload.least_file_bytes(scope["headers"]))
    body, size = await upload.spool(receive, file_limit)

    def receive_file(open_file: Callable[[str], upload.Sink]) -> str:
        return upload.parse(content_type, body, size, file_limit, open_file)

    try:
        return await in_thread(files.create_file, owner, limits, receive_file)
    finally:
        body.close()


def file_limits() -> files.FileLimits:
    return files.FileLimits(settings.BATCH_MAX_FILES_PER_KEY, settings.BATCH_MAX_FILE_BYTES_PER_KEY)


async def _create_openai(scope: Scope, receive: Receive, owner: Owner) -> dict[str, Any]:
    document = await _json_body(scope, receive, MAX_CREATE_BYTES)
    if not isinstance(document, dict):
        raise BadRequest("Request body must be a JSON object")
    input_file_id = document.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise BadRequest("input_file_id: a file id is required")
    endpoint = document.get("endpoint")
    routes = route_table()
    if not isinstance(endpoint, str) or endpoint not in routes:
        shown = ", ".join(sorted(routes))
        raise BadRequest(f"endpoint: one of {shown}")
    window = document.get("completion_window")
    if window != "24h":
        raise BadRequest("completion_window: only '24h' is supported")
    metadata = document.get("metadata")
    if metadata is not None:
        _check_metadata(metadata)
    rt = runtime.current()
    created = await in_thread(
        store.create_openai_batch,
        owner,
        input_file_id,
        endpoint,
        window,
        metadata,
        settings.BATCH_COMPLETION_WINDOW_SECS,
    )
    rt.batches.poke()
    return created


def _check_metadata(metadata: Any) -> None:
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise BadRequest(f"metadata: an object of at most {MAX_METADATA_KEYS} entries")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise BadRequest("metadata: keys of at most 64 and strings of at most 512 characters")


async def _create_anthropic(
    scope: Scope, receive: Receive, owner: Owner, base: str
) -> dict[str, Any]:
    """A Message Batch: its body goes to a scratch file as it arrives, is checked in
    the checking process, and its requests are stored from what that wrote."""
    rt = runtime.current()
    limit = settings.BATCH_FILE_MAX_BYTES
    if not is_json(header(scope, b"content-type")):
        raise UnsupportedMediaType()
    rules = lines.Limits(
        max_lines=rt.batches.config.max_lines,
        max_request_bytes=rt.config.max_request_bytes,
        max_model_len=rt.config.max_model_name_len,
        known=frozenset(rt.relay.routable_models()),
    )
    config = rt.batches.config

    def create(source: str, out: str) -> dict[str, Any]:
        checked = rt.batches.checker.run(lines.check_anthropic, source, out, rules)
        if checked.refusal is not None:
            kind, message = checked.refusal
            raise PayloadTooLarge(message) if kind == "too_large" else BadRequest(message)
        specs = lines.records(out)
        return store.create_anthropic_batch(
            owner, checked.count, specs, config.window, config.max_queued, base
        )

    source, out = checker.scratch_paths()
    try:
        # A local scratch file: each write copies one received piece to the page cache.
        with open(source, "wb") as body:  # noqa: ASYNC230
            await write_body(receive, body, limit, f"Request body is larger than {limit} bytes")
        created = await in_thread(create, source, out)
    finally:
        await asyncio.to_thread(checker.remove, source, out)
    rt.batches.poke()
    return created


async def _file_content(
    send: Send, owner: Owner, file_id: str, cors: list[tuple[bytes, bytes]]
) -> None:
    source = await in_thread(files.file_source, owner, file_id)
    if source.batch_id is not None:
        await _stream_lines(send, source.batch_id, source.kind, cors)
        return
    # An upload, chunk by chunk as it is read from the store (never held whole).
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(source.size).encode()),
    ]
    headers += SECURITY_HEADERS + cors
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    after = -1
    while True:
        chunks = await in_thread(files.file_chunks, source.file_pk, after)
        if not chunks:
            break
        after = chunks[-1][0]
        for _, data in chunks:
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _stream_lines(
    send: Send, batch_id: int, kind: str, cors: list[tuple[bytes, bytes]]
) -> None:
    """A batch's output rendered page by page as it is sent (never held whole)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/jsonl"), *SECURITY_HEADERS, *cors],
        }
    )
    after = -1
    while True:
        page = await in_thread(store.result_page, batch_id, kind, after)
        if not page:
            break
        after = page[-1][0]
        await send(
            {"type": "http.response.body", "body": b"".join(b for _, b in page), "more_body": True}
        )
    await send({"type": "http.response.body", "body": b"", "more_body": False})
