"""Reading an upload (``POST /v1/files``): the body within its limit, then Django's own
multipart parser, never a hand-written one.

The body is spooled (to memory while small, to an unnamed temporary file beyond: a
killed server leaves nothing of it) as it arrives, refused with 413 as soon as it
passes the limit, or before a byte of it is read when its declared length already
does. The parser hands the file part over in pieces, which go straight to the store
(:class:`relay.server.batches.files.FileWriter`): the file is never held in memory.
The file itself may be BATCH_FILE_MAX_BYTES long; the body around it a little more
(the multipart framing).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import IO, Any, Protocol

from django.core.files.uploadhandler import FileUploadHandler

from relay.server.http.request import ClientGone
from relay.server.http.send import Receive
from relay.wire.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

#: What the multipart framing around the file may add to the body.
FRAMING_BYTES = 64 * 1024
#: Bodies larger than this are spooled to a temporary file while they arrive.
SPOOL_IN_MEMORY = 1024 * 1024
#: The spooling lets the event loop run others at least this often (in bytes).
YIELD_BYTES = 256 * 1024


class Sink(Protocol):
    """Where the file part's bytes go as they are parsed (the store's writer)."""

    def write(self, data: bytes) -> None: ...


def body_limit(file_limit: int) -> int:
    return file_limit + FRAMING_BYTES


def check_head(headers: list[tuple[bytes, bytes]], file_limit: int) -> str:
    """The upload's content type, or the error it is refused with before its body."""
    content_type = declared = None
    for name, value in headers:
        if name == b"content-type":
            content_type = value.decode("latin-1")
        elif name == b"content-length":
            declared = value
    if declared is not None and declared.isdigit() and int(declared) > body_limit(file_limit):
        raise PayloadTooLarge(f"A file may be at most {file_limit} bytes")
    if content_type is None or not content_type.lower().startswith("multipart/form-data"):
        raise UnsupportedMediaType("Content-Type must be multipart/form-data")
    return content_type


def least_file_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """The least the file of a body of the declared length can hold (0: not declared)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return max(0, int(value) - FRAMING_BYTES)
    return 0


async def spool(receive: Receive, file_limit: int) -> tuple[IO[bytes], int]:
    """The body, read to its end or refused past its limit."""
    body: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115
    try:
        too_large = f"A file may be at most {file_limit} bytes"
        size = await write_body(receive, body, body_limit(file_limit), too_large)
    except BaseException:
        body.close()
        raise
    body.seek(0)
    return body, size


async def write_body(receive: Receive, into: IO[bytes], limit: int, too_large: str) -> int:
    """Write a request's body to ``into`` as it arrives; its size, or
    :class:`PayloadTooLarge` (saying ``too_large``) as soon as it passes ``limit``."""
    size = unyielded = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(too_large)
            into.write(chunk)
            unyielded += len(chunk)
        if not message.get("more_body", False):
            return size
        if unyielded >= YIELD_BYTES:
            # A body the server has buffered already comes without a pause: let
            # everyone else run between the pieces of it.
            unyielded = 0
            await asyncio.sleep(0)


def parse(
    content_type: str,
    body: IO[bytes],
    size: int,
    file_limit: int,
    open_file: Callable[[str], Sink],
) -> str:
    """Parse a multipart body (in a worker thread): the ``file`` part goes to the sink
    ``open_file`` gives for its name, piece by piece as it is read, never whole;
    returns the ``purpose`` field."""
    from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
    from django.http.multipartparser import MultiPartParser, MultiPartParserError

    meta = {"CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(size)}
    handler = _Handler(file_limit, open_file)
    try:
        fields, _ = MultiPartParser(meta, body, [handler], "utf-8").parse()
    except (MultiPartParserError, RequestDataTooBig, SuspiciousOperation) as exc:
        raise BadRequest(f"The multipart body could not be read: {str(exc)[:200]}") from None
    return str(fields.get("purpose") or "")


class _Handler(FileUploadHandler):
    """Django's upload handler interface: the ``file`` part's bytes to the sink (others
    are dropped), refused past ``file_limit``. Nothing is kept for Django's ``files``."""

    def __init__(self, file_limit: int, open_file: Callable[[str], Sink]) -> None:
        super().__init__()
        self.file_limit = file_limit
        self.open_file = open_file
        self.sink: Sink | None = None
        self.size = 0

    def new_file(self, field_name: str, file_name: str, *args: Any, **kwargs: Any) -> None:
        super().new_file(field_name, file_name, *args, **kwargs)
        self.sink = self.open_file(file_name) if field_name == "file" else None

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        # Returning nothing keeps the data from any other handler: the sink has it.
        if self.sink is not None:
            self.size += len(raw_data)
            if self.size > self.file_limit:
                raise PayloadTooLarge(f"A file may be at most {self.file_limit} bytes")
            self.sink.write(raw_data)

    def file_complete(self, file_size: int) -> None:
        self.sink = None  # nothing for Django's ``files``: the file is in the store
