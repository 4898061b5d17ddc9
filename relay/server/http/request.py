"""Reading a client request on the fast path, and refusing it as early as possible.

:func:`before_body` holds every check that can be made from the method and headers
alone; under daphne it runs as soon as the headers are in (see
:mod:`modelrelay_site.daphne`), so a request that would be refused anyway is never
read. :func:`read_body` reads within the size limit; :func:`read_head` reads the few
fields the relay needs from the body, in one typed pass.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from relay.core.limits import Cost
from relay.core.routes import parse_routes
from relay.server.http.send import Receive, Scope
from relay.wire.errors import (
    BadRequest,
    Flavor,
    MethodNotAllowed,
    PayloadTooLarge,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from relay.server.runtime import Runtime


@functools.cache
def route_table() -> dict[str, Flavor]:
    """The forwarded routes (relay/core/routes.py), from ``RELAY_ROUTES``."""
    from django.conf import settings

    return parse_routes(settings.RELAY_ROUTES)


#: Limits on a request's headers (daphne's Twisted parser enforces the same ones, see
#: modelrelay_site.daphne_shim): beyond either the answer is 431.
MAX_HEADER_COUNT = 100
MAX_HEADER_BYTES = 16 * 1024


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
    host = header(scope, b"host")
    if host is None:
        server = scope.get("server") or ("", None)
        host = str(server[0]).encode()
    return _hosts.allowed(host)


def reset_hosts() -> None:
    """Forget the ALLOWED_HOSTS verdicts (tests that change the setting)."""
    global _hosts
    _hosts = None


class _Head(Cost):
    """The only fields the relay reads from a client body (with what cache-aware
    routing reads, :class:`relay.core.affinity.Prompt`, and what the key's budgets
    reserve, in the same pass)."""

    model: Any = msgspec.UNSET
    stream: Any = msgspec.UNSET
    service_tier: Any = None
    #: Responses background mode (SPEC §18); read only on ``/v1/responses``.
    background: Any = None


_head_decoder = msgspec.json.Decoder(_Head)


class Head(NamedTuple):
    model: str
    stream: bool
    #: As sent (None: absent); :func:`relay.core.classes.asked` reads it.
    service_tier: object
    #: What cache-aware routing reads (SPEC §14), and what the key's budgets reserve
    #: (``prompt.reservation()``, worked out only for a key with a budget).
    prompt: Cost
    #: ``background`` as sent (None: absent); :mod:`relay.server.http.resume` reads it.
    background: object = None


class ClientGone(Exception):
    """The client disconnected before its request was fully read."""


def parse_head(body: bytes) -> tuple[str, bool]:
    """``(model, stream)`` from a raw JSON body, or :class:`BadRequest` saying what is wrong."""
    head = read_head(body)
    return head.model, head.stream


def read_head(body: bytes) -> Head:
    """What the relay reads of a raw JSON body, or :class:`BadRequest` saying what is wrong."""
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
    return Head(head.model, stream, head.service_tier, head, head.background)


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
    rt: Runtime,
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
    :mod:`modelrelay_site.daphne_shim` calls it as soon as the headers are in, so
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
    if not is_json(content_type):
        raise UnsupportedMediaType()
    limit = rt.config.max_request_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return key_id, relay_auth


def looks_anthropic(scope: Scope, path: str) -> bool:
    return (
        path.startswith("/v1/messages")
        or header(scope, b"anthropic-version") is not None
        or header(scope, b"x-api-key") is not None
    )


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media in (b"", b"application/json") or media.endswith(b"+json")
