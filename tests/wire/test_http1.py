"""The HTTP/1.1 response reader the worker and the server share (``relay.wire.http1``),
fed bytes directly; no I/O. Each client's own tests run it over sockets:
``tests/worker/test_http1.py`` and ``tests/server/test_peerhttp.py``."""

from __future__ import annotations

import httpx
import pytest

from relay.wire.http1 import (
    CHUNKED,
    LENGTH,
    MAX_HEAD_BYTES,
    NO_BODY,
    UNTIL_CLOSE,
    MalformedResponse,
    ResponseHead,
    ResponseReader,
)
from relay.worker.http1 import BackendResponseReader
from tests.wire.responses import CHUNKED_HEAD, MALFORMED, OK, TRUNCATED, padded_head


class Reading:
    """A reader and what it handed over."""

    def __init__(self, kind: type[ResponseReader] = ResponseReader) -> None:
        self.heads: list[ResponseHead] = []
        self.body: list[bytes] = []
        self.reader = kind(self.heads.append, self.body.append)

    def feed(self, data: bytes, piece: int | None = None) -> Reading:
        piece = piece or len(data) or 1
        for at in range(0, len(data), piece):
            self.reader.feed(data[at : at + piece])
        return self


@pytest.mark.parametrize("piece", [None, 1])
@pytest.mark.parametrize(
    "name", sorted(set(MALFORMED) - TRUNCATED), ids=lambda name: name.replace(" ", "-")
)
def test_a_malformed_response_is_refused_however_it_is_cut(name: str, piece: int | None) -> None:
    with pytest.raises(MalformedResponse):
        Reading().feed(MALFORMED[name], piece)


@pytest.mark.parametrize("name", sorted(TRUNCATED))
def test_a_truncated_response_is_not_complete_until_its_connection_says_so(name: str) -> None:
    reading = Reading().feed(MALFORMED[name])
    assert not reading.reader.complete
    assert not reading.reader.until_close


@pytest.mark.parametrize(
    ("response", "framing", "length", "keep_alive"),
    [
        (OK, LENGTH, 2, True),
        (CHUNKED_HEAD + b"2\r\nok\r\n0\r\n\r\n", CHUNKED, 0, True),
        (b"HTTP/1.1 200 OK\r\n\r\nok", UNTIL_CLOSE, 0, False),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", NO_BODY, 0, False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", NO_BODY, 0, True),
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n", NO_BODY, 9, True),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", LENGTH, 2, False),
    ],
)
def test_the_head_says_how_the_body_ends_and_whether_the_connection_stays(
    response: bytes, framing: int, length: int, keep_alive: bool
) -> None:
    reading = Reading().feed(response)
    (head,) = reading.heads
    assert (head.framing, head.keep_alive) == (framing, keep_alive)
    if framing == LENGTH:
        assert head.length == length
    assert b"".join(reading.body) == (b"ok" if framing != NO_BODY else b"")
    assert reading.reader.complete == (framing != UNTIL_CLOSE)
    assert reading.reader.until_close == (framing == UNTIL_CLOSE)


def test_interim_responses_are_skipped_and_each_response_is_expected_anew() -> None:
    reading = Reading().feed(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n" + OK, 5
    )
    (head,) = reading.heads
    assert head.status == 200 and head.get("link") == ""
    reading.reader.expect()
    reading.feed(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
    assert [h.status for h in reading.heads] == [200, 503]
    assert reading.reader.complete and reading.reader.received == 40


def test_header_names_are_lowercased_and_each_client_decodes_values_its_way() -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nX-Name: caf\xc3\xa9\r\nX-Raw: \xe9t\xe9 \r\n"
        b"Content-Encoding: gzip\r\ncontent-length: 0\r\n\r\n"
    )
    (head,) = Reading().feed(response).heads
    # ISO-8859-1 keeps every byte: the cluster link passes values on unchanged.
    assert head.headers[:2] == [("x-name", "caf\u00c3\u00a9"), ("x-raw", "\u00e9t\u00e9")]
    assert head.content_encoding == "gzip"
    (head,) = Reading(BackendResponseReader).feed(response).heads
    # The worker passes UTF-8 values on as text (httpx's decoding), else ISO-8859-1.
    assert head.headers[:2] == [("x-name", "caf\u00e9"), ("x-raw", "\u00e9t\u00e9")]


def test_each_client_gets_the_exception_its_callers_handle() -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="malformed response"):
        Reading(BackendResponseReader).feed(b"SPDY/9 what\r\n\r\n")

    class Refused(Exception):
        pass

    class OwnReader(ResponseReader):
        __slots__ = ()
        error = Refused

    with pytest.raises(Refused, match="switched protocols"):
        Reading(OwnReader).feed(MALFORMED["switching protocols"])


@pytest.mark.parametrize("cut", [None, 1000, MAX_HEAD_BYTES - 1, MAX_HEAD_BYTES])
def test_a_head_of_the_limit_is_read_and_one_byte_more_is_refused(cut: int | None) -> None:
    for size, fits in ((MAX_HEAD_BYTES, True), (MAX_HEAD_BYTES + 1, False)):
        response = padded_head(size) + b"ok"
        reading = Reading()
        reads = [response] if cut is None else [response[:cut], response[cut:]]
        if fits:
            for data in reads:
                reading.feed(data)
            assert b"".join(reading.body) == b"ok" and reading.reader.complete
        else:
            with pytest.raises(MalformedResponse, match="head is too large"):
                for data in reads:
                    reading.feed(data)


def test_the_reader_never_loops_on_what_used_to_spin_the_worker() -> None:
    """The audit's reproduction, fed byte by byte: parsing stops at the ``-``."""
    reading = Reading()
    with pytest.raises(MalformedResponse, match="chunk size"):
        reading.feed(CHUNKED_HEAD + b"1\r\nA\r\n-6\r\nXXXX", 1)
    assert reading.reader.head is not None and reading.reader.head.framing == CHUNKED
    assert reading.body == [b"A"]


def test_what_the_body_sink_raises_comes_out_as_it_is() -> None:
    class Full(Exception):
        pass

    def refuse(data: bytes) -> None:
        raise Full(data)

    reader = ResponseReader(None, refuse)
    with pytest.raises(Full):
        reader.feed(OK)
