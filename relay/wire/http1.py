"""HTTP/1.1 responses read with llhttp (RFC 9112), for the two clients the relay has.

The worker's connections to its backend (:mod:`relay.worker.connection`) and the
cluster link between server processes (:mod:`relay.server.cluster.peerhttp`) each
read their responses with a :class:`ResponseReader`, fed the bytes as they are read.
The syntax is checked by llhttp (Node.js's HTTP parser, through ``httptools``, as in
uvicorn): a chunk size is hex digits only (no sign, ``0x`` or ``_``), a
``Content-Length`` ASCII digits only, and a response with both ``Content-Length`` and
``Transfer-Encoding`` is refused (RFC 9112 §6.3: a message framed two ways is a
smuggling attempt or a broken server; either way its end is unknown). The reader adds
what llhttp leaves to its user: interim (``1xx``) responses skipped, the size limit of
a head, the framing in :class:`ResponseHead`, and the end of a body delimited by the
connection's close (:attr:`ResponseReader.until_close`).

Each client subclasses the reader to name the exception malformed input raises
(:attr:`ResponseReader.error`: the one its callers already handle), and may decode
header values its own way (:meth:`ResponseReader.on_header`). Imports nothing from
Django.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import httptools

#: How a response's body is delimited (RFC 9112 §6.3).
LENGTH, CHUNKED, UNTIL_CLOSE, NO_BODY = range(4)

#: A response whose head (interim responses included) has not ended within this many
#: bytes is refused.
MAX_HEAD_BYTES = 64 * 1024
#: Receives body bytes as they are read.
BodySink = Callable[[bytes], None]


class MalformedResponse(Exception):
    """The response is no well-formed HTTP/1.1 answer (a subclass's :attr:`error`
    replaces it)."""


@dataclass(slots=True)
class ResponseHead:
    status: int
    #: ``(lowercased name, value)`` in the order received, repeats included.
    headers: list[tuple[str, str]]
    #: :data:`LENGTH`, :data:`CHUNKED`, :data:`UNTIL_CLOSE` or :data:`NO_BODY`.
    framing: int = NO_BODY
    #: The body's size when ``framing`` is :data:`LENGTH`.
    length: int = 0
    #: Whether the connection may carry another exchange after this one.
    keep_alive: bool = False
    content_encoding: str = ""

    def get(self, name: str, default: str = "") -> str:
        for key, value in self.headers:
            if key == name:
                return value
        return default


class ResponseReader:
    """Reads the responses of one connection, fed the bytes as they are read.

    ``on_head`` gets the final response's head (when given; :attr:`head` holds it
    too); ``on_body`` every piece of its body (llhttp calls it directly, once per
    piece of body one :meth:`feed` holds); :attr:`complete` says the response ended.
    Call :meth:`expect` before each request. One reader per connection: the parser and
    the reader refer to each other, and a pair per request would be garbage for the
    cycle collector.
    """

    __slots__ = ("_headers", "_interim", "_on_head", "_parser", "complete", "head", "on_body",
                 "received")  # fmt: skip

    #: What malformed input raises, from a message.
    error: ClassVar[type[Exception]] = MalformedResponse

    def __init__(self, on_head: Callable[[ResponseHead], None] | None, on_body: BodySink) -> None:
        self._on_head = on_head
        self.on_body = on_body  # looked up once, by the parser below
        self._parser = httptools.HttpResponseParser(self)
        self.expect()

    def expect(self) -> None:
        """Expect a new response (before or after a request was written)."""
        self.head: ResponseHead | None = None
        self.complete = False
        self._headers: list[tuple[str, str]] = []
        self._interim = False
        #: Bytes fed since :meth:`expect`, counted until the head ended.
        self.received = 0

    def feed(self, data: bytes) -> None:
        """Parse ``data``; :attr:`error` for anything malformed or too large.

        What the callbacks raise (the body's consumer refusing it) propagates as is.
        """
        if self.head is None:
            room = MAX_HEAD_BYTES - self.received
            if len(data) > room:
                # The head must end within the bytes left to the limit, wherever the
                # reads split the response; what follows it is parsed after the check.
                self.received = MAX_HEAD_BYTES
                if room:
                    self._parse(data[:room])
                if self.head is None:
                    raise self.error("the response head is too large")
                data = data[room:]
            else:
                self.received += len(data)
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            raise (exc.__context__ or self.error(str(exc))) from None
        except httptools.HttpParserUpgrade:
            raise self.error("the server switched protocols") from None
        except httptools.HttpParserError as exc:
            raise self.error(f"malformed response: {exc}") from None

    @property
    def until_close(self) -> bool:
        """Whether the body being read ends with the connection (then its close is no error)."""
        return self.head is not None and self.head.framing == UNTIL_CLOSE and not self.complete

    # -- llhttp's callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise self.error("data after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header: its name lowercased, its value as ISO-8859-1 text (which keeps
        every byte). A subclass may decode values otherwise."""
        self._headers.append(
            (name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1"))
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        version = parser.get_http_version()
        if not version.startswith("1.") or not 100 <= status < 1000:
            raise self.error(f"malformed status line: HTTP/{version} {status}")
        if status < 200:
            if status == 101:
                raise self.error("the server switched protocols")
            self._headers, self._interim = [], True  # skipped; the final response follows
            return
        head = ResponseHead(status, self._headers, NO_BODY, 0, parser.should_keep_alive())
        codings: list[str] = []
        length = ""
        for name, value in head.headers:
            if name == "transfer-encoding":
                codings += [c.strip().lower() for c in value.split(",") if c.strip()]
            elif name == "content-length":
                length = value  # llhttp let one through, of digits
            elif name == "content-encoding":
                head.content_encoding = value
        if status in (204, 304):
            head.framing = NO_BODY
        elif codings:
            if codings != ["chunked"]:
                raise self.error("unsupported transfer-encoding")
            head.framing = CHUNKED
        elif length:
            head.length = int(length)
            head.framing = LENGTH if head.length else NO_BODY
        else:
            head.framing, head.keep_alive = UNTIL_CLOSE, False
        self.head = head
        if self._on_head is not None:
            self._on_head(head)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self.complete = True
