"""Claiming batch lines and writing how they ended: the engine's hot database work.

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

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from batches.models import (
    CANCELED,
    CLAIMED,
    DONE,
    ERRORED,
    IN_PROGRESS,
    LINE_EXPIRED,
    PENDING,
    SUCCEEDED,
    Batch,
    BatchLine,
    claimable,
)

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
    #: Loop time at which this process claimed it (or last handed it a slot).
    since: float = 0.0


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
    cached_tokens: int | None = None


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
                cached_tokens=r.cached_tokens,
                finished_at=now,
            )
            if written:
                ended += 1
                tally = tallies[r.batch_id]
                tally[TALLY[r.outcome]] += 1
                tally["input_tokens"] += r.prompt_tokens or 0
                tally["output_tokens"] += r.completion_tokens or 0
                tally["cached_tokens"] += r.cached_tokens or 0
        for batch_id, tally in tallies.items():
            Batch.objects.filter(pk=batch_id).update(
                **{field: F(field) + count for field, count in tally.items() if count}
            )
    return ended
