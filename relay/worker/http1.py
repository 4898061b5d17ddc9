"""HTTP/1.1 message syntax for the worker's backend connections (RFC 9112).

:mod:`relay.worker.connection` writes :func:`request_head` and reads responses with
:func:`parse_head` and :class:`ChunkedBody`. Only what forwarding needs: ``POST``
requests with a ``content-length`` body; responses framed by ``content-length``,
``transfer-encoding: chunked`` or the connection's close, ``1xx`` interim responses
skipped. Malformed input raises ``httpx.RemoteProtocolError`` (and unsendable
requests ``httpx.LocalProtocolError``), the exceptions the worker already reports.
Imports nothing from Django.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

#: How a response's body is delimited (RFC 9112 §6.3).
LENGTH, CHUNKED, UNTIL_CLOSE, NO_BODY = range(4)

#: A response head (status line and headers) larger than this is refused.
MAX_HEAD_BYTES = 64 * 1024
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


# Where a chunked body's decoder is.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


def content_decoder(encoding: str) -> zlib._Decompress | None:
    """A decompressor for a ``content-encoding`` httpx decodes too, else None."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)
    if encoding == "deflate":
        return zlib.decompressobj()
    return None  # identity, or an encoding httpx would not decode either


def parse_head(data: bytes) -> tuple[ResponseHead, bytes] | None:
    """The response head at the start of ``data`` and the bytes after it.

    None while the head is incomplete. Interim (``1xx``) responses are skipped.
    """
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("the response head is too large")
            return None
        lines = data[:end].decode("latin-1").split("\r\n")
        data = data[end + 4 :]
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:80]!r}")
        status = int(code)
        if not 100 <= status < 200:
            break
    head = ResponseHead(status, [], keep_alive=version == "HTTP/1.1")
    encodings, lengths = [], []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
        name, value = name.lower(), _text(value.strip(" \t"))
        head.headers.append((name, value))
        if name == "transfer-encoding":
            encodings += [t.strip().lower() for t in value.split(",")]
        elif name == "content-length":
            lengths.append(value)
        elif name == "connection" and "close" in value.lower():
            head.keep_alive = False
        elif name == "content-encoding":
            head.content_encoding = value
    if status in (204, 304):
        head.framing = NO_BODY
    elif encodings:
        if encodings[-1] != "chunked":
            raise httpx.RemoteProtocolError("unsupported transfer-encoding")
        head.framing = CHUNKED
    elif lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit():
            raise httpx.RemoteProtocolError("invalid content-length")
        head.length = int(lengths[0])
        head.framing = LENGTH if head.length else NO_BODY
    else:
        head.framing, head.keep_alive = UNTIL_CLOSE, False
    return head, data


class ChunkedBody:
    """Decodes a chunked body fed in arbitrary pieces (RFC 9112 §7.1)."""

    __slots__ = ("_buf", "_remaining", "_state", "done")

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0
        self._buf = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes in ``data`` (joined); sets :attr:`done` at the last chunk."""
        if self._buf:
            data, self._buf = self._buf + data, b""
        pieces: list[bytes] = []
        state, at, size = self._state, 0, len(data)
        while at < size:
            if state == _SIZE:
                end = data.find(b"\r\n", at)
                if end < 0:
                    break
                line = data[at:end].split(b";", 1)[0].strip()
                try:
                    self._remaining = int(line, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed chunk size") from None
                at = end + 2
                state = _DATA if self._remaining else _TRAILER
            elif state == _DATA:
                take = min(self._remaining, size - at)
                pieces.append(data[at : at + take])
                at += take
                self._remaining -= take
                if not self._remaining:
                    state = _DATA_END
            elif state == _DATA_END:
                if size - at < 2:
                    break
                if data[at : at + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunk end")
                at += 2
                state = _SIZE
            else:  # trailer lines, up to an empty one
                end = data.find(b"\r\n", at)
                if end < 0:
                    break
                last = end == at
                at = end + 2
                if last:
                    if at < size:
                        raise httpx.RemoteProtocolError("data after the end of the response")
                    self.done = True
                    break
        self._state = state
        if at < size and not self.done:
            if size - at > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("malformed chunked body")
            self._buf = data[at:]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _text(value: str) -> str:
    """A header value decoded as UTF-8 when it is that, else as latin-1 (as read)."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return value
