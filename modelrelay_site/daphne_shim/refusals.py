"""Requests refused before the application: on their headers, or before their body.

Requests whose headers pass the limits (too many, too long a line, too large in all)
get a 431 in the API's JSON envelope, where Twisted would answer a bare 400 or drop
the connection without a word. And a request that will be refused anyway (wrong
method, no valid API key, not JSON, a declared length over MAX_REQUEST_BYTES) is
answered as soon as its headers are in: Twisted would otherwise read (and spool to
disk) the whole body before the application sees the request. A chunked body is cut
off at MAX_REQUEST_BYTES the same way.
"""

from __future__ import annotations

import functools
from typing import Any

from modelrelay_site.daphne_shim.probe import Patch


def _refusal(err: Any, flavor: Any) -> bytes:
    """A complete HTTP/1.1 response for a request refused before the application."""
    from relay.wire.errors import error_response

    status, headers, body = error_response(err, flavor)
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n".encode()
        + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        + b"x-content-type-options: nosniff\r\nconnection: close\r\n\r\n"
        + body
    )


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    405: "Method Not Allowed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    431: "Request Header Fields Too Large",
}


def _refuse(channel: Any, response: bytes) -> None:
    channel._relay_refused = True
    channel.transport.write(response)
    channel.loseConnection()


def apply() -> None:
    from twisted.web import http

    from relay.server.http.request import MAX_HEADER_BYTES, MAX_HEADER_COUNT
    from relay.wire.errors import HeadersTooLarge

    HTTPChannel: Any = http.HTTPChannel
    too_large = _refusal(HeadersTooLarge(), "openai")
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
        response = _refused_before_body(self)
        if response is not None:
            _refuse(self, response)
            return
        original_headers_done(self)

    def all_content_received(self: Any) -> None:
        if not getattr(self, "_relay_refused", False):
            original_content_done(self)

    def raw_data_received(self: Any, data: bytes) -> None:
        if not getattr(self, "_relay_refused", False):
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
    """The application's request checks, imported once (Django is set up by then)."""
    from relay.server import runtime
    from relay.server.http.request import before_body, host_allowed, route_table
    from relay.wire.errors import BadRequest, RelayError

    return runtime, before_body, host_allowed, route_table, BadRequest, RelayError


def _refused_before_body(channel: Any) -> bytes | None:
    """The response for an inference request that is refused on its headers alone.

    Only requests with a body to avoid (a declared length, or chunked); the same
    checks run again in the application, which answers everything else.
    """
    runtime, before_body, host_allowed, route_table, BadRequest, RelayError = _checks()
    path = channel._path.split(b"?", 1)[0].decode("latin-1")
    flavor = route_table().get(path)
    if flavor is None or channel.length == 0 or channel._command == b"OPTIONS":
        return None
    request = channel.requests[-1]
    if request.requestHeaders.hasHeader(b"x-modelrelay-cluster"):
        return None  # placed here by another process: the application checks its token
    headers = [
        (name.lower(), value)
        for name, values in request.requestHeaders.getAllRawHeaders()
        for value in values
    ]
    rt = runtime.current()
    method = channel._command.decode("latin-1")
    try:
        if not host_allowed({"headers": headers, "server": None}):
            raise BadRequest("Invalid Host header")
        before_body(rt, method, path, flavor, headers, check_key=rt.keys.loaded)
    except RelayError as err:
        rt.relay.record_rejection(err, "", path, False, None)
        return _refusal(err, flavor)
    request._relay_limit = rt.config.max_request_bytes
    request._relay_flavor = flavor
    return None


def _install_body_limit() -> None:
    from daphne.http_protocol import WebRequest

    from relay.wire.errors import PayloadTooLarge

    original = WebRequest.handleContentChunk

    def handle_content_chunk(self: Any, data: bytes) -> None:
        limit = getattr(self, "_relay_limit", None)
        if limit is not None:
            self._relay_received = getattr(self, "_relay_received", 0) + len(data)
            if self._relay_received > limit:
                err = PayloadTooLarge(f"Request body is larger than {limit} bytes")
                _refuse(self.channel, _refusal(err, self._relay_flavor))
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
