"""The engine's database work: validating batches, claiming lines, writing results,
ending batches.

Every function is synchronous and runs in the engine's database thread. A line is
held by one process at a time: claiming sets its ``claim_token`` and an expiry in
the same statement that checks nobody else holds it (``SELECT ... FOR UPDATE SKIP
LOCKED`` first on PostgreSQL, so concurrent claimers pass each other by; SQLite
serialises writers anyway), and its result is written only with that token. A
process that dies leaves claims that lapse after BATCH_CLAIM_SECS; whoever claims
the line next runs it again. Each line ends once: its result, and the batch's tally
of it, are written in one transaction.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter, defaultdict
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
    CLAIMED,
    COMPLETED,
    DONE,
    ERRORED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    LINE_EXPIRED,
    OPENAI,
    PENDING,
    SUCCEEDED,
    VALIDATING,
    Batch,
    BatchLine,
    StoredFile,
    claimable,
    new_id,
)
from relay.server.batches import store
from relay.server.batches.lines import LineSpec, openai_lines, problem

#: Most running batches one claim looks at (in turns, so every one gets some).
MAX_BATCHES_PER_CLAIM = 100
#: The tally each outcome adds to.
TALLY = {SUCCEEDED: "succeeded", ERRORED: "errored", CANCELED: "canceled", LINE_EXPIRED: "expired"}


@dataclass(slots=True)
class Claimed:
    """A line this process holds: what to send, and what it needs to run it."""

    line_id: int
    token: str
    batch_id: int
    api: str
    key_id: int | None
    endpoint: str
    custom_id: str
    model: str
    body: str
    failures: int
    #: Loop time before which it is not tried again (after a refusal).
    not_before: float = 0.0


@dataclass(frozen=True, slots=True)
class Result:
    """How a line ended here; no ``outcome``: it goes back to be claimed again."""

    line_id: int
    token: str
    batch_id: int
    failures: int
    outcome: str = ""
    status_code: int | None = None
    response: str = ""
    error_code: str = ""
    error_message: str = ""
    request_id: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


# ------------------------------------------------------------------------- validation


@dataclass(frozen=True, slots=True)
class Limits:
    max_lines: int
    max_model_len: int
    max_queued: int
    lease_secs: float


def validate_next(token: str, known: frozenset[str], limits: Limits) -> str | None:
    """Check the lines of one batch waiting for validation and start it or fail it;
    returns its id (None when none waits). The batch is leased while its file is
    read, so one process validates it."""
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
    content = (
        StoredFile.objects.filter(public_id=batch.input_file_id, batch__isnull=True)
        .values_list("content", flat=True)
        .first()
    )
    specs: list[LineSpec] = []
    if content is None:
        errors = [problem("file_not_found", "The input file was deleted")]
    else:
        specs, errors = openai_lines(
            bytes(content),
            batch.endpoint,
            max_lines=limits.max_lines,
            max_model_len=limits.max_model_len,
            known=known.__contains__,
        )
    with transaction.atomic():
        if not errors and store.queued_lines(batch.key_id, lock=True) + len(specs) > (
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
            return batch.public_id  # cancelled meanwhile, or another process took over
        now = timezone.now()
        current.lease_token, current.lease_until = "", None
        if errors:
            current.status, current.failed_at, current.errors = FAILED, now, errors
        else:
            current.status, current.in_progress_at, current.total = IN_PROGRESS, now, len(specs)
            store.insert_lines(current, specs, now)
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
    return batch.public_id


# ------------------------------------------------------------------------- claims


def claim(
    token: str,
    models: Collection[str] | None,
    limit: int,
    claim_secs: float,
    turn: int,
    paused_keys: Collection[int] = (),
) -> list[Claimed]:
    """Claim up to ``limit`` lines of running batches (for ``models`` only, unless
    None; none of ``paused_keys``' batches), an equal share from each batch, starting
    at batch number ``turn``."""
    now = timezone.now()
    with transaction.atomic():
        running = list(
            Batch.objects.filter(status=IN_PROGRESS, expires_at__gt=now)
            .exclude(key_id__in=list(paused_keys))
            .order_by("pk")
            .values_list("pk", flat=True)[: MAX_BATCHES_PER_CLAIM * 10]
        )
        if not running:
            return []
        start = turn % len(running)
        running = (running[start:] + running[:start])[:MAX_BATCHES_PER_CLAIM]
        share = max(1, math.ceil(limit / len(running)))
        chosen: list[int] = []
        for batch_id in running:
            if len(chosen) >= limit:
                break
            rows = BatchLine.objects.filter(batch_id=batch_id).filter(claimable(now))
            if models is not None:
                rows = rows.filter(model__in=list(models))
            take = min(share, limit - len(chosen))
            chosen += list(
                rows.select_for_update(skip_locked=True)
                .order_by("index")
                .values_list("pk", flat=True)[:take]
            )
        if not chosen:
            return []
        until = now + dt.timedelta(seconds=claim_secs)
        BatchLine.objects.filter(pk__in=chosen).filter(claimable(now)).update(
            state=CLAIMED, claim_token=token, claimed_until=until
        )
        held = (
            BatchLine.objects.filter(pk__in=chosen, claim_token=token, state=CLAIMED)
            .order_by("batch_id", "index")
            .values_list(
                "pk",
                "batch_id",
                "batch__api",
                "batch__key_id",
                "batch__endpoint",
                "custom_id",
                "model",
                "body",
                "failures",
            )
        )
        return [
            Claimed(pk, token, batch, api, key, endpoint, custom_id, model, body, failures)
            for pk, batch, api, key, endpoint, custom_id, model, body, failures in held
        ]


def renew(tokens: Collection[str], claim_secs: float) -> int:
    """Extend the claims of lines this process still holds; returns how many."""
    if not tokens:
        return 0
    until = timezone.now() + dt.timedelta(seconds=claim_secs)
    return BatchLine.objects.filter(claim_token__in=list(tokens), state=CLAIMED).update(
        claimed_until=until
    )


def record(results: list[Result]) -> int:
    """Write how lines ended (or hand them back); returns how many ended here. A
    line whose claim another process took over since is left as that one writes it."""
    now = timezone.now()
    tallies: dict[int, Counter[str]] = defaultdict(Counter)
    ended = 0
    with transaction.atomic():
        for r in results:
            rows = BatchLine.objects.filter(pk=r.line_id, claim_token=r.token, state=CLAIMED)
            if not r.outcome:
                rows.update(state=PENDING, claim_token="", claimed_until=None, failures=r.failures)
                continue
            written = rows.update(
                state=DONE,
                outcome=r.outcome,
                claim_token="",
                claimed_until=None,
                failures=r.failures,
                status_code=r.status_code,
                response=r.response,
                error_code=r.error_code,
                error_message=r.error_message,
                request_id=r.request_id,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                finished_at=now,
            )
            if written:
                ended += 1
                tally = tallies[r.batch_id]
                tally[TALLY[r.outcome]] += 1
                tally["input_tokens"] += r.prompt_tokens or 0
                tally["output_tokens"] += r.completion_tokens or 0
        for batch_id, tally in tallies.items():
            Batch.objects.filter(pk=batch_id).update(
                **{field: F(field) + count for field, count in tally.items() if count}
            )
    return ended


# ------------------------------------------------------------------------- ending


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
