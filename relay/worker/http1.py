"""HTTP/1.1 message syntax for the worker's backend connections (RFC 9112).

:mod:`relay.worker.connection` writes :func:`request_head` and reads responses with a
:class:`ResponseReader`, around llhttp (``httptools``), the parser of Node.js and
uvicorn. Only what forwarding needs: ``POST`` requests with a ``content-length`` body;
responses framed by ``content-length``, ``transfer-encoding: chunked`` or the
connection's close, ``1xx`` interim responses skipped. Malformed input raises
``httpx.RemoteProtocolError`` (and unsendable requests ``httpx.LocalProtocolError``),
the exceptions the worker already reports. Imports nothing from Django.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools
import httpx

#: How a response's body is delimited (RFC 9112 §6.3).
LENGTH, CHUNKED, UNTIL_CLOSE, NO_BODY = range(4)

#: A response whose head (interim responses included) has not ended within this many
#: bytes is refused.
MAX_HEAD_BYTES = 64 * 1024
#: Receives body bytes as they are read.
BodySink = Callable[[bytes], None]
#: Header names a request may carry: RFC 9110 tokens.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Characters a request target may hold as they are; anything else is percent-encoded.
_TARGET_SAFE = "/%?#[]@!$&'()*+,;=:-._~"


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


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the backend listens, parsed once from ``--backend-url``."""

    scheme: str
    host: str
    port: int
    #: The URL's path without its trailing slash, prefixed to every request path.
    base: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port or (443 if scheme == "https" else 80)
        return cls(scheme, parts.hostname or "", port, parts.path.rstrip("/"))

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def request_head(origin: Origin, path: str, headers: dict[str, str], length: int) -> bytes:
    """The bytes of a ``POST`` request head; ``LocalProtocolError`` for unsendable headers.

    ``headers`` (names in lower case) come after ``host`` and replace the defaults
    ``accept`` and ``connection``; ``content-length`` is set from ``length``.
    """
    target = origin.base + path
    if not target.isascii() or not target.isprintable() or " " in target:
        target = quote(target, safe=_TARGET_SAFE)
    lines = [f"POST {target} HTTP/1.1", f"host: {origin.authority}"]
    for name, value in ({"accept": "*/*", "connection": "keep-alive"} | headers).items():
        if _TOKEN.fullmatch(name) is None:
            raise httpx.LocalProtocolError(f"invalid header name {name[:40]!r}")
        if "\r" in value or "\n" in value or "\0" in value or not value.isascii():
            raise httpx.LocalProtocolError(f"invalid value for header {name!r}")
        lines.append(f"{name}: {value}")
    lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def content_decoder(encoding: str) -> zlib._Decompress | None:
    """A decompressor for a ``content-encoding`` httpx decodes too, else None."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if encoding == "deflate":
        return zlib.decompressobj()
    return None  # identity, or an encoding httpx would not decode either


class ResponseReader:
    """Reads the responses of one connection, fed the bytes as they are read.

    The syntax is checked by llhttp (Node.js's HTTP parser, through ``httptools``): a
    chunk size is hex digits only (no sign, ``0x`` or ``_``), a ``Content-Length``
    ASCII digits only, and a response with both ``Content-Length`` and
    ``Transfer-Encoding`` is refused (RFC 9112 §6.3: a message framed two ways is a
    smuggling attempt or a broken server; either way its end is unknown). This class
    adds what llhttp leaves to its user: interim (``1xx``) responses skipped, the size
    limit of a head, the framing in :class:`ResponseHead`, and the end of a body
    delimited by the connection's close (:attr:`until_close`).

    ``on_head`` gets the final response's head; ``on_body`` every piece of its body
    (llhttp calls it directly, once per piece of body one :meth:`feed` holds);
    :attr:`complete` says the response ended. Call :meth:`expect` before each request.
    """

    __slots__ = ("_headers", "_interim", "_on_head", "_parser", "_raw", "complete", "head",
                 "on_body")  # fmt: skip

    def __init__(self, on_head: Callable[[ResponseHead], None], on_body: BodySink) -> None:
        self._on_head = on_head
        self.on_body = on_body  # looked up once, by the parser below
        self._parser = httptools.HttpResponseParser(self)
        self.expect()

    def expect(self) -> None:
        """Expect a new response (after a request was written)."""
        self.head: ResponseHead | None = None
        self.complete = False
        self._headers: list[tuple[str, str]] = []
        self._interim = False
        self._raw = 0  # bytes fed since expect(), counted until the head ended

    def feed(self, data: bytes) -> None:
        """Parse ``data``; ``RemoteProtocolError`` for anything malformed or too large.

        What the callbacks raise (the body's consumer refusing it) propagates as is.
        """
        if self.head is None:
            room = MAX_HEAD_BYTES - self._raw
            if len(data) > room:
                # The head must end within the bytes left to the limit, wherever the
                # reads split the response; what follows it is parsed after the check.
                self._raw = MAX_HEAD_BYTES
                if room:
                    self._parse(data[:room])
                if self.head is None:
                    raise httpx.RemoteProtocolError("the response head is too large")
                data = data[room:]
            else:
                self._raw += len(data)
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            raise (exc.__context__ or httpx.RemoteProtocolError(str(exc))) from None
        except httptools.HttpParserUpgrade:
            raise httpx.RemoteProtocolError("the backend switched protocols") from None
        except httptools.HttpParserError as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}") from None

    @property
    def until_close(self) -> bool:
        """Whether the body being read ends with the connection (then its close is no error)."""
        return self.head is not None and self.head.framing == UNTIL_CLOSE and not self.complete

    # -- llhttp's callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise httpx.RemoteProtocolError("data after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), _text(value.strip(b" \t"))))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if not parser.get_http_version().startswith("1.") or status < 100:
            raise httpx.RemoteProtocolError("malformed status line")
        if status < 200:
            if status == 101:
                raise httpx.RemoteProtocolError("the backend switched protocols")
            self._headers, self._interim = [], True  # skipped; the final response follows
            return
        head = ResponseHead(status, self._headers, keep_alive=parser.should_keep_alive())
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
                raise httpx.RemoteProtocolError("unsupported transfer-encoding")
            head.framing = CHUNKED
        elif length:
            head.length = int(length)
            head.framing = LENGTH if head.length else NO_BODY
        else:
            head.framing, head.keep_alive = UNTIL_CLOSE, False
        self.head = head
        self._on_head(head)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self.complete = True


def _text(value: bytes) -> str:
    """A header value decoded as UTF-8 when it is that, else as latin-1."""
    try:
        return value.decode("utf-8") if not value.isascii() else value.decode("ascii")
    except UnicodeDecodeError:
        return value.decode("latin-1")
