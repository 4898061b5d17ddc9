"""Requests refused before the application: on their headers, or before their body.

Requests whose headers pass the limits (too many, too long a line, too large in all)
get a 431 in the API's JSON envelope, where Twisted would answer a bare 400 or drop
the connection without a word. And a request that will be refused anyway (wrong
method, no valid API key, not JSON, a declared length over MAX_REQUEST_BYTES, a path
nothing serves; see :mod:`relay.server.http.early`) is answered as soon as its
headers are in: Twisted would otherwise read (and spool to disk) the whole body
before the application sees the request. A chunked body is cut off at the limit the
application names the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def _refusal(response: tuple[int, list[tuple[bytes, bytes]], bytes]) -> bytes:
    """A complete HTTP/1.1 response for a request refused before the application:
    its headers named as Twisted names those of every other response, and the
    connection closed (the body it announced is never read)."""
    from twisted.web.http_headers import Headers

    status, headers, body = response
    named = Headers()
    for name, value in [
        *headers,
        (b"x-content-type-options", b"nosniff"),
        (b"connection", b"close"),
    ]:
        named.addRawHeader(name, value)
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n".encode()
        + b"".join(
            k + b": " + v + b"\r\n" for k, values in named.getAllRawHeaders() for v in values
        )
        + b"\r\n"
        + body
    )


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    426: "Upgrade Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _refuse(channel: Any, response: bytes) -> None:
    channel._relay_refused = True
    channel.transport.write(response)
    channel.loseConnection()


def apply() -> None:
    from twisted.web import http

    from relay.server.http.request import MAX_HEADER_BYTES, MAX_HEADER_COUNT
    from relay.wire.errors import HeadersTooLarge, error_response

    HTTPChannel: Any = http.HTTPChannel
    too_large = _refusal(error_response(HeadersTooLarge(), "openai"))
    original_line = HTTPChannel.lineReceived
    original_header = HTTPChannel.headerReceived
    original_headers_done = HTTPChannel.allHeadersReceived
    original_content_done = HTTPChannel.allContentReceived
    original_raw = HTTPChannel.rawDataReceived

    def line_received(self: Any, line: bytes) -> None:
        if self._receivedHeaderSize + len(line) > MAX_HEADER_BYTES:
            _refuse(self, too_large)
            return
        original_line(self, line)

    def header_received(self: Any, line: bytes) -> bool:
        if self._receivedHeaderCount >= MAX_HEADER_COUNT:
            _refuse(self, too_large)
            return False
        return bool(original_header(self, line))

    def all_headers_received(self: Any) -> None:
        self._relay_refused = False
        response = early_refusal(self, batches=False)
        if response is not None:
            _refuse(self, response)
            return
        original_headers_done(self)

    def all_content_received(self: Any) -> None:
        if not getattr(self, "_relay_refused", False):
            original_content_done(self)

    def raw_data_received(self: Any, data: bytes) -> None:
        held = getattr(self, "_relay_held", None)
        if held is not None:  # waiting for the verdict: what already came is kept
            held.append(data)
        elif not getattr(self, "_relay_refused", False):
            original_raw(self, data)

    HTTPChannel.lineReceived = line_received
    HTTPChannel.headerReceived = header_received
    HTTPChannel.allHeadersReceived = all_headers_received
    HTTPChannel.allContentReceived = all_content_received
    HTTPChannel.rawDataReceived = raw_data_received
    HTTPChannel.lineLengthExceeded = lambda self, line: _refuse(self, too_large)
    HTTPChannel.totalHeadersSize = MAX_HEADER_BYTES
    HTTPChannel.MAX_LENGTH = MAX_HEADER_BYTES
    _install_body_limit()


@functools.cache
def _checks() -> tuple[Any, ...]:
    """The application's checks, imported once (Django is set up by then)."""
    from relay.server.batches import api as batches
    from relay.server.http.app import refused_before_body

    return refused_before_body, batches.serves


#: :func:`early_refusal`'s answer when the verdict must wait for the API keys.
WAIT = b"wait"


def early_refusal(channel: Any, *, batches: bool) -> bytes | None:
    """The response for a request refused on its headers alone, or None (then the
    body limit the application named is set on the request), or :data:`WAIT`.

    Only requests with a body to avoid: a declared length over the application's
    :data:`~relay.server.http.early.EARLY_BODY_BYTES`, or a chunked one. A smaller
    body is read and the application answers (the same checks run there), keeping
    the connection. ``batches``: the batch routes (:mod:`.uploads`), else the others.
    """
    refused_before_body, batch_path = _checks()
    length = channel.length
    if length == 0:
        return None
    path = channel._path.split(b"?", 1)[0].decode("latin-1")
    if batch_path(path) != batches:
        return None
    request = channel.requests[-1]
    headers = [
        (name.lower(), value)
        for name, values in request.requestHeaders.getAllRawHeaders()
        for value in values
    ]
    verdict = refused_before_body(channel._command.decode("latin-1"), path, headers)
    if verdict.wait:
        return WAIT
    if verdict.refusal is not None:
        return _refusal(verdict.refusal)
    if verdict.limit is not None:
        request._relay_limit = verdict.limit
        request._relay_too_large = verdict.too_large
    return None


def wait_for_keys(channel: Any, again: Callable[[], None]) -> None:
    """The verdict needs the API keys, not loaded yet (the first moments after a
    start): read nothing more of the connection, keep what already came, and ask
    ``again`` once the runtime is ready, then hand the kept bytes on."""
    import asyncio

    from relay.server import runtime

    channel._relay_held = []
    channel.transport.pauseProducing()

    def resume(_: object) -> None:
        held, channel._relay_held = channel._relay_held, None
        transport = channel.transport
        if transport is None or getattr(transport, "disconnected", False):
            return  # the client left meanwhile
        again()
        if not getattr(channel, "_relay_refused", False):
            transport.resumeProducing()
            if held:
                channel.rawDataReceived(b"".join(held))

    asyncio.ensure_future(runtime.current().ready()).add_done_callback(resume)


def not_ready() -> bytes:
    """The answer when the keys are still not loaded after the runtime's wait."""
    from relay.wire.errors import ServiceUnavailable, error_response

    return _refusal(error_response(ServiceUnavailable("API keys are not loaded yet"), "openai"))


def _install_body_limit() -> None:
    from daphne.http_protocol import WebRequest

    original = WebRequest.handleContentChunk

    def handle_content_chunk(self: Any, data: bytes) -> None:
        limit = getattr(self, "_relay_limit", None)
        if limit is not None:
            self._relay_received = getattr(self, "_relay_received", 0) + len(data)
            if self._relay_received > limit:
                _refuse(self.channel, _refusal(self._relay_too_large()))
                return
        original(self, data)

    WebRequest.handleContentChunk = handle_content_chunk


PATCH = Patch(
    "early refusals",
    ("daphne", "twisted"),
    (
        "twisted.web.http:HTTPChannel.lineReceived",
        "twisted.web.http:HTTPChannel.headerReceived",
        "twisted.web.http:HTTPChannel.allHeadersReceived",
        "twisted.web.http:HTTPChannel.allContentReceived",
        "twisted.web.http:HTTPChannel.rawDataReceived",
        "twisted.web.http:HTTPChannel.lineLengthExceeded",
        "twisted.web.http:HTTPChannel.totalHeadersSize",
        "twisted.web.http:HTTPChannel.MAX_LENGTH",
        "twisted.web.http:HTTPChannel._receivedHeaderSize",
        "twisted.web.http:HTTPChannel._receivedHeaderCount",
        "twisted.web.http:HTTPChannel._path",
        "twisted.web.http:HTTPChannel._command",
        "twisted.web.http:HTTPChannel.length",
        "twisted.web.http:HTTPChannel.requests",
        "twisted.web.http:HTTPChannel.loseConnection",
        "daphne.http_protocol:WebRequest.handleContentChunk",
    ),
    apply,
)
