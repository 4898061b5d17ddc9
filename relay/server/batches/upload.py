"""Reading an upload (``POST /v1/files``): the body within its limit, then Django's own
multipart parser, never a hand-written one.

The body is spooled (to memory while small, to a temporary file beyond) as it
arrives, refused with 413 as soon as it passes the limit, or before a byte of it is
read when its declared length already does. The file itself may be
BATCH_FILE_MAX_BYTES long; the body around it a little more (the multipart framing).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import IO

from relay.server.http.request import ClientGone
from relay.server.http.send import Receive
from relay.wire.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

#: What the multipart framing around the file may add to the body.
FRAMING_BYTES = 64 * 1024
#: Bodies larger than this are spooled to a temporary file while they arrive.
SPOOL_IN_MEMORY = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


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


async def spool(receive: Receive, file_limit: int) -> tuple[IO[bytes], int]:
    """The body, read to its end or refused past its limit."""
    limit = body_limit(file_limit)
    body: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115
    size = 0
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"A file may be at most {file_limit} bytes")
                body.write(chunk)
            if not message.get("more_body", False):
                body.seek(0)
                return body, size
    except BaseException:
        body.close()
        raise


def parse(content_type: str, body: IO[bytes], size: int, file_limit: int) -> Upload:
    """The ``file`` and ``purpose`` fields of a multipart body (in a worker thread)."""
    from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
    from django.core.files.uploadhandler import (
        MemoryFileUploadHandler,
        TemporaryFileUploadHandler,
    )
    from django.http.multipartparser import MultiPartParser, MultiPartParserError

    meta = {"CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(size)}
    handlers = [MemoryFileUploadHandler(), TemporaryFileUploadHandler()]
    try:
        fields, files = MultiPartParser(meta, body, handlers, "utf-8").parse()
    except (MultiPartParserError, RequestDataTooBig, SuspiciousOperation) as exc:
        raise BadRequest(f"The multipart body could not be read: {str(exc)[:200]}") from None
    upload = files.get("file")
    if upload is None:
        raise BadRequest("file: a file part is required")
    try:
        if upload.size is not None and upload.size > file_limit:
            raise PayloadTooLarge(f"A file may be at most {file_limit} bytes")
        content = upload.read()
    finally:
        upload.close()
    if len(content) > file_limit:
        raise PayloadTooLarge(f"A file may be at most {file_limit} bytes")
    purpose = fields.get("purpose") or ""
    return Upload(upload.name or "upload.jsonl", str(purpose), content)
