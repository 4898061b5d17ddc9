"""The Files API's database work: uploads written in chunks as they are parsed, read
back chunk by chunk, and bounded per owner.

Every function is synchronous and runs in a worker thread, like those of
:mod:`~relay.server.batches.store` (whose :class:`~relay.server.batches.store.Owner`
decides what a caller sees). An upload's bytes live in
:class:`~batches.models.FileChunk` rows, apart from its row (docs/OPERATIONS.md says
why the database): nothing that lists files or runs batches reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Count, QuerySet, Sum

from batches.models import Batch, FileChunk, StoredFile, new_id
from relay.server.batches import shapes
from relay.server.batches.store import INPUT_PURPOSE, Owner, listing, lock_owner, page
from relay.wire.errors import BadRequest, FileBytesExceeded, FileCountExceeded, NotFound

#: An upload's bytes are kept in rows of this size (:class:`~batches.models.FileChunk`).
CHUNK_BYTES = 1024 * 1024
#: Chunks read per query while an upload is sent.
READ_CHUNKS = 4


@dataclass(frozen=True, slots=True)
class FileLimits:
    """What one owner may keep (BATCH_MAX_FILES_PER_KEY, BATCH_MAX_FILE_BYTES_PER_KEY):
    every key, and everything uploaded without one, alike."""

    most_files: int
    most_bytes: int


def _uploads(key_id: int | None) -> QuerySet[StoredFile]:
    """The uploads an owner keeps (output files are rendered from lines: not counted)."""
    rows = StoredFile.objects.filter(batch__isnull=True)
    return rows.filter(key__isnull=True) if key_id is None else rows.filter(key_id=key_id)


def check_room(
    owner: Owner, limits: FileLimits, coming: int, *, exclude: int | None = None
) -> None:
    """Raise when the owner keeps as many files as it may (429), or ``coming`` more
    bytes would take its files past their bytes (413). Called before an upload's body
    is read (``coming``: what its length promises) and at its end (its size)."""
    rows = _uploads(owner.key_id)
    if exclude is not None:
        rows = rows.exclude(pk=exclude)
    kept = rows.aggregate(files=Count("pk"), used=Sum("bytes"))
    if kept["files"] >= limits.most_files:
        raise FileCountExceeded(limits.most_files)
    used = kept["used"] or 0
    if used + coming > limits.most_bytes:
        raise FileBytesExceeded(limits.most_bytes, used)


class FileWriter:
    """An upload's bytes written to the store as the multipart parser hands them over,
    in :data:`CHUNK_BYTES` rows; never more than one chunk in memory.

    Used inside the transaction of :func:`create_file`: a failed or refused upload, or
    a server killed in the middle of one, leaves no row and no byte behind."""

    def __init__(self, owner: Owner, filename: str) -> None:
        self.row = StoredFile.objects.create(
            public_id=new_id("file-"),
            key_id=owner.key_id,
            purpose="",
            filename=filename[:255] or "upload.jsonl",
        )
        self.size = 0
        self._index = 0
        self._pending: list[bytes] = []
        self._pending_size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size >= CHUNK_BYTES:
            joined = b"".join(self._pending)
            whole = len(joined) - len(joined) % CHUNK_BYTES
            for at in range(0, whole, CHUNK_BYTES):
                self._store(joined[at : at + CHUNK_BYTES])
            rest = joined[whole:]
            self._pending, self._pending_size = ([rest], len(rest)) if rest else ([], 0)

    def _store(self, data: bytes) -> None:
        FileChunk.objects.create(file=self.row, index=self._index, data=data)
        self._index += 1

    def finish(self, owner: Owner, purpose: str, limits: FileLimits) -> dict[str, Any]:
        """The last chunk, then the owner's limits checked with the file's size (under
        the owner's lock, so that two uploads cannot both take the last room)."""
        if self._pending_size:
            self._store(b"".join(self._pending))
            self._pending, self._pending_size = [], 0
        lock_owner(owner.key_id)
        check_room(owner, limits, self.size, exclude=self.row.pk)
        self.row.purpose, self.row.bytes = purpose, self.size
        self.row.save(update_fields=["purpose", "bytes"])
        return shapes.file_object(self.row)


def create_file(
    owner: Owner, limits: FileLimits, receive: Callable[[Callable[[str], FileWriter]], str]
) -> dict[str, Any]:
    """Store one upload: ``receive`` parses the body, opening the file (with the name it
    has) through the factory it is handed, and returns the upload's purpose."""
    opened: list[FileWriter] = []

    def open_file(filename: str) -> FileWriter:
        if opened:
            raise BadRequest("file: one file per upload")
        opened.append(FileWriter(owner, filename))
        return opened[0]

    with transaction.atomic():
        purpose = receive(open_file)
        if not opened:
            raise BadRequest("file: a file part is required")
        if purpose != INPUT_PURPOSE:
            raise BadRequest("purpose: only 'batch' files are kept here")
        return opened[0].finish(owner, purpose, limits)


def _files(owner: Owner) -> QuerySet[StoredFile]:
    return owner.mine(StoredFile.objects.all())


def list_files(owner: Owner, purpose: str | None, limit: int, after: str | None) -> dict[str, Any]:
    rows = _files(owner)
    if purpose:
        rows = rows.filter(purpose=purpose)
    found = page(rows, limit, after, None)
    return listing([shapes.file_object(f) for f in found[:limit]], len(found) > limit, openai=True)


def get_file(owner: Owner, public_id: str) -> StoredFile:
    row = _files(owner).filter(public_id=public_id).first()
    if row is None:
        raise NotFound(f"No such file: {public_id[:100]}")
    return row


def file_info(owner: Owner, public_id: str) -> dict[str, Any]:
    return shapes.file_object(get_file(owner, public_id))


def delete_file(owner: Owner, public_id: str) -> dict[str, Any]:
    row = get_file(owner, public_id)
    with transaction.atomic():
        if row.batch_id is not None:
            # An output file: the batch no longer offers it.
            field = "output_file_id" if row.kind == "output" else "error_file_id"
            Batch.objects.filter(pk=row.batch_id).update(**{field: ""})
        row.delete()  # and its chunks
    return {"id": public_id, "object": "file", "deleted": True}


@dataclass(frozen=True, slots=True)
class FileSource:
    """Where a file's bytes come from: its chunks (an upload) or a batch's lines."""

    file_pk: int
    size: int
    batch_id: int | None
    kind: str


def file_source(owner: Owner, public_id: str) -> FileSource:
    row = get_file(owner, public_id)
    return FileSource(row.pk, row.bytes, row.batch_id, row.kind)


def file_chunks(file_pk: int, after: int, most: int = READ_CHUNKS) -> list[tuple[int, bytes]]:
    """The next chunks of an upload after chunk number ``after``, with their numbers."""
    rows = FileChunk.objects.filter(file_id=file_pk, index__gt=after).order_by("index")
    return [(index, bytes(data)) for index, data in rows.values_list("index", "data")[:most]]
