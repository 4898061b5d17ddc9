"""A batch's life outside its lines: validated, ended by its lines, cancelled or out
of time, finished (output files, final status), pruned.

Every function is synchronous and runs in the engine's database thread, and is safe
to run in several processes at once: a batch being validated is leased to one, a
batch being finished is locked and its status checked first.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from batches.models import (
    ACTIVE,
    CANCELED,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    DONE,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    LINE_EXPIRED,
    OPENAI,
    VALIDATING,
    Batch,
    BatchLine,
    StoredFile,
    claimable,
    new_id,
)
from relay.server.batches import files, lines, store
from relay.server.batches.checker import Checker, scratch
from relay.server.batches.claims import TALLY
from relay.server.batches.lines import Checked, problem


def ended_as(state: tuple[str, float] | None, now: float) -> str:
    """How a line of a batch in ``state`` (status, expiry) ends at ``now`` ("": it
    runs on): the batch was cancelled (or deleted), or its window is over."""
    if state is None:
        return CANCELED
    status, expires = state
    if status in (CANCELLING, CANCELLED):
        return CANCELED
    if status != IN_PROGRESS or expires <= now:
        return LINE_EXPIRED
    return ""


@dataclass(frozen=True, slots=True)
class Limits:
    max_lines: int
    max_model_len: int
    max_queued: int
    lease_secs: float
    #: The most bytes of one line (MAX_REQUEST_BYTES, as a request sent directly).
    max_request_bytes: int


def validate_next(
    token: str, known: frozenset[str], limits: Limits, checker: Checker
) -> str | None:
    """Check the lines of one batch waiting for validation (in ``checker``'s process)
    and start it or fail it; returns its id (None when none waits). The batch is
    leased while its file is read, so one process validates it."""
    now = timezone.now()
    with transaction.atomic():
        batch = (
            Batch.objects.select_for_update(skip_locked=True)
            .filter(status=VALIDATING)
            .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
            .order_by("pk")
            .first()
        )
        if batch is None:
            return None
        lease_until = now + dt.timedelta(seconds=limits.lease_secs)
        Batch.objects.filter(pk=batch.pk).update(lease_token=token, lease_until=lease_until)
    with scratch() as (source, out):
        checked = _check(batch, source, out, known, limits, checker)
        _finish_validation(batch, token, checked, out, limits)
    return batch.public_id


def _check(
    batch: Batch,
    source: str,
    out: str,
    known: frozenset[str],
    limits: Limits,
    checker: Checker,
) -> Checked:
    """The batch's input file copied to ``source``, checked in the checking process."""
    upload = (
        StoredFile.objects.filter(public_id=batch.input_file_id, batch__isnull=True)
        .values_list("pk", flat=True)
        .first()
    )
    if upload is None:
        return Checked(0, [problem("file_not_found", "The input file was deleted")])
    with open(source, "wb") as copy:
        after = -1
        while chunks := files.file_chunks(upload, after):
            after = chunks[-1][0]
            for _, data in chunks:
                copy.write(data)
    rules = lines.Limits(limits.max_lines, limits.max_request_bytes, limits.max_model_len, known)
    return checker.run(lines.check_openai, source, out, batch.endpoint, rules)


def _finish_validation(
    batch: Batch, token: str, checked: Checked, out: str, limits: Limits
) -> None:
    """Start the batch with the lines written to ``out``, or fail it with the problems
    found (or when its key would have too many lines waiting)."""
    errors = checked.errors
    with transaction.atomic():
        if not errors and store.queued_lines(batch.key_id, lock=True) + checked.count > (
            limits.max_queued
        ):
            errors = [
                problem(
                    "batch_lines_exceeded",
                    f"This API key would have more than {limits.max_queued} batch requests "
                    "waiting; retry when some of its batches have ended",
                )
            ]
        current = (
            Batch.objects.select_for_update()
            .filter(pk=batch.pk, status=VALIDATING, lease_token=token)
            .first()
        )
        if current is None:
            return  # cancelled meanwhile, or another process took over
        now = timezone.now()
        current.lease_token, current.lease_until = "", None
        if errors:
            current.status, current.failed_at, current.errors = FAILED, now, errors
        else:
            current.status, current.in_progress_at = IN_PROGRESS, now
            current.total = checked.count
            store.insert_lines(current, lines.records(out), now)
        current.save(
            update_fields=[
                "lease_token",
                "lease_until",
                "status",
                "failed_at",
                "errors",
                "in_progress_at",
                "total",
            ]
        )


def sweep() -> list[str]:
    """End the unheld lines of cancelled and expired batches, then finish every
    batch whose lines have all ended; returns the ids of the batches finished."""
    now = timezone.now()
    ending = Batch.objects.filter(
        Q(status=CANCELLING) | Q(status=IN_PROGRESS, expires_at__lte=now)
    ).values_list("pk", "status")
    for batch_id, status in ending:
        outcome = CANCELED if status == CANCELLING else LINE_EXPIRED
        with transaction.atomic():
            count = (
                BatchLine.objects.filter(batch_id=batch_id)
                .filter(claimable(now))
                .update(
                    state=DONE, outcome=outcome, claim_token="", claimed_until=None, finished_at=now
                )
            )
            if count:
                field = TALLY[outcome]
                Batch.objects.filter(pk=batch_id).update(**{field: F(field) + count})
    done = Batch.objects.filter(
        status__in=(IN_PROGRESS, CANCELLING, FINALIZING),
        total__lte=F("succeeded") + F("errored") + F("canceled") + F("expired"),
    ).values_list("pk", flat=True)
    return [name for name in (finish(batch_id) for batch_id in done) if name]


def finish(batch_id: int) -> str | None:
    """Write a batch's output and error files and give it its final status; safe to
    call twice, from two processes (the batch's row is locked, its status checked)."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status not in (IN_PROGRESS, CANCELLING, FINALIZING):
            return None
        if BatchLine.objects.filter(batch_id=batch_id).exclude(state=DONE).exists():
            return None
        if batch.status == IN_PROGRESS and batch.api == OPENAI:
            batch.status, batch.finalizing_at = FINALIZING, timezone.now()
            batch.save(update_fields=["status", "finalizing_at"])
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status not in (IN_PROGRESS, CANCELLING, FINALIZING):
            return None
        if batch.api == OPENAI:
            for kind, field in (("output", "output_file_id"), ("error", "error_file_id")):
                size = count = 0
                for line in store.result_lines(batch_id, kind):
                    size += len(line)
                    count += 1
                if count:
                    output = StoredFile.objects.create(
                        public_id=new_id("file-"),
                        key_id=batch.key_id,
                        purpose=store.OUTPUT_PURPOSE,
                        filename=f"{batch.public_id}_{kind}.jsonl",
                        bytes=size,
                        batch=batch,
                        kind=kind,
                    )
                    setattr(batch, field, output.public_id)
        now = timezone.now()
        if batch.status == CANCELLING:
            batch.status, batch.cancelled_at = CANCELLED, now
        elif batch.expired:
            batch.status, batch.expired_at = EXPIRED, now
        else:
            batch.status, batch.completed_at = COMPLETED, now
        batch.save()
    return batch.public_id


def states(batch_ids: Collection[int]) -> dict[int, tuple[str, float]]:
    """The status and expiry (epoch seconds) of each of these batches."""
    rows = Batch.objects.filter(pk__in=list(batch_ids)).values_list("pk", "status", "expires_at")
    return {pk: (status, expires.timestamp()) for pk, status, expires in rows}


def overview(recent: int = 10) -> list[dict[str, Any]]:
    """The batches with work left, and the last few ended (dashboard, metrics)."""
    fields = (
        "public_id",
        "api",
        "key__name",
        "endpoint",
        "status",
        "total",
        "succeeded",
        "errored",
        "canceled",
        "expired",
        "created_at",
        "expires_at",
    )
    active = list(Batch.objects.filter(status__in=ACTIVE).order_by("pk").values(*fields)[:200])
    ended = list(Batch.objects.exclude(status__in=ACTIVE).order_by("-pk").values(*fields)[:recent])
    rows = []
    for row in active + ended:
        row["id"] = row.pop("public_id")
        row["key"] = row.pop("key__name")
        row["created_at"] = row["created_at"].timestamp()
        row["expires_at"] = row["expires_at"].timestamp()
        rows.append(row)
    return rows


def prune(retention_days: int) -> int:
    """Delete ended batches (their lines and output files) and uploads older than
    the retention; returns how many batches went."""
    cutoff = timezone.now() - dt.timedelta(days=retention_days)
    old = Batch.objects.exclude(status__in=ACTIVE).filter(created_at__lt=cutoff)
    ids = list(old.values_list("pk", flat=True)[:1000])
    BatchLine.objects.filter(batch_id__in=ids).delete()
    StoredFile.objects.filter(batch_id__in=ids).delete()
    Batch.objects.filter(pk__in=ids).delete()
    StoredFile.objects.filter(batch__isnull=True, created_at__lt=cutoff).delete()
    return len(ids)
