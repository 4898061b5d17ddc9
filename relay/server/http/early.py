"""Refusing a request on its headers, before its body is read.

A request that will be refused anyway — a wrong method, no valid API key, not JSON, a
declared length over the limit, a path nothing serves — is answered from its method,
path and headers alone. Under daphne, :mod:`modelrelay_site.daphne_shim` asks
:func:`check` as soon as a request's headers are in (Twisted would otherwise read, and
spool to disk, the whole body first) and cuts a chunked body off at the limit the
verdict names; under uvicorn, which hands requests over before their body, the
application makes the same checks before it reads anything. Either way the answer is
the one the application gives: same status, envelope and message.

Only the internal header of cluster mode (``x-modelrelay-cluster``) carrying the
cluster token, compared in constant time, lets a request past these checks: the
process that placed it admitted it. Any other value is ignored, and the request is
checked like any client's.

A body of at most :data:`EARLY_BODY_BYTES` is read anyway (the application answers,
the connection is kept); a larger or chunked one that is refused on its headers is
never read, and its connection is closed after the answer (``Connection: close``).
Routes that read no body (``/health``, ``/metrics``, ``/v1/models``) take at most
:data:`EARLY_BODY_BYTES` of one, and Django's pages and APIs at most
``DATA_UPLOAD_MAX_MEMORY_SIZE`` (Django refuses more, but only after reading it all).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import NamedTuple

from django.conf import settings
from django.urls import Resolver404, resolve

from relay.core.legacy import oldapi
from relay.server import runtime
from relay.server.batches import api as batches
from relay.server.cluster.proxy import TOKEN_HEADER
from relay.server.http import reattach
from relay.server.http.request import before_body, host_allowed, looks_anthropic, route_table
from relay.wire import joining
from relay.wire.errors import (
    BadRequest,
    Flavor,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RelayError,
    UpgradeRequired,
    error_response,
)

TOKEN_HEADER_B = TOKEN_HEADER.encode()
#: Bodies up to this size are read before a refusal, keeping the connection; larger
#: (or chunked) ones are refused unread and the connection closed.
EARLY_BODY_BYTES = 64 * 1024
#: Worker WebSocket endpoints: over plain HTTP they answer 426.
WORKER_PATHS = ("/v1/worker/connect", "/v1/worker/legacy")
CLOSE = (b"connection", b"close")

Headers = list[tuple[bytes, bytes]]
Response = tuple[int, Headers, bytes]


class Verdict(NamedTuple):
    """What :func:`check` found: a response to refuse the request with, or the most
    body bytes it may send (a chunked body is cut off there with ``too_large``), or
    ``wait``: ask again once the runtime is ready (its API keys loaded), reading
    nothing of the body meanwhile."""

    refusal: Response | None = None
    limit: int | None = None
    too_large: Callable[[], Response] | None = None
    wait: bool = False


PASS = Verdict()


def internal(headers: Headers) -> bool:
    """The request carries this cluster's token: another process placed it here."""
    rt = runtime.current()
    if rt.placement is None:
        return False
    for name, value in headers:
        if name == TOKEN_HEADER_B:
            return hmac.compare_digest(value, rt.cluster_token.encode())
    return False


def body_left(headers: Headers) -> bool:
    """The request announces a body larger than :data:`EARLY_BODY_BYTES`, or a chunked
    one: refused unread, its connection must close (the rest of it would follow)."""
    for name, value in headers:
        if name == b"content-length":
            return not value.isdigit() or int(value) > EARLY_BODY_BYTES
        if name == b"transfer-encoding":
            return True
    return False


def unknown_path(path: str, headers: Headers, method: str) -> RelayError:
    """The error of a path no route serves."""
    if path in WORKER_PATHS:
        return UpgradeRequired()
    return NotFound(f"No route for {method[:16]} {path[:200]}")


def envelope(path: str, headers: Headers) -> Flavor:
    """The envelope a client of a path the relay does not route speaks."""
    return "anthropic" if looks_anthropic({"headers": headers}, path) else "openai"


def django_serves(path: str) -> bool:
    """Django has a page or API for ``path`` (itself, or with the slash Django adds)."""
    if path.startswith(("/static/", "/admin/")):
        # WhiteNoise, ahead of the URL patterns; the admin JSON API, whose misses
        # answer in its own JSON (relay.server.admin.errors).
        return True
    for candidate in (path, path + "/"):
        try:
            resolve(candidate)
        except Resolver404:
            continue
        return True
    return False


def too_large_for_django(headers: Headers) -> RelayError | None:
    """A declared body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` for a page or API Django
    serves: Django would refuse it, but only once it had read (and spooled) it all."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    for name, value in headers:
        if name == b"content-length" and limit is not None:
            if value.isdigit() and int(value) > limit:
                return PayloadTooLarge(f"Request body is larger than {limit} bytes")
            return None
    return None


def check(method: str, path: str, headers: Headers) -> Verdict:
    """The verdict on a request from its method, path and headers (see the module
    docstring). A request whose body is small enough to read passes: the
    application refuses it after reading its body, with the same answer."""
    if method == "OPTIONS" or not body_left(headers):
        return PASS  # a preflight, or a body read anyway: the application answers
    rt = runtime.current()
    flavor = route_table().get(path)
    if flavor is not None:
        if internal(headers):
            return _limited(rt.config.max_request_bytes, flavor)
        try:
            if not host_allowed({"headers": headers, "server": None}):
                raise BadRequest("Invalid Host header")
            before_body(rt, method, path, flavor, headers, check_key=keys_ready())
        except RelayError as refused:
            rt.relay.record_rejection(refused, "", path, False, None)
            return Verdict(refusal=error_response(refused, flavor))
        return _limited(rt.config.max_request_bytes, flavor)
    if path == oldapi.PATH:
        return _old_api(method, headers)
    if path == joining.PATH:  # a token and a name (relay/server/http/join.py)
        return _limited(joining.MAX_JOIN_BYTES, "openai")
    if batches.serves(path):
        return _batches(method, path, headers)
    if reattach.serves(path):  # (reattaching reads a small body at most: a lookup's)
        return _limited(reattach.MAX_BODY_BYTES, "openai")
    models = path == "/v1/models" or path.startswith("/v1/models/")
    if models and method not in ("GET", "HEAD"):
        anthropic = any(name == b"anthropic-version" for name, _ in headers)
        wrong = MethodNotAllowed("Use GET for /v1/models", allow="GET, HEAD")
        return Verdict(refusal=error_response(wrong, "anthropic" if anthropic else "openai"))
    if models or path in ("/health", "/metrics"):
        # They read no body: whatever one is sent is cut off early.
        return _limited(EARLY_BODY_BYTES, "openai")
    flavor = envelope(path, headers)
    if path.startswith("/v1/") or not django_serves(path):
        return Verdict(refusal=error_response(unknown_path(path, headers, method), flavor))
    err = too_large_for_django(headers)
    if err is not None:
        return Verdict(refusal=error_response(err, flavor))
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return PASS if limit is None else _limited(limit, flavor)


def keys_ready() -> bool:
    """API keys can be checked now: not required, or loaded (the application checks
    again once they are)."""
    rt = runtime.current()
    return not rt.require_keys or rt.keys.loaded


def _limited(limit: int, flavor: Flavor) -> Verdict:
    def too_large() -> Response:
        return error_response(PayloadTooLarge(f"Request body is larger than {limit} bytes"), flavor)

    return Verdict(limit=limit, too_large=too_large)


def _old_api(method: str, headers: Headers) -> Verdict:
    """``POST /api/chat``: refused on its headers as the old API answers them."""
    rt = runtime.current()
    limit = rt.config.max_request_bytes
    try:
        if not host_allowed({"headers": headers, "server": None}):
            raise BadRequest("Invalid Host header")
        old_api_head(method, headers, check_key=keys_ready())
    except RelayError as err:
        rt.relay.record_rejection(err, "", oldapi.PATH, True, None)
        return Verdict(refusal=oldapi.refusal(err))

    def too_large() -> Response:
        return oldapi.refusal(PayloadTooLarge(f"Request body is larger than {limit} bytes"))

    return Verdict(limit=limit, too_large=too_large)


def old_api_head(method: str, headers: Headers, *, check_key: bool = True) -> int | None:
    """Everything ``POST /api/chat`` is refused for before its body besides its Host:
    the method, the API key (its id returned, None when keys are off), a declared
    length over MAX_REQUEST_BYTES. Raises the error to answer."""
    rt = runtime.current()
    if method != "POST":
        raise MethodNotAllowed(f"Use POST for {oldapi.PATH}", allow="POST")
    key_id = rt.authenticate(headers, "openai")[0] if check_key else None
    limit = rt.config.max_request_bytes
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return key_id


def _batches(method: str, path: str, headers: Headers) -> Verdict:
    """Files, Batches and Message Batches, as the application checks them: the key,
    then the method, the content type and each route's own body limit. Before the API
    keys are loaded the verdict is to wait for them (never to read the body first)."""
    flavor = batches.flavor_of(path)
    if not keys_ready():
        return Verdict(wait=True)
    try:
        batches.who({"headers": headers}, flavor)  # the key first, as the application
        limit = batches.check_head(method, path, headers)
    except RelayError as refused:
        return Verdict(refusal=error_response(refused, flavor))
    return _limited(limit, flavor)
