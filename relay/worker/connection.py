"""One HTTP/1.1 connection to the backend, as an asyncio protocol.

:class:`relay.worker.backend.Backend` forwards every request on one of these, taken
from its :class:`relay.worker.pool.ConnectionPool`. A streamed response body reaches
its consumer from the
connection's ``data_received`` callback, in the event loop's own I/O step: no task
wakes up per read, no per-read timeout object is built, and everything one socket
read returned arrives as one piece (what the backend wrote since the last read,
never held back for more). That path costs a small fraction of a general HTTP
client's, which matters at thousands of chunks a second (docs/BENCHMARKS.md).

One request at a time per connection (no pipelining), in the message syntax of
:mod:`relay.worker.http1` (responses parsed by llhttp); ``gzip``/``deflate`` bodies
decoded (the worker asks for ``identity``); plain TCP or TLS. Failures raise the
``httpx`` exceptions the worker already handles (``ConnectError``, ``ReadTimeout``,
``RemoteProtocolError`` ...), so ``describe()`` names them as before.

A connection tells its pool what it knows of going stale: how many exchanges it
started (:attr:`BackendConnection.exchanges`), whether a byte of the current answer
came (:attr:`BackendConnection.answered`), and whether a close from the backend waits
unread (:meth:`BackendConnection.quiet`).

Flow control: :meth:`BackendConnection.hold` stops reading the socket (TCP then slows
the backend) and :meth:`BackendConnection.release` starts again; the read timeout
does not run while held. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import select
import zlib
from collections.abc import Callable
from typing import cast

import httpx

from relay.wire.http1 import CHUNKED, LENGTH, BodySink, ResponseHead
from relay.worker.http1 import BackendResponseReader, content_decoder


class BodyTooLarge(Exception):
    """A collected (non-streamed) body passed its limit; the connection was closed."""


class NoAnswer(Exception):
    """Marks a failure that came before one byte of the response: the backend closed
    or reset the connection without answering (it may never have read the request)."""


class ClosedUnanswered(httpx.RemoteProtocolError, NoAnswer):
    """The backend closed the connection without sending one byte of a response."""


class ResetUnanswered(httpx.ReadError, NoAnswer):
    """The connection was reset (or failed) before one byte of a response came."""


class BackendConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one exchange at a time.

    An exchange: :meth:`start` writes the request and returns the response head; then
    either :meth:`stream` hands each read's body bytes to a sink as they arrive, or
    :meth:`collect` gathers the body; :meth:`finished` waits for its end. Any failure
    closes the connection and raises from the awaited call.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, forget: Callable[[BackendConnection], None]
    ) -> None:
        #: Called once the connection closed (its pool drops it).
        self._forget = forget
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        #: Exchanges started on this connection (more than one: it was reused).
        self.exchanges = 0
        #: Whether a byte of the current exchange's response arrived.
        self.answered = False
        self._reader = BackendResponseReader(self._begin, self._deliver)
        self._head: asyncio.Future[ResponseHead] | None = None
        self._done: asyncio.Future[None] | None = None
        self._reusable = False
        self._sink: BodySink | None = None
        self._early: list[bytes] = []
        self._parts: list[bytes] | None = None
        self._limit = 0
        self._size = 0
        self._inflate: zlib._Decompress | None = None
        self._holds = 0
        #: From :meth:`start` until the body ended or failed.
        self._active = False
        self._read_timeout: float | None = None
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self._forget(self)
        self._stop_timer()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if not self._active:
            return
        reader = self._reader
        if exc is None and reader.until_close:
            self._end_body()  # the close is the end of a close-delimited body
            return
        if exc is not None:
            failure = httpx.ReadError if self.answered else ResetUnanswered
            self._fail(failure(str(exc) or type(exc).__name__))
        elif reader.head is None:
            closed = httpx.RemoteProtocolError if self.answered else ClosedUnanswered
            self._fail(closed("Server disconnected without sending a response."))
        else:
            framing = reader.head.framing
            what = "incomplete chunked read" if framing == CHUNKED else "received less "
            if framing == LENGTH:
                what += "than content-length"
            self._fail(
                httpx.RemoteProtocolError(
                    f"peer closed connection without sending complete message body ({what})"
                )
            )

    def eof_received(self) -> bool | None:
        return False  # close our side too: a half-closed backend connection is useless

    def pause_writing(self) -> None:
        self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if not self._active:
            # Idle, or after the end of a response: a well-behaved server sends nothing.
            self.abort()
            return
        self.answered = True
        reader = self._reader
        try:
            # Body bytes reach the sink from inside feed(), through _deliver.
            reader.feed(data)
            if reader.complete:
                # Only once the whole read parsed: bytes after the end fail the exchange.
                self._end_body()
        except (httpx.HTTPError, BodyTooLarge, zlib.error) as exc:
            if isinstance(exc, zlib.error):
                exc = httpx.DecodingError(f"cannot decode the response body: {exc}")
            self._fail(exc)
            self.abort()

    def _begin(self, head: ResponseHead) -> None:
        """The response head arrived (from the reader): hand it to :meth:`start`."""
        self._reusable = head.keep_alive
        if head.content_encoding:
            self._inflate = content_decoder(head.content_encoding)
        waiter, self._head = self._head, None
        if waiter is not None and not waiter.done():
            waiter.set_result(head)

    def _deliver(self, data: bytes) -> None:
        if self._inflate is not None:
            data = self._inflate.decompress(data)
            if not data:
                return
        if self._parts is not None:
            self._size += len(data)
            if self._size > self._limit:
                raise BodyTooLarge()
            self._parts.append(data)
        elif self._sink is not None and not self._early and not self._holds:
            self._sink(data)
        else:
            self._early.append(data)

    def _end_body(self) -> None:
        if self._inflate is not None:
            rest = self._inflate.flush()
            self._inflate = None
            if rest:
                self._deliver(rest)
        self._active = False
        self._stop_timer()
        done = self._done
        if done is not None and not done.done():
            if self._sink is not None and self._early:
                self._flush_early()  # the whole body is read: nothing may stay behind
            done.set_result(None)
        self._sink = None  # a pooled connection keeps nothing of the exchange alive

    def _fail(self, exc: BaseException) -> None:
        self._reusable = False
        self._active = False
        self._sink, self._parts, self._early = None, None, []
        self._stop_timer()
        for waiter in (self._head, self._done):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
        self._head = None

    # -- one exchange ------------------------------------------------------------------

    async def start(
        self, head: bytes, body: bytes, *, write_timeout: float, read_timeout: float | None
    ) -> ResponseHead:
        """Send a request; the response head once it arrived."""
        transport = self.transport
        if transport is None or self.closed:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        loop = self._loop
        self._head = loop.create_future()
        self._done = loop.create_future()
        self._read_timeout = read_timeout
        self._sink, self._parts, self._early, self._inflate = None, None, [], None
        self._reader.expect()
        self.exchanges += 1
        self._reusable, self._active, self.answered = False, True, False
        transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            transport.write(body)
        if self._writable is not None:
            try:
                async with asyncio.timeout(write_timeout):
                    await asyncio.shield(self._writable)
            except TimeoutError:
                raise httpx.WriteTimeout("timed out writing to the backend") from None
        self._last_read = loop.time()
        self._arm_timer()
        return await self._head

    def stream(self, sink: BodySink) -> None:
        """Hand every read's body bytes to ``sink`` from now on.

        What arrived with the head goes to ``sink`` at once, held or not: it was read
        before any hold could take effect (as the one read under way when it comes).
        """
        self._sink = sink
        if self._early:
            self._flush_early()

    def collect(self, limit: int) -> None:
        """Gather the body; more than ``limit`` bytes ends the exchange with BodyTooLarge."""
        early, self._early = self._early, []  # already decoded
        self._parts, self._limit, self._size = early, limit, sum(map(len, early))
        if self._size > limit:
            raise BodyTooLarge()

    def body(self) -> bytes:
        """The collected body (once: a pooled connection does not keep it)."""
        parts, self._parts = self._parts or [], None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def finished(self) -> None:
        """Wait for the end of the body; raises what ended it otherwise."""
        assert self._done is not None
        await self._done

    @property
    def reusable(self) -> bool:
        """Whether the exchange ended cleanly and the connection may serve another."""
        done = self._done
        return (
            self._reusable
            and not self.closed
            and done is not None
            and done.done()
            and not done.cancelled()
            and done.exception() is None
        )

    def _flush_early(self) -> None:
        sink, early = self._sink, self._early
        assert sink is not None
        self._early = []
        data = early[0] if len(early) == 1 else b"".join(early)
        if data:
            sink(data)

    # -- flow control and timeouts ---------------------------------------------------

    def hold(self) -> None:
        """Stop reading the response until as many :meth:`release` calls came.

        Holds nest: the relay's ``pause`` and a full relay connection each hold once.
        No read timeout runs while held.
        """
        self._holds += 1
        if self._holds == 1:
            self._stop_timer()
            if self.transport is not None:
                self.transport.pause_reading()

    def release(self) -> None:
        if not self._holds:
            return
        self._holds -= 1
        if self._holds or self.transport is None or self.closed:
            return
        if self._sink is not None and self._early:
            self._flush_early()
            if self._holds:  # the sink's relay connection filled up again
                return
        if self._active:
            self._last_read = self._loop.time()
            self._arm_timer()
        self.transport.resume_reading()

    @property
    def held(self) -> bool:
        return self._holds > 0

    def _arm_timer(self) -> None:
        if self._read_timeout is None or self._timer is not None or self._holds:
            return
        self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._check_timeout)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        # One timer per exchange, pushed back lazily: reads only record their time.
        self._timer = None
        if self._read_timeout is None or self._holds:
            return
        if self._loop.time() - self._last_read >= self._read_timeout:
            self._fail(httpx.ReadTimeout("timed out reading from the backend"))
            self.abort()
        else:
            self._arm_timer()

    def quiet(self) -> bool:
        """Whether the idle socket has nothing to read: no close from the backend on
        its way that the event loop has not seen yet (then the next request would fail)."""
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return False
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        try:
            return not poll.poll(0)
        except OSError:
            return False

    # -- ending ------------------------------------------------------------------------

    def abort(self) -> None:
        """Drop the connection at once (the backend sees the request abandoned).

        An exchange still under way ends here: its waiters are cancelled (nobody
        awaits them any more), and the close that follows reports nothing.
        """
        self.closed = True
        self._active = False
        self._stop_timer()
        self._forget(self)
        if self.transport is not None:
            self.transport.abort()
        for waiter in (self._head, self._done):
            if waiter is None:
                continue
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # retrieved: whoever awaits it still gets it
