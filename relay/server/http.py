"""The client-facing hot path: a small ASGI app routed ahead of Django.

Inference routes, ``/v1/models``, ``/health`` and ``/metrics`` are served here
directly, so they pay none of Django's per-request thread hand-offs; every other
path falls through to Django (admin, JSON API, pages).

A request's response loop waits on its :class:`~relay.core.state.RelayRequest`
mailbox while a watcher task turns ``http.disconnect`` into a cancel of that same
request object: client disconnects, timeouts and worker loss all end in one place.

A streamed part is reported to the core as delivered once ``send`` returns, which
both servers hold back while the client's connection is full (uvicorn natively,
daphne through :mod:`modelrelay_site.daphne_compat`): what the core counts as pending
is what the relay buffers for that client, and a ``send`` blocked for
STALL_TIMEOUT_SECS cuts the client off.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec

from relay import __version__
from relay.core.relay import Relay
from relay.core.routes import parse_routes
from relay.core.state import CANCELLED, Completion, RelayRequest
from relay.server import runtime
from relay.server.metrics import CONTENT_TYPE
from relay.server.proxy import KEY_HEADER, LEASE_HEADER, LIFETIME_HEADER, TOKEN_HEADER
from relay.wire.errors import (
    BadRequest,
    Flavor,
    HeadersTooLarge,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    RelayError,
    UnsupportedMediaType,
    UpgradeRequired,
    error_response,
)
from relay.wire.headers import forwarded_request_headers, response_headers
from relay.wire.sse import STREAM_HEADERS, error_event

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]


@functools.cache
def route_table() -> dict[str, Flavor]:
    """The forwarded routes (relay/core/routes.py), from ``RELAY_ROUTES``."""
    from django.conf import settings

    return parse_routes(settings.RELAY_ROUTES)


TOKEN_HEADER_B = TOKEN_HEADER.encode()
LEASE_HEADER_B = LEASE_HEADER.encode()
LIFETIME_HEADER_B = LIFETIME_HEADER.encode()
KEY_HEADER_B = KEY_HEADER.encode()

#: Worker WebSocket endpoints: over plain HTTP they answer 426.
WORKER_PATHS = ("/v1/worker/connect", "/v1/worker/legacy")

#: Limits on a request's headers (daphne's Twisted parser enforces the same ones, see
#: modelrelay_site.daphne_compat): beyond either the answer is 431.
MAX_HEADER_COUNT = 100
MAX_HEADER_BYTES = 16 * 1024

#: Sent with every response of the fast path.
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [(b"x-content-type-options", b"nosniff")]
#: Statuses that never carry a body (RFC 9110 §6.4.1).
BODYLESS = frozenset({204, 304})

_JSON = msgspec.json.Encoder()

logger = logging.getLogger("relay.http")


class _Hosts:
    """``ALLOWED_HOSTS`` as Django applies it, with the verdicts remembered (bounded)."""

    def __init__(self) -> None:
        from django.conf import settings
        from django.http.request import split_domain_port, validate_host

        self._allowed = list(settings.ALLOWED_HOSTS)
        self._split = split_domain_port
        self._validate = validate_host
        self._seen: dict[bytes, bool] = {}

    def allowed(self, host: bytes) -> bool:
        verdict = self._seen.get(host)
        if verdict is None:
            domain, _ = self._split(host.decode("latin-1"))
            verdict = bool(domain) and self._validate(domain, self._allowed)
            if len(self._seen) < 1024:
                self._seen[host] = verdict
        return verdict


_hosts: _Hosts | None = None


def host_allowed(scope: Scope) -> bool:
    """The request's ``Host`` (or the server's name without one) is in ALLOWED_HOSTS."""
    global _hosts
    if _hosts is None:
        _hosts = _Hosts()
    host = _header(scope, b"host")
    if host is None:
        server = scope.get("server") or ("", None)
        host = str(server[0]).encode()
    return _hosts.allowed(host)


def reset_hosts() -> None:
    """Forget the ALLOWED_HOSTS verdicts (tests that change the setting)."""
    global _hosts
    _hosts = None


class _Head(msgspec.Struct):
    """The only two fields the relay reads from a client body."""

    model: Any = msgspec.UNSET
    stream: Any = msgspec.UNSET


_head_decoder = msgspec.json.Decoder(_Head)


class ClientGone(Exception):
    """The client disconnected before its request was fully read."""


def parse_head(body: bytes) -> tuple[str, bool]:
    """``(model, stream)`` from a raw JSON body, or :class:`BadRequest` saying what is wrong."""
    try:
        head = _head_decoder.decode(body)
    except msgspec.ValidationError:
        raise BadRequest("Request body must be a JSON object") from None
    except msgspec.DecodeError:
        raise BadRequest("Request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("Request body is nested too deeply") from None
    if head.model is msgspec.UNSET or head.model is None:
        raise BadRequest("'model' is required")
    if not isinstance(head.model, str):
        raise BadRequest("'model' must be a string")
    if not head.model.strip():
        raise BadRequest("'model' must not be empty")
    stream = head.stream
    if stream is msgspec.UNSET or stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    return head.model, stream


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def before_body(
    rt: runtime.Runtime,
    method: str,
    path: str,
    flavor: Flavor,
    headers: list[tuple[bytes, bytes]],
    *,
    check_key: bool = True,
) -> tuple[int | None, frozenset[str]]:
    """Everything an inference request is refused for before its body is read: the
    method, the API key, the content type, a declared length over the limit.

    Returns the key id and the headers that carried relay credentials. Under daphne
    :mod:`modelrelay_site.daphne_compat` calls it as soon as the headers are in, so
    a refused body is never read at all (``check_key=False`` while the keys are not
    loaded yet: the application checks again once they are).
    """
    if method != "POST":
        raise MethodNotAllowed(f"Use POST for {path}", allow="POST")
    key_id: int | None = None
    relay_auth: frozenset[str] = frozenset()
    if check_key:
        key_id, relay_auth = rt.authenticate(headers, flavor)
    content_type = declared = None
    for name, value in headers:
        if name == b"content-type":
            content_type = value
        elif name == b"content-length":
            declared = value
    if not _is_json(content_type):
        raise UnsupportedMediaType()
    limit = rt.config.max_request_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return key_id, relay_auth


def _looks_anthropic(scope: Scope, path: str) -> bool:
    return (
        path.startswith("/v1/messages")
        or _header(scope, b"anthropic-version") is not None
        or _header(scope, b"x-api-key") is not None
    )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media in (b"", b"application/json") or media.endswith(b"+json")


class RelayHttpApp:
    """ASGI app: relay routes here, everything else to ``fallback`` (Django)."""

    def __init__(self, fallback: ASGIApp, routes: dict[str, ASGIApp] | None = None) -> None:
        self.fallback = fallback
        #: More exact paths served here, each by its own ASGI app (the old client API).
        self.routes = routes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        path: str = scope["path"]
        flavor = route_table().get(path)
        headers = scope["headers"]
        if len(headers) > MAX_HEADER_COUNT or (
            sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES
        ):
            await _send_error(send, HeadersTooLarge(), flavor or "openai")
            return
        try:
            ours = flavor is not None or path in ("/health", "/metrics") or path == "/v1/models"
            internal = flavor is not None and _header(scope, TOKEN_HEADER_B) is not None
            if internal:
                assert flavor is not None
                await self._placed_here(scope, receive, send, flavor)
                return
            if (ours or path.startswith("/v1/models/")) and not host_allowed(scope):
                # As Django answers for every other path (DNS rebinding, SPEC §5).
                await _send_error(send, BadRequest("Invalid Host header"), flavor or "openai")
                return
            if flavor is not None:
                await self._inference(scope, receive, send, flavor)
            elif path == "/health":
                await self._health(scope, send)
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                await self._models(scope, send, path)
            elif path == "/metrics":
                await self._metrics(scope, send)
            elif path in self.routes:
                await self.routes[path](scope, receive, send)
            elif path.startswith("/v1/"):
                await self._unknown(scope, send, path)
            else:
                await self.fallback(scope, receive, send)
                return
        except Exception:
            # A bug, not the client's doing: log it once and answer in the envelope
            # rather than let the server write its own HTML error page.
            logger.exception("unexpected error serving %s %s", scope.get("method"), path)
            try:
                await _send_error(send, RelayError(), flavor or "openai")
            except Exception:
                pass  # the response had already started: the server ends it

    # -- inference -------------------------------------------------------------

    async def _inference(self, scope: Scope, receive: Receive, send: Send, flavor: Flavor) -> None:
        rt = runtime.current()
        cors = rt.cors.headers(_header(scope, b"origin"))
        method = scope["method"]
        if method == "OPTIONS" and cors is not None:
            await _send_simple(send, 204, cors + rt.cors.preflight(), b"")
            return
        relay = rt.relay
        path = scope["path"]
        await rt.ready()  # providers and keys loaded (instant after the first request)
        try:
            key_id, relay_auth_headers = before_body(rt, method, path, flavor, scope["headers"])
            raw = await read_body(receive, rt.config.max_request_bytes)
            try:
                body = raw.decode()
            except UnicodeDecodeError:
                raise BadRequest("Request body must be UTF-8 encoded JSON") from None
            model, stream = parse_head(raw)
            if len(model) > rt.config.max_model_name_len:
                raise BadRequest(
                    f"'model' is longer than {rt.config.max_model_name_len} characters"
                )
        except ClientGone:
            return
        except RelayError as err:
            relay.record_rejection(err, "", path, False, None)
            await _send_error(send, err, flavor, cors)
            return
        ticket = None
        if key_id is not None:
            try:  # the key's limits (SPEC §13): one Redis round trip at most
                ticket = await rt.admit(key_id, model)
            except RelayError as err:
                relay.record_rejection(err, model, path, stream, key_id)
                await _send_error(send, err, flavor, cors)
                return
        try:
            request = relay.submit(
                model=model,
                endpoint_path=path,
                flavor=flavor,
                is_streaming=stream,
                body=body,
                headers=forwarded_request_headers(scope["headers"], exclude=relay_auth_headers),
                key_id=key_id,
                ticket=ticket,
            )
        except RelayError as err:  # already counted by the core
            if ticket is not None:
                ticket.close()
            await _send_error(send, err, flavor, cors)
            return
        await respond(relay, request, receive, send, cors or [])

    async def _placed_here(
        self, scope: Scope, receive: Receive, send: Send, flavor: Flavor
    ) -> None:
        """A request another server process placed on one of our workers (cluster mode,
        see :mod:`relay.server.proxy`): authenticated by the cluster token, already
        admitted there (keys, limits, aliases), its slot reserved under a lease."""
        rt = runtime.current()
        placement = rt.placement
        token = _header(scope, TOKEN_HEADER_B) or b""
        if placement is None or not hmac.compare_digest(token, rt.cluster_token.encode()):
            await _send_simple(send, 403, [(b"content-type", b"text/plain")], b"forbidden\n")
            return
        relay = rt.relay
        path = scope["path"]
        worker_id, _, lease = (_header(scope, LEASE_HEADER_B) or b"").decode().partition(" ")
        try:
            lifetime = float(_header(scope, LIFETIME_HEADER_B) or b"0")
            key = _header(scope, KEY_HEADER_B)
            key_id = int(key) if key is not None and key.isdigit() else None
            raw = await read_body(receive, rt.config.max_request_bytes)
            model, stream = parse_head(raw)
            request = relay.submit_pinned(
                worker_id=worker_id,
                lease=lease,
                model=model,
                endpoint_path=path,
                flavor=flavor,
                is_streaming=stream,
                body=raw.decode(),
                headers=forwarded_request_headers(scope["headers"]),
                key_id=key_id,
                lifetime=min(lifetime, rt.config.request_timeout),
            )
        except ClientGone:
            placement.release(worker_id, lease)
            return
        except (RelayError, ValueError, UnicodeDecodeError) as exc:
            placement.release(worker_id, lease)
            err = exc if isinstance(exc, RelayError) else BadRequest("Malformed internal request")
            await _send_error(send, err, flavor)
            return
        placement.extend(worker_id, lease, request)
        await respond(relay, request, receive, send, [])

    # -- small JSON routes -----------------------------------------------------

    async def _unknown(self, scope: Scope, send: Send, path: str) -> None:
        """Every other ``/v1/`` path: JSON in the envelope the client speaks, never HTML."""
        flavor: Flavor = "anthropic" if _looks_anthropic(scope, path) else "openai"
        err: RelayError
        if path in WORKER_PATHS:
            err = UpgradeRequired()
        else:
            err = NotFound(f"No route for {scope['method']} {path[:200]}")
        await _send_error(send, err, flavor)

    async def _health(self, scope: Scope, send: Send) -> None:
        rt = runtime.current()
        relay = rt.relay
        draining = relay.shutting_down
        document: dict[str, Any] = {
            "status": "draining" if draining else "ok",
            "version": __version__,
            "workers_connected": len(relay.registry.workers),
            "queue_depth": relay.queue_depth(),
            "uptime_secs": round(time.time() - relay.started_wall, 3),
        }
        if rt.placement is not None:
            # Cluster mode: degraded (Redis unreachable) still serves this process's
            # workers, so it stays a 200; the state says which.
            document["cluster"] = rt.placement.describe()
        await _send_json(send, 503 if draining else 200, document)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        rt = runtime.current()
        token = rt.metrics_token
        if token:
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, b"Bearer " + token.encode()):
                await _send_simple(send, 403, [(b"content-type", b"text/plain")], b"forbidden\n")
                return
        body = rt.metrics.render()
        headers = [
            (b"content-type", CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await _send_simple(send, 200, headers, body)

    async def _models(self, scope: Scope, send: Send, path: str) -> None:
        rt = runtime.current()
        cors = rt.cors.headers(_header(scope, b"origin")) or []
        anthropic = _header(scope, b"anthropic-version") is not None
        flavor: Flavor = "anthropic" if anthropic else "openai"
        await rt.ready()
        try:
            if scope["method"] not in ("GET", "HEAD"):
                raise MethodNotAllowed("Use GET for /v1/models", allow="GET, HEAD")
            key_id, _ = rt.authenticate(scope["headers"], flavor)
            models = rt.relay.routable_models()
            if key_id is not None:
                limits = rt.key_limits(key_id)
                rt.limiter.check_expiry(key_id, limits)
                if limits.allowed_models is not None:  # a key sees only what it may use
                    models = {m: p for m, p in models.items() if m in limits.allowed_models}
            created = int(rt.relay.started_wall)

            def describe(model: str) -> dict[str, Any]:
                if anthropic:
                    return {
                        "type": "model",
                        "id": model,
                        "display_name": model,
                        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                    }
                owner = ",".join(sorted(models[model]))
                return {"id": model, "object": "model", "created": created, "owned_by": owner}

            if path not in ("/v1/models", "/v1/models/"):
                model_id = path[len("/v1/models/") :]
                if model_id not in models:
                    raise ModelNotFound(model_id)
                await _send_json(send, 200, describe(model_id), cors)
                return
            names = sorted(models)
            if anthropic:
                page, has_more = anthropic_page(names, scope.get("query_string", b""))
                data = [describe(m) for m in page]
                document: dict[str, Any] = {
                    "data": data,
                    "has_more": has_more,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None,
                }
            else:
                document = {"object": "list", "data": [describe(m) for m in names]}
        except RelayError as err:
            await _send_error(send, err, flavor, cors)
            return
        await _send_json(send, 200, document, cors)


def anthropic_page(names: list[str], query: bytes) -> tuple[list[str], bool]:
    """One page of the (sorted) model names as Anthropic's list API pages them:
    ``limit`` (1-1000, default 20), ``after_id`` or ``before_id``; and whether more
    lie beyond it in that direction."""
    params = parse_qs(query.decode("latin-1"))
    raw_limit = (params.get("limit") or ["20"])[0]
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 1000:
        raise BadRequest("limit must be an integer from 1 to 1000")
    limit = int(raw_limit)
    after = params.get("after_id", [None])[0]
    before = params.get("before_id", [None])[0]
    if before is not None:
        end = bisect.bisect_left(names, before)
        start = max(0, end - limit)
        return names[start:end], start > 0
    start = bisect.bisect_right(names, after) if after is not None else 0
    return names[start : start + limit], start + limit < len(names)


async def respond(
    relay: Relay,
    request: RelayRequest,
    receive: Receive,
    send: Send,
    extra_headers: list[tuple[bytes, bytes]],
) -> None:
    """Write ``request``'s outcome to the client until it ends or the client leaves."""
    watcher = asyncio.ensure_future(_watch_disconnect(relay, request, receive))
    try:
        if request.is_streaming:
            await _stream(relay, request, send, extra_headers)
        else:
            await _unary(request, send, extra_headers)
    finally:
        # No-op when the request already ended; otherwise the edge is going away
        # (cancelled by the server, or a send failed): free the slot now.
        relay.cancel(request, "client_disconnect")
        relay.release(request)
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass


async def _watch_disconnect(relay: Relay, request: RelayRequest, receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            relay.cancel(request, "client_disconnect")
            return


async def _unary(request: RelayRequest, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    while True:
        for event in await request.next_events():
            if isinstance(event, Completion):
                await _send_completion(send, event, extra)
                return
            if isinstance(event, RelayError):
                await _send_error(send, event, request.flavor, extra)
                return
            if event is CANCELLED:
                return


async def _stream(
    relay: Relay, request: RelayRequest, send: Send, extra: list[tuple[bytes, bytes]]
) -> None:
    watchdog = _StallWatch(relay.config.stall_timeout)
    try:
        await _relay_stream(relay, request, send, extra, watchdog)
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
        if terminal is None:
            continue
        if terminal is CANCELLED:
            return
        if isinstance(terminal, Completion):
            if not started:
                # Nothing streamed (an upstream error, or a backend that ignored
                # "stream"): the client gets the backend's answer as it was.
                await _send_completion(send, terminal, extra)
            else:
                await send(
                    {"type": "http.response.body", "body": terminal.body, "more_body": False}
                )
            return
        if isinstance(terminal, RelayError):
            if not started:
                await _send_error(send, terminal, request.flavor, extra)
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": error_event(terminal, request.flavor),
                        "more_body": False,
                    }
                )
            return


async def _send_completion(
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


async def _send_error(
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


async def _send_json(
    send: Send, status: int, document: object, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = _JSON.encode(document)
    await _send_simple(
        send,
        status,
        [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + (extra or []),
        body,
    )


async def _send_simple(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + SECURITY_HEADERS}
    )
    await send({"type": "http.response.body", "body": body})
