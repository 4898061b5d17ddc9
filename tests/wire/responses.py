"""HTTP/1.1 responses for the tests of both clients that read them with
:mod:`relay.wire.http1`: the worker's backend connections and the cluster link.

:data:`MALFORMED` holds the answers no exchange may survive, whatever the reads: each
is an error once the connection closes after it (those in :data:`TRUNCATED` only then:
until the close they may still be continued).
"""

from __future__ import annotations

from relay.wire.http1 import MAX_HEAD_BYTES

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\nok"

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


SHORTEST = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-pad: \r\n\r\n"


def length_head(value: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: " + value.encode() + b"\r\n\r\n"


def padded_head(size: int) -> bytes:
    """A response head of exactly ``size`` bytes (an ``x-pad`` header fills it)."""
    return SHORTEST.replace(b"x-pad: ", b"x-pad: " + b"p" * (size - len(SHORTEST)))


#: Responses no exchange may survive; a server writes one, then closes the connection.
MALFORMED = {
    "negative chunk size": CHUNKED_HEAD + b"1\r\nA\r\n-6\r\nXXXX",
    "chunk size with a plus sign": CHUNKED_HEAD + b"+1\r\nA\r\n0\r\n\r\n",
    "chunk size with 0x": CHUNKED_HEAD + b"0x1\r\nA\r\n0\r\n\r\n",
    "chunk size with an underscore": CHUNKED_HEAD + b"1_0\r\n" + b"A" * 16 + b"\r\n0\r\n\r\n",
    "chunk size not hex": CHUNKED_HEAD + b"zz\r\n",
    "chunk size past 64 bits": CHUNKED_HEAD + b"1" + b"0" * 16 + b"\r\n",
    "chunk data longer than its size": CHUNKED_HEAD + b"1\r\nAB\r\n0\r\n\r\n",
    "superscript two as content-length": length_head("\u00b2") + b"ok",
    "arabic-indic digit as content-length": length_head("\u0662") + b"ok",
    "fullwidth digit as content-length": length_head("\uff12") + b"ok",
    "content-length with a sign": length_head("+2") + b"ok",
    "content-length list": length_head("2, 2") + b"ok",
    "two different content-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
    b"content-length: 3\r\n\r\nok",
    "Content-Length then Transfer-Encoding": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "content-length then transfer-encoding": b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n"
    b"transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "transfer-encoding then content-length": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
    b"content-length: 3\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "a transfer-coding other than chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n"
    b"\r\nabc",
    "truncated mid-chunk": CHUNKED_HEAD + b"a\r\nabc",
    "truncated between chunks": CHUNKED_HEAD + b"3\r\nabc\r\n",
    "truncated mid-head": b"HTTP/1.1 200 OK\r\ncontent-len",
    "truncated mid-body": length_head("10") + b"abc",
    "garbage status line": b"SPDY/9 what\r\n\r\n",
    "status code not digits": b"HTTP/1.1 2x0 OK\r\n\r\n",
    "status code below 100": b"HTTP/1.1 099 Odd\r\ncontent-length: 0\r\n\r\n",
    "an HTTP/2 status line": b"HTTP/2.0 200 OK\r\ncontent-length: 0\r\n\r\n",
    "a header line without a colon": b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    "a folded header line": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n  folded\r\ncontent-length: 0\r\n\r\n",
    "a control byte in a header value": b"HTTP/1.1 200 OK\r\nx-a: \x01\r\n\r\n",
    "switching protocols": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
    "bytes after the end of the response": OK + b"EXTRA",
    "a second response after the first": OK + OK,
    "only interim responses": b"HTTP/1.1 100 Continue\r\n\r\n",
    "a head one byte over the limit": padded_head(MAX_HEAD_BYTES + 1) + b"ok",
}

#: The :data:`MALFORMED` answers that are an error only because the connection ends.
TRUNCATED = frozenset(
    {
        "truncated mid-chunk",
        "truncated between chunks",
        "truncated mid-head",
        "truncated mid-body",
        "only interim responses",
    }
)
