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
drop the connection without a word. And an inference request that will be refused
anyway (wrong method, no valid API key, not JSON, a declared length over
MAX_REQUEST_BYTES) is answered as soon as its headers are in: Twisted would
otherwise read (and spool to disk) the whole body before the application sees the
request. A chunked body is cut off at MAX_REQUEST_BYTES the same way.
Two changes make Twisted's socket I/O cost what asyncio's does. A write to a TCP
connection with nothing buffered goes to the socket at once, as asyncio's transports
do; Twisted would buffer it, register the socket for writability, send on the next
loop iteration and unregister it again: two ``epoll_ctl`` calls and a loop turn for
every streamed chunk. Whatever the socket does not take is buffered the usual way
(and a broken connection is left for Twisted's own write path to report). And
readiness callbacks call the reactor directly, without Twisted's legacy log context
around each one (a dictionary copy and a context push per event), which nothing
here reads; a failure is still logged. A finished HTTP request's entry in daphne's
connection table goes at once instead of at the next once-a-second sweep.

Installed only when daphne is the server in this process.
"""

from __future__ import annotations

import asyncio
import errno
import functools
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
    _install_prompt_reaping()
    _install_backpressure()
    _install_header_limits()
    _install_direct_io()

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
    _install_lean_frames(WebSocketProtocol)


def _install_prompt_reaping() -> None:
    """Forget a finished request's connection entry at once, not on the next sweep.

    daphne keeps an entry per HTTP request (keep-alive requests included) in
    ``Server.connections`` until ``application_checker``, once a second, sees both
    its application finished and its protocol gone. Under load that is thousands of
    finished requests (their Twisted request objects, headers and application
    futures) kept alive and walked every second. Here an entry whose application
    ended cleanly is dropped the moment the second of the two happens; the
    sweep still handles everything else as before (applications that raised, were
    cancelled, or outlive their client).
    """
    from daphne.server import Server

    if getattr(Server, "_relay_prompt_reaping", False):
        return
    original_create = Server.create_application
    original_disconnected = Server.protocol_disconnected

    def reap(server: Any, protocol: Any) -> None:
        details = server.connections.get(protocol)
        if details is None or "disconnected" not in details:
            return
        instance = details.get("application_instance")
        if instance is None or not instance.done() or instance.cancelled():
            return
        if instance.exception() is None:
            del server.connections[protocol]

    def create_application(self: Any, protocol: Any, scope: Any) -> Any:
        queue = original_create(self, protocol, scope)
        if queue is not None:  # None: the client left before the application started
            instance = self.connections[protocol]["application_instance"]
            instance.add_done_callback(lambda _: reap(self, protocol))
        return queue

    def protocol_disconnected(self: Any, protocol: Any) -> None:
        if protocol in self.connections:  # a second call for a reaped entry is a no-op
            original_disconnected(self, protocol)
            reap(self, protocol)

    Server.create_application = create_application
    Server.protocol_disconnected = protocol_disconnected
    Server._relay_prompt_reaping = True


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
        if message.get("type") != "http.response.body" or not isinstance(protocol, WebRequest):
            await original(self, protocol, message)
            return
        # daphne's own checks for a body part (the header checks are for the start).
        connection = self.connections.get(protocol)
        if connection is None or connection.get("disconnected"):
            return
        if not message.get("more_body"):
            protocol.handle_reply(message)
            return
        if (
            protocol.startedWriting
            and protocol.chunked
            and not protocol.finished
            and protocol.channel is not None
            and "write" not in protocol.__dict__  # HEAD or a status without a body
        ):
            # A part in the middle of a chunked stream, headers long sent: what
            # Twisted's Request.write would send, without its bookkeeping per part.
            body = message.get("body", b"")
            if body:
                protocol.sentLength += len(body)
                protocol.channel.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            protocol.handle_reply(message)
        await _wait_for_client(protocol)

    Server.handle_reply = handle_reply
    Server._relay_backpressure = True


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


def _install_header_limits() -> None:
    from twisted.web import http

    from relay.server.http import MAX_HEADER_BYTES, MAX_HEADER_COUNT
    from relay.wire.errors import HeadersTooLarge

    HTTPChannel: Any = http.HTTPChannel
    if getattr(HTTPChannel, "_relay_header_limits", False):
        return
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
    HTTPChannel._relay_header_limits = True
    _install_body_limit()


@functools.cache
def _checks() -> tuple[Any, ...]:
    """The application's request checks, imported once (Django is set up by then)."""
    from relay.server import runtime
    from relay.server.http import before_body, host_allowed, route_table
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


def _install_direct_io() -> None:
    from twisted.internet import abstract, asyncioreactor, tcp

    descriptor: Any = abstract.FileDescriptor
    if getattr(descriptor, "_relay_direct_io", False):
        return
    buffered_write = descriptor.write
    buffered_sequence = descriptor.writeSequence
    connection: Any = tcp.Connection

    def flush(self: Any) -> None:
        """End of the loop turn in which ``self`` was first written to: send."""
        self._relay_flush_due = False
        if not self.connected or self.reactor._writers.get(self) is not None:
            return  # gone, or its buffer went the usual way meanwhile
        parts = self._tempDataBuffer
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._tempDataBuffer = []
        self._tempDataLen = 0
        sent = self.writeSomeData(data)
        if type(sent) is not int:  # the connection is lost
            self.dataBuffer, self.offset = data, 0
            self.reactor._disconnectSelectable(self, sent, False)
        elif sent < len(data):  # the socket took part of it: the rest when writable
            self.dataBuffer, self.offset = data, sent
            self.startWriting()
        elif self.producer is not None and (not self.streamingProducer or self.producerPaused):
            self.producerPaused = False  # as doWrite does once the buffer is empty
            self.producer.resumeProducing()

    def fast_write(self: Any, data: bytes) -> bool:
        """Queue ``data`` to be sent at the end of this loop turn, without waiting for
        writability; False when the usual path must take it (not a TCP connection,
        closing, or data still waiting for the socket to drain)."""
        if (
            not isinstance(self, connection)
            or not self.connected
            or self.disconnecting
            or self._writeDisconnected
            or self._writeDisconnecting
        ):
            return False
        if not self._relay_flush_due:
            if self._tempDataLen or self.offset < len(self.dataBuffer):
                return False  # already waiting for the socket to drain
            self._relay_flush_due = True
            self.reactor._asyncioEventloop.call_soon(flush, self)
        self._tempDataBuffer.append(data)
        self._tempDataLen += len(data)
        self._maybePauseProducer()
        return True

    def write(self: Any, data: bytes) -> None:
        if not (type(data) is bytes and data and fast_write(self, data)):
            buffered_write(self, data)

    def write_sequence(self: Any, iovec: Any) -> None:
        try:
            data = b"".join(iovec)
        except TypeError:  # not all bytes: Twisted's own path says what is wrong
            buffered_sequence(self, iovec)
            return
        write(self, data)

    descriptor._relay_flush_due = False
    descriptor.write = write
    descriptor.writeSequence = write_sequence
    descriptor._relay_direct_io = True

    reactor_class: Any = asyncioreactor.AsyncioSelectorReactor

    def on_ready(self: Any, selectable: Any, read: bool) -> None:
        try:
            self._readOrWrite(selectable, read)
        except Exception:
            self._log.failure("I/O callback of {selectable!r} failed", selectable=selectable)

    def add_reader(self: Any, reader: Any) -> None:
        if reader in self._readers or reader in self._continuousPolling._readers:
            return
        fd = reader.fileno()
        try:
            self._asyncioEventloop.add_reader(fd, on_ready, self, reader, True)
            self._readers[reader] = fd
        except OSError as exc:
            self._unregisterFDInAsyncio(fd)
            if exc.errno != errno.EPERM:
                raise
            self._continuousPolling.addReader(reader)  # epoll refuses regular files

    def add_writer(self: Any, writer: Any) -> None:
        if writer in self._writers or writer in self._continuousPolling._writers:
            return
        fd = writer.fileno()
        try:
            self._asyncioEventloop.add_writer(fd, on_ready, self, writer, False)
            self._writers[writer] = fd
        except PermissionError:
            self._unregisterFDInAsyncio(fd)
            self._continuousPolling.addWriter(writer)
        except BrokenPipeError:
            self._unregisterFDInAsyncio(fd)
        except BaseException:
            self._unregisterFDInAsyncio(fd)
            raise

    reactor_class.addReader = add_reader
    reactor_class.addWriter = add_writer


#: Frames up to this size are unmasked in Python: faster than setting up autobahn's
#: native masker, which pays off only for larger payloads.
SMALL_FRAME = 1024


class _SmallMasker:
    """Unmasks a small frame's payload (RFC 6455 §5.3), possibly in several pieces."""

    __slots__ = ("_mask", "_ptr")

    def __init__(self, mask: bytes) -> None:
        self._mask = mask
        self._ptr = 0

    def pointer(self) -> int:
        return self._ptr

    def reset(self) -> None:
        self._ptr = 0

    def process(self, data: bytes) -> bytes:
        size = len(data)
        if not size:
            return b""
        shift = self._ptr & 3
        mask = self._mask[shift:] + self._mask[:shift]
        key = (mask * ((size >> 2) + 1))[:size]
        self._ptr += size
        return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(
            size, "little"
        )


def _install_lean_frames(protocol_class: Any) -> None:
    """Per incoming frame, autobahn sets up a native masker and, per message, fires
    its ``message`` event through a chain of Deferreds that nobody listens to here.
    Small frames get :class:`_SmallMasker`; messages without listeners skip the event."""
    from autobahn.websocket import protocol as autobahn_protocol

    native = autobahn_protocol.create_xor_masker

    def create_xor_masker(mask: bytes, length: int | None = None) -> Any:
        if length is not None and length <= SMALL_FRAME:
            return _SmallMasker(bytes(mask))
        return native(mask, length)

    autobahn_protocol.create_xor_masker = create_xor_masker
    original_end = protocol_class.onMessageEnd

    def on_message_end(self: Any) -> None:
        if self.trackedTimings or getattr(self, "_listeners", None) or self._parent is not None:
            original_end(self)
            return
        if not self.failedByMe:
            self._onMessage(b"".join(self.message_data), self.message_is_binary)
        self.message_data = None

    protocol_class.onMessageEnd = on_message_end

    def data_received(self: Any, data: bytes) -> None:
        # autobahn's own formats the arguments of a debug line first (class names,
        # terminal colours) on every read, whether or not anything logs it.
        self._dataReceived(data)

    protocol_class.dataReceived = data_received
    original_send = protocol_class.sendData

    def send_data(self: Any, data: bytes, sync: bool = False, chopsize: int | None = None) -> None:
        # Likewise for every frame sent, when nothing is queued or chopped.
        if sync or chopsize or self.send_queue or self.logOctets or self.state != self.STATE_OPEN:
            original_send(self, data, sync, chopsize)
            return
        self.transport.write(data)
        self.trafficStats.outgoingOctetsWireLevel += len(data)

    protocol_class.sendData = send_data
