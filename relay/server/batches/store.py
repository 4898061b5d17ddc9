"""The database work behind the routes: files and batches as one key sees them.

Every function is synchronous and runs in a worker thread
(:func:`relay.server.batches.db.in_thread`). A key sees only its own files and
batches; the admin token sees everyone's; without required API keys everything
belongs to no key. What a caller may not see answers 404, like what does not exist.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connection, transaction
from django.db.models import Model, QuerySet
from django.utils import timezone

from batches.models import (
    ANTHROPIC,
    CANCELLING,
    DONE,
    ERRORED,
    IN_PROGRESS,
    OPENAI,
    SUCCEEDED,
    Batch,
    BatchLine,
    StoredFile,
    new_id,
)
from relay.server.batches import shapes
from relay.server.batches.lines import LineSpec
from relay.wire.errors import (
    BadRequest,
    BatchLinesExceeded,
    NotFound,
)

M = TypeVar("M", bound=Model)
#: Lines read per query while a file is rendered.
PAGE_LINES = 500
#: Lines written per query (and the most bytes of their bodies).
INSERT_LINES = 200
INSERT_BYTES = 4 * 1024 * 1024
#: The advisory lock (PostgreSQL) that serialises the limit checks of the "no key" owner.
NO_KEY_LOCK = 0x6D72_6669_6C65
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who is asking: an API key (None: no key), or the operator (sees everything)."""

    key_id: int | None
    admin: bool = False

    def mine(self, rows: QuerySet[M]) -> QuerySet[M]:
        if self.admin:
            return rows
        if self.key_id is None:
            return rows.filter(key__isnull=True)
        return rows.filter(key_id=self.key_id)


def page(rows: QuerySet[M], limit: int, after: str | None, before: str | None) -> list[M]:
    """Newest first; ``after`` (older than that id) or ``before`` (newer than it)."""
    if after:
        cursor = rows.filter(public_id=after).values_list("pk", flat=True).first()
        rows = rows.filter(pk__lt=cursor) if cursor is not None else rows.none()
    if before:
        cursor = rows.filter(public_id=before).values_list("pk", flat=True).first()
        if cursor is None:
            return []
        newer = list(rows.filter(pk__gt=cursor).order_by("pk")[: limit + 1])
        return newer[::-1]
    return list(rows.order_by("-pk")[: limit + 1])


def lock_owner(key_id: int | None) -> None:
    """Serialise the checks of one owner's limits until the transaction ends: its key's
    row, or (no key, PostgreSQL) an advisory lock; SQLite serialises writers anyway."""
    if key_id is not None:
        from keys.models import ApiKey

        list(ApiKey.objects.select_for_update().filter(pk=key_id).values_list("pk"))
    elif connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [NO_KEY_LOCK])


def listing(items: list[dict[str, Any]], has_more: bool, *, openai: bool) -> dict[str, Any]:
    document: dict[str, Any] = {
        "data": items,
        "has_more": has_more,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
    }
    return {"object": "list", **document} if openai else document


def _results(batch_id: int, kind: str) -> QuerySet[BatchLine]:
    """The ended lines of a batch that go in its ``kind`` of output: ``output`` (OpenAI,
    answers below 400), ``error`` (OpenAI, the rest) or ``results`` (Anthropic, all)."""
    rows = BatchLine.objects.filter(batch_id=batch_id, state=DONE)
    if kind == "output":
        rows = rows.filter(outcome=SUCCEEDED)
    elif kind == "error":
        rows = rows.exclude(outcome=SUCCEEDED)
    return rows.order_by("index")


def _renderer(kind: str) -> Callable[[BatchLine], bytes]:
    return shapes.anthropic_result if kind == "results" else shapes.openai_result


def result_page(batch_id: int, kind: str, after_index: int) -> list[tuple[int, bytes]]:
    """The next page of a batch's output, rendered, each line with its index."""
    render = _renderer(kind)
    rows = _results(batch_id, kind).filter(index__gt=after_index)[:PAGE_LINES]
    return [(line.index, render(line)) for line in rows]


def result_lines(batch_id: int, kind: str) -> Iterator[bytes]:
    """Every rendered line of a batch's output (to size a file)."""
    render = _renderer(kind)
    for line in _results(batch_id, kind).iterator(chunk_size=PAGE_LINES):
        yield render(line)


# ------------------------------------------------------------------------- batches


def create_openai_batch(
    owner: Owner,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    window_secs: float,
) -> dict[str, Any]:
    """A batch waiting for validation; the engine checks its lines next."""
    source = owner.mine(StoredFile.objects.filter(public_id=input_file_id)).first()
    if source is None:
        raise NotFound(f"No such file: {input_file_id[:100]}")
    if source.purpose != INPUT_PURPOSE or source.batch_id is not None:
        raise BadRequest(f"File {input_file_id} was not uploaded with purpose 'batch'")
    now = timezone.now()
    batch = Batch.objects.create(
        public_id=new_id("batch_"),
        api=OPENAI,
        key_id=owner.key_id,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        metadata=metadata,
        created_at=now,
        expires_at=now + dt.timedelta(seconds=window_secs),
    )
    return shapes.openai_batch(batch)


def create_anthropic_batch(
    owner: Owner,
    count: int,
    specs: Iterable[LineSpec],
    window_secs: float,
    max_queued: int,
    base_url: str,
) -> dict[str, Any]:
    """A Message Batch of ``count`` requests, stored and running at once (checked
    already, :mod:`~relay.server.batches.lines`)."""
    now = timezone.now()
    with transaction.atomic():
        if queued_lines(owner.key_id, lock=True) + count > max_queued:
            raise BatchLinesExceeded(max_queued)
        batch = Batch.objects.create(
            public_id=new_id("msgbatch_"),
            api=ANTHROPIC,
            key_id=owner.key_id,
            endpoint="/v1/messages",
            created_at=now,
            expires_at=now + dt.timedelta(seconds=window_secs),
            status=IN_PROGRESS,
            in_progress_at=now,
            total=count,
        )
        insert_lines(batch, specs, now)
        batch.refresh_from_db()
    return shapes.anthropic_batch(batch, base_url)


def queued_lines(key_id: int | None, *, lock: bool = False) -> int:
    """Lines of the key's batches that have not ended yet (the per-key cap counts them).

    ``lock`` serialises creations of one owner (until the transaction ends)."""
    if lock:
        lock_owner(key_id)
    rows = Batch.objects.filter(key_id=key_id, status=IN_PROGRESS)
    waiting = 0
    for total, succeeded, errored, canceled, expired in rows.values_list(
        "total", "succeeded", "errored", "canceled", "expired"
    ):
        waiting += total - succeeded - errored - canceled - expired
    return waiting


def insert_lines(batch: Batch, specs: Iterable[LineSpec], now: dt.datetime) -> None:
    """Store a batch's lines, a page at a time (at most :data:`INSERT_LINES` rows or
    :data:`INSERT_BYTES` of bodies); a line that can never run is stored already ended."""
    rows: list[BatchLine] = []
    size = errored = 0
    for spec in specs:
        line = BatchLine(
            batch=batch,
            index=spec.index,
            custom_id=spec.custom_id,
            model=spec.model,
            body=spec.body,
        )
        if spec.error_code:
            errored += 1
            line.state, line.outcome, line.finished_at = DONE, ERRORED, now
            line.error_code, line.error_message = spec.error_code, spec.error_message
        rows.append(line)
        size += len(spec.body)
        if len(rows) >= INSERT_LINES or size >= INSERT_BYTES:
            BatchLine.objects.bulk_create(rows)
            rows, size = [], 0
            # This thread holds the interpreter between two pages; the event loop's
            # turn comes now rather than at the next forced switch.
            time.sleep(0)
    if rows:
        BatchLine.objects.bulk_create(rows)
    if errored:
        Batch.objects.filter(pk=batch.pk).update(errored=errored)


def _batches(owner: Owner, api: str) -> QuerySet[Batch]:
    return owner.mine(Batch.objects.filter(api=api))


def get_batch(owner: Owner, api: str, public_id: str) -> Batch:
    batch = _batches(owner, api).filter(public_id=public_id).first()
    if batch is None:
        raise NotFound(f"No such batch: {public_id[:100]}")
    return batch


def batch_info(owner: Owner, api: str, public_id: str, base_url: str) -> dict[str, Any]:
    return shapes.batch_object(get_batch(owner, api, public_id), base_url)


def list_batches(
    owner: Owner, api: str, limit: int, after: str | None, before: str | None, base_url: str
) -> dict[str, Any]:
    found = page(_batches(owner, api), limit, after, before)
    has_more = len(found) > limit
    found = found[-limit:] if before else found[:limit]
    items = [shapes.batch_object(b, base_url) for b in found]
    return listing(items, has_more, openai=api == OPENAI)


def cancel_batch(owner: Owner, api: str, public_id: str, base_url: str) -> dict[str, Any]:
    batch = get_batch(owner, api, public_id)
    if not Batch.objects.filter(pk=batch.pk).request_cancel():
        batch.refresh_from_db()
        if batch.status != CANCELLING:
            raise BadRequest(f"Cannot cancel a batch with status '{batch.status}'")
    batch.refresh_from_db()
    return shapes.batch_object(batch, base_url)


def delete_batch(owner: Owner, api: str, public_id: str) -> dict[str, Any]:
    """Delete an ended batch, its lines and its output files."""
    batch = get_batch(owner, api, public_id)
    if batch.ended_at is None:
        raise BadRequest(f"Batch {public_id} is still processing; cancel it first")
    with transaction.atomic():
        BatchLine.objects.filter(batch_id=batch.pk).delete()
        batch.delete()
    return {"id": public_id, "type": "message_batch_deleted"}


def results_source(owner: Owner, public_id: str) -> int:
    """The batch whose results are asked for (Anthropic): they exist once it ended."""
    batch = get_batch(owner, ANTHROPIC, public_id)
    if shapes.anthropic_status(batch) != "ended":
        raise BadRequest(f"Batch {public_id} is still processing; its results come when it ends")
    return batch.pk
