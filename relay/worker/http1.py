"""HTTP/1.1 message syntax for the worker's backend connections (RFC 9112).

:mod:`relay.worker.connection` writes :func:`request_head` and reads responses with a
:class:`BackendResponseReader`, llhttp (``httptools``, the parser of Node.js and
uvicorn) as :mod:`relay.wire.http1` wraps it for the worker and the server alike. Only
what forwarding needs: ``POST`` requests with a ``content-length`` body; responses
framed by ``content-length``, ``transfer-encoding: chunked`` or the connection's close,
``1xx`` interim responses skipped. Malformed input raises ``httpx.RemoteProtocolError``
(and unsendable requests ``httpx.LocalProtocolError``), the exceptions the worker
already reports. Imports nothing from Django.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

from relay.wire.http1 import ResponseReader

#: Header names a request may carry: RFC 9110 tokens.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Characters a request target may hold as they are; anything else is percent-encoded.
_TARGET_SAFE = "/%?#[]@!$&'()*+,;=:-._~"


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


def _text(value: bytes) -> str:
    """A header value decoded as UTF-8 when it is that, else as latin-1 (as httpx does)."""
    try:
        return value.decode("utf-8") if not value.isascii() else value.decode("ascii")
    except UnicodeDecodeError:
        return value.decode("latin-1")


class BackendResponseReader(ResponseReader):
    """The responses of one backend connection (:class:`relay.wire.http1.ResponseReader`):
    malformed ones raise ``httpx.RemoteProtocolError``, and header values are UTF-8 when
    they are that, as the worker has always passed them on."""

    __slots__ = ()

    error = httpx.RemoteProtocolError

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), _text(value.strip(b" \t"))))
