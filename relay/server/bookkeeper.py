"""Writes what the relay did to the database, in batches, off the request path.

Request observers only append to memory; a background task owned by the runtime
flushes every ``REQUEST_LOG_FLUSH_SECS``: request-log rows (``bulk_create``), API-key
usage and ``last_used_at`` (one UPDATE per key that was used), and once an hour it
prunes audit rows older than ``AUDIT_RETENTION_DAYS``. A database error is logged
and the batch retried on the next flush; requests never wait for any of this.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

from relay.core.keycache import KeyCache, Usage
from relay.core.stats import RequestRecord

logger = logging.getLogger("relay.bookkeeper")

PRUNE_EVERY = 3600.0
T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ORM work in a pool thread and release that thread's connection afterwards."""

    def call() -> T:
        from django.db import connections

        try:
            return fn(*args)
        finally:
            connections.close_all()

    return await sync_to_async(call, thread_sensitive=False)()


class _DatabaseThread:
    """One long-lived thread for the bookkeeper's writes, keeping its connection open
    between flushes (reconnecting every second would cost more than the writes)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-bookkeeper")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    @staticmethod
    def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        from django.db import connections

        try:
            return fn(*args)
        except Exception:
            connections.close_all()  # start the next attempt from a fresh connection
            raise

    async def aclose(self) -> None:
        """Close the thread's connection after the writes already queued, then let the
        thread go; the event loop never blocks on it."""
        from django.db import connections

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, connections.close_all)
        finally:
            self._executor.shutdown(wait=False)


class Bookkeeper:
    def __init__(
        self,
        keys: KeyCache,
        *,
        flush_interval: float = 1.0,
        retention_days: int = 30,
        max_pending: int = 100_000,
        batch_size: int = 1000,
    ) -> None:
        self.keys = keys
        self.flush_interval = flush_interval
        self.retention_days = retention_days
        self.batch_size = batch_size
        self.pending: deque[RequestRecord] = deque(maxlen=max_pending)
        self.dropped = 0
        self.failures = 0
        self._last_prune = 0.0
        self._db = _DatabaseThread()

    def observe(self, record: RequestRecord) -> None:
        if record.relay_role == "origin":
            return  # the process with the worker writes the row: it has the tokens
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1  # the oldest unwritten record falls off; counted, not fatal
        self.pending.append(record)

    async def run(self) -> None:
        """Flush forever; cancelled by the runtime on shutdown (after a last flush)."""
        try:
            while True:
                await asyncio.sleep(self.flush_interval)
                await self.flush()
        finally:
            await self._db.aclose()

    async def flush(self) -> None:
        await self._flush_requests()
        await self._flush_usage()
        now = time.monotonic()
        if now - self._last_prune >= PRUNE_EVERY:
            self._last_prune = now
            try:
                await self._db.run(prune, self.retention_days)
            except Exception:
                logger.exception("pruning old audit rows failed")

    async def _flush_requests(self) -> None:
        while self.pending:
            batch = [self.pending.popleft() for _ in range(min(self.batch_size, len(self.pending)))]
            try:
                await self._db.run(write_request_log, batch)
            except Exception:
                self.failures += 1
                logger.exception("writing %d request-log rows failed; will retry", len(batch))
                self.pending.extendleft(reversed(batch))
                return

    async def _flush_usage(self) -> None:
        usage = self.keys.take_usage()
        if not usage:
            return
        try:
            await self._db.run(write_key_usage, usage)
        except Exception:
            self.failures += 1
            logger.exception("writing API key usage failed; will retry")
            self.keys.restore_usage(usage)


def _aware(timestamp: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.UTC)


def _timestamp_adapter(connection: Any) -> Callable[[float], Any]:
    """A Unix time as ``connection`` stores a datetime column. For SQLite that is
    the naive time in the connection's zone as text, which Django's own adapter
    derives through several checks per value: here, once per batch."""
    tz = connection.timezone
    if connection.vendor == "sqlite" and tz is not None:
        return lambda timestamp: str(dt.datetime.fromtimestamp(timestamp, tz).replace(tzinfo=None))
    adapt = connection.ops.adapt_datetimefield_value
    return lambda timestamp: adapt(_aware(timestamp))


_LOG_COLUMNS = (
    "request_id",
    "api_key_id",
    "provider",
    "model",
    "endpoint",
    "worker_id",
    "worker_name",
    "status",
    "outcome",
    "streamed",
    "queue_wait_ms",
    "ttfb_ms",
    "duration_ms",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "tokens_estimated",
    "requeues",
    "cancel_reason",
    "service_class",
    "preemptions",
    "resumable",
    "created_at",
)


def write_request_log(batch: list[RequestRecord]) -> None:
    """One multi-row INSERT per batch: at a thousand requests a second, building ORM
    instances for every row would cost the server more than relaying them."""
    from django.db import connection, transaction

    from workers_app.models import RequestLog

    ops = connection.ops
    stamp = _timestamp_adapter(connection)
    table = ops.quote_name(RequestLog._meta.db_table)
    columns = ", ".join(ops.quote_name(c) for c in _LOG_COLUMNS)
    placeholders = ", ".join(["%s"] * len(_LOG_COLUMNS))
    sql = f"INSERT INTO {table} ({columns}) VALUES ({placeholders})"
    rows = [
        (
            r.request_id,
            r.key_id,
            r.provider[:64],
            r.model[:256],
            r.endpoint[:64],
            r.worker_id or "",
            (r.worker_name or "")[:200],
            r.status,
            r.outcome,
            r.streamed,
            r.queue_wait * 1000,
            None if r.ttfb is None else r.ttfb * 1000,
            r.duration * 1000,
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
            r.tokens_estimated,
            r.requeues,
            r.cancel_reason or "",
            r.service_class,
            min(r.preemptions, 32767),
            r.resume,
            stamp(r.created_at),
        )
        for r in batch
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def write_key_usage(usage: dict[int, Usage]) -> None:
    from django.db.models import F

    from keys.models import ApiKey

    for key_id, used in usage.items():
        # .update() skips auto_now and signals: usage is not a key change.
        ApiKey.objects.filter(id=key_id).update(
            requests=F("requests") + used.requests,
            prompt_tokens=F("prompt_tokens") + used.prompt_tokens,
            completion_tokens=F("completion_tokens") + used.completion_tokens,
            last_used_at=_aware(used.last_used),
        )


def prune(days: int) -> None:
    from workers_app.models import RequestLog, WorkerSession

    cutoff = dt.datetime.now(tz=dt.UTC) - dt.timedelta(days=days)
    logs, _ = RequestLog.objects.filter(created_at__lt=cutoff).delete()
    sessions = WorkerSession.prune(days)
    if logs or sessions:
        logger.info("pruned %d request-log rows and %d worker sessions", logs, sessions)
