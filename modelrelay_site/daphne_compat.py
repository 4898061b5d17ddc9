"""Let daphne close worker sockets with the code and reason the application gives.

daphne (4.2.x) drops the ``reason`` of an ASGI ``websocket.close`` message and
hands the code to autobahn's ``sendClose``, which only allows 1000 and 3000-4999.
The protocol needs the standard codes too (1002 protocol error, 1008 policy,
1012 restart), each with a reason a worker can log. This wraps daphne's reply
handler so an application close goes out as exactly that close frame.

It also turns off autobahn's ``failByDrop``: a frame over MAX_MESSAGE_BYTES or
invalid UTF-8 then gets a proper close frame (1009/1007 with a reason) instead of
a dropped TCP connection the worker cannot explain.

And it stops two pieces of per-request Twisted work that daphne never uses: parsing
every POST body as a possible HTML form (the ``email`` package's header parser on each
Content-Type) — daphne hands the raw body to the application — and formatting an
access-log line for Twisted's legacy log, which daphne discards (it logs requests
itself).

Finally it gives streamed HTTP responses backpressure, as uvicorn has: daphne hands
every ``http.response.body`` to Twisted at once, so a client that reads slower than
the relay writes would make Twisted's transport buffer grow without bound. Here a
``send`` of a body part returns only once the transport's buffer is back under its
limit (Twisted's producer protocol tells when), and a ``send`` the application
cancels while it waits (it gave up on that client) aborts the connection.
Requests whose headers pass the limits (too many, too long a line, too large in
all) get a 431 in the API's JSON envelope, where Twisted would answer a bare 400 or
drop the connection without a word.
Installed only when daphne is the server in this process.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


def install() -> None:
    if "daphne.server" not in sys.modules:
        return
    from daphne.http_protocol import HTTPFactory, WebRequest

    HTTPFactory.log = lambda self, request: None
    from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol

    original_init = WebRequest.__init__

    def request_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = request_init
    _install_backpressure()
    _install_header_limits()

    if getattr(WebSocketProtocol, "_relay_close_frames", False):
        return
    original = WebSocketProtocol.handle_reply
    original_options = WebSocketFactory.setProtocolOptions

    def set_protocol_options(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("failByDrop", False)
        original_options(self, *args, **kwargs)

    def handle_reply(self: Any, message: dict[str, Any]) -> None:
        if message.get("type") == "websocket.close" and self.state != self.STATE_CONNECTING:
            reason = message.get("reason") or ""
            self.sendCloseFrame(
                code=message.get("code") or 1000,
                reasonUtf8=reason.encode()[:123] or None,
                isReply=False,
            )
            return
        original(self, message)

    WebSocketProtocol.handle_reply = handle_reply
    WebSocketFactory.setProtocolOptions = set_protocol_options
    WebSocketProtocol._relay_close_frames = True


class _Waker:
    """A Twisted push producer that only wakes an asyncio future when the transport drains."""

    def __init__(self, wake: Any) -> None:
        self.resumeProducing = wake
        self.stopProducing = wake

    def pauseProducing(self) -> None:
        pass


async def _wait_for_client(request: Any) -> None:
    """Return once ``request``'s transport buffer is under its limit (or the client left).

    Cancelled while waiting: the application gave up on a client that reads nothing,
    so its connection is aborted rather than left holding what it would not read.
    """
    channel = request.channel
    if channel is None or not channel._waitingForTransport or request.finished:
        return
    done = asyncio.get_running_loop().create_future()

    def wake(*_: Any) -> None:
        if not done.done():
            done.set_result(None)

    producer = _Waker(wake)
    channel.registerProducer(producer, True)
    request.notifyFinish().addBoth(wake)  # connection lost
    try:
        await done
    except asyncio.CancelledError:
        transport = channel.transport
        if transport is not None:
            transport.abortConnection()
        raise
    finally:
        if channel._requestProducer is producer:
            channel.unregisterProducer()


def _install_backpressure() -> None:
    from daphne.http_protocol import WebRequest
    from daphne.server import Server

    if getattr(Server, "_relay_backpressure", False):
        return
    original = Server.handle_reply

    async def handle_reply(self: Any, protocol: Any, message: dict[str, Any]) -> None:
        await original(self, protocol, message)
        if (
            message.get("more_body")
            and message.get("type") == "http.response.body"
            and isinstance(protocol, WebRequest)
        ):
            await _wait_for_client(protocol)

    Server.handle_reply = handle_reply
    Server._relay_backpressure = True


def _install_header_limits() -> None:
    from twisted.web import http

    from relay.server.http import MAX_HEADER_BYTES, MAX_HEADER_COUNT
    from relay.wire.errors import HeadersTooLarge, error_response

    HTTPChannel: Any = http.HTTPChannel
    if getattr(HTTPChannel, "_relay_header_limits", False):
        return
    status, headers, body = error_response(HeadersTooLarge(), "openai")
    response = (
        f"HTTP/1.1 {status} Request Header Fields Too Large\r\n".encode()
        + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        + b"connection: close\r\n\r\n"
        + body
    )

    def refuse(channel: Any) -> None:
        channel.transport.write(response)
        channel.loseConnection()

    original_line = HTTPChannel.lineReceived
    original_header = HTTPChannel.headerReceived

    def line_received(self: Any, line: bytes) -> None:
        if self._receivedHeaderSize + len(line) > MAX_HEADER_BYTES:
            refuse(self)
            return
        original_line(self, line)

    def header_received(self: Any, line: bytes) -> bool:
        if self._receivedHeaderCount >= MAX_HEADER_COUNT:
            refuse(self)
            return False
        return bool(original_header(self, line))

    HTTPChannel.lineReceived = line_received
    HTTPChannel.headerReceived = header_received
    HTTPChannel.lineLengthExceeded = lambda self, line: refuse(self)
    HTTPChannel.totalHeadersSize = MAX_HEADER_BYTES
    HTTPChannel.MAX_LENGTH = MAX_HEADER_BYTES
    HTTPChannel._relay_header_limits = True
