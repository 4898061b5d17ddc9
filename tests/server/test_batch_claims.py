"""The batch engine's database work on the real database (SQLite, and PostgreSQL in
its pass): lines claimed by one holder at a time, results written once, batches
ended once however many processes try."""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter

import pytest
from django.db import connections
from django.utils import timezone

from batches.models import (
    CANCELLING,
    CLAIMED,
    DONE,
    IN_PROGRESS,
    PENDING,
    SUCCEEDED,
    Batch,
    BatchLine,
    StoredFile,
    new_id,
)
from relay.server.batches import claims, lifecycle, store
from relay.server.batches.checker import Checker
from relay.server.batches.claims import Result
from relay.server.batches.lines import LineSpec

pytestmark = pytest.mark.django_db(transaction=True)


def running_batch(lines: int, **fields: object) -> Batch:
    now = timezone.now()
    batch = Batch.objects.create(
        public_id=new_id("batch_"),
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        status=IN_PROGRESS,
        expires_at=now + dt.timedelta(hours=1),
        total=lines,
        **fields,
    )
    specs = [LineSpec(i, f"c{i}", "m", '{"model": "m"}') for i in range(lines)]
    store.insert_lines(batch, specs, now)
    return batch


def succeeded(line: claims.Claimed) -> Result:
    return Result(line.line_id, line.token, line.batch_id, 0, SUCCEEDED, 200, "{}", prompt_tokens=1)


def in_threads(count: int, work) -> list:
    """Run ``work(i)`` in ``count`` threads at once; their results, in order."""
    results: list = [None] * count
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            start.wait(timeout=10)
            results[index] = work(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


def test_concurrent_claimers_never_hold_the_same_line():
    batch = running_batch(120)

    def claim_all(index: int) -> list[int]:
        mine: list[int] = []
        while True:
            got = claims.claim(f"holder-{index}", None, 7, 60, index)
            if not got:
                return mine
            mine += [line.line_id for line in got]

    held = in_threads(4, claim_all)
    every = [line_id for ids in held for line_id in ids]
    assert len(every) == len(set(every)) == 120
    rows = BatchLine.objects.filter(batch=batch)
    assert set(rows.values_list("state", flat=True)) == {CLAIMED}
    for index, ids in enumerate(held):
        tokens = set(rows.filter(pk__in=ids).values_list("claim_token", flat=True))
        assert tokens == {f"holder-{index}"} or not ids


def test_a_lapsed_claim_is_taken_over_and_only_the_new_holder_writes_the_result():
    batch = running_batch(1)
    (first,) = claims.claim("dead", None, 10, 0, 0)  # its claim lapses at once
    (second,) = claims.claim("alive", None, 10, 60, 0)
    assert first.line_id == second.line_id
    assert claims.claim("third", None, 10, 60, 0) == []  # held, and not lapsed
    assert claims.record([succeeded(first)]) == 0
    assert claims.record([succeeded(second)]) == 1
    assert claims.record([succeeded(second)]) == 0  # ended once
    batch.refresh_from_db()
    assert (batch.succeeded, batch.input_tokens) == (1, 1)
    line = BatchLine.objects.get(batch=batch)
    assert (line.state, line.outcome, line.claim_token) == (DONE, SUCCEEDED, "")


def test_a_line_handed_back_is_claimed_again_with_its_failures_kept():
    running_batch(1)
    (line,) = claims.claim("a", None, 10, 60, 0)
    claims.record([Result(line.line_id, line.token, line.batch_id, failures=2)])
    row = BatchLine.objects.get(pk=line.line_id)
    assert (row.state, row.claim_token, row.failures) == (PENDING, "", 2)
    (again,) = claims.claim("b", None, 10, 60, 0)
    assert again.failures == 2


def test_claims_take_a_share_of_every_running_batch_and_only_models_asked_for():
    first, second = running_batch(10), running_batch(10)
    got = claims.claim("a", None, 6, 60, 0)
    assert Counter(line.batch_id for line in got) == {first.pk: 3, second.pk: 3}
    assert claims.claim("b", ["other-model"], 6, 60, 0) == []
    Batch.objects.filter(pk=second.pk).update(key=None)
    assert claims.claim("c", ["m"], 4, 60, 1, paused_keys=[]) != []


def test_a_claim_is_renewed_while_held():
    running_batch(2)
    lines = claims.claim("a", None, 10, 0, 0)
    assert claims.renew({"a"}, 60) == 2
    assert claims.claim("b", None, 10, 60, 0) == []
    assert all(line.token == "a" for line in lines)


def test_sweeping_a_cancelled_batch_ends_what_nobody_holds_then_the_batch():
    batch = running_batch(3)
    (held,) = claims.claim("a", None, 1, 60, 0)
    Batch.objects.filter(pk=batch.pk).request_cancel()
    assert lifecycle.sweep() == []  # one line is still held: the batch waits for it
    rows = BatchLine.objects.filter(batch=batch)
    assert Counter(rows.values_list("outcome", flat=True)) == {"canceled": 2, "": 1}
    claims.record([succeeded(held)])
    assert lifecycle.sweep() == [batch.public_id]
    batch.refresh_from_db()
    assert (batch.status, batch.succeeded, batch.canceled) == ("cancelled", 1, 2)
    assert batch.cancelled_at is not None and batch.output_file_id and batch.error_file_id


def test_a_batch_is_finished_once_whoever_tries():
    batch = running_batch(4)
    for line in claims.claim("a", None, 10, 60, 0):
        claims.record([succeeded(line)])
    finished = in_threads(3, lambda index: lifecycle.finish(batch.pk))
    assert [name for name in finished if name] == [batch.public_id]
    batch.refresh_from_db()
    assert batch.status == "completed" and batch.finalizing_at is not None
    assert StoredFile.objects.filter(batch=batch).count() == 1
    assert lifecycle.finish(batch.pk) is None


def test_an_expired_batch_ends_its_lines_as_expired():
    batch = running_batch(2)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert claims.claim("a", None, 10, 60, 0) == []  # no line of it is started any more
    assert lifecycle.sweep() == [batch.public_id]
    batch.refresh_from_db()
    assert (batch.status, batch.expired) == ("expired", 2)


def test_a_batch_cancelled_before_its_validation_ends_cancelled_with_no_line():
    upload = StoredFile.objects.create(public_id=new_id("file-"), purpose="batch", filename="x")
    batch = Batch.objects.create(
        public_id=new_id("batch_"),
        endpoint="/v1/chat/completions",
        input_file_id=upload.public_id,
        expires_at=timezone.now() + dt.timedelta(hours=1),
    )
    Batch.objects.filter(pk=batch.pk).request_cancel()
    limits = lifecycle.Limits(
        max_lines=10, max_model_len=64, max_queued=100, lease_secs=60, max_request_bytes=1024
    )
    checker = Checker()  # never started: nothing to check
    assert lifecycle.validate_next("a", frozenset({"m"}), limits, checker) is None
    assert lifecycle.sweep() == [batch.public_id]
    batch.refresh_from_db()
    assert batch.status == "cancelled" and batch.total == 0
    assert Batch.objects.filter(status=CANCELLING).count() == 0
