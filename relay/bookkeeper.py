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
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

from relay.keycache import KeyCache, Usage
from relay.stats import RequestRecord

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

    def observe(self, record: RequestRecord) -> None:
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1  # the oldest unwritten record falls off; counted, not fatal
        self.pending.append(record)

    async def run(self) -> None:
        """Flush forever; cancelled by the runtime on shutdown (after a last flush)."""
        while True:
            await asyncio.sleep(self.flush_interval)
            await self.flush()

    async def flush(self) -> None:
        await self._flush_requests()
        await self._flush_usage()
        now = time.monotonic()
        if now - self._last_prune >= PRUNE_EVERY:
            self._last_prune = now
            try:
                await in_thread(prune, self.retention_days)
            except Exception:
                logger.exception("pruning old audit rows failed")

    async def _flush_requests(self) -> None:
        while self.pending:
            batch = [self.pending.popleft() for _ in range(min(self.batch_size, len(self.pending)))]
            try:
                await in_thread(write_request_log, batch)
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
            await in_thread(write_key_usage, usage)
        except Exception:
            self.failures += 1
            logger.exception("writing API key usage failed; will retry")
            self.keys.restore_usage(usage)


def _aware(timestamp: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.UTC)


def write_request_log(batch: list[RequestRecord]) -> None:
    from workers_app.models import RequestLog

    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=r.request_id,
                api_key_id=r.key_id,
                provider=r.provider[:64],
                model=r.model[:256],
                endpoint=r.endpoint[:64],
                worker_id=r.worker_id or "",
                worker_name=(r.worker_name or "")[:200],
                status=r.status,
                outcome=r.outcome,
                streamed=r.streamed,
                queue_wait_ms=r.queue_wait * 1000,
                ttfb_ms=None if r.ttfb is None else r.ttfb * 1000,
                duration_ms=r.duration * 1000,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                requeues=r.requeues,
                cancel_reason=r.cancel_reason or "",
                created_at=_aware(r.created_at),
            )
            for r in batch
        ]
    )


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
    from workers_app.models import RequestLog
    from workers_app.services import prune_sessions

    cutoff = dt.datetime.now(tz=dt.UTC) - dt.timedelta(days=days)
    logs, _ = RequestLog.objects.filter(created_at__lt=cutoff).delete()
    sessions = prune_sessions(days)
    if logs or sessions:
        logger.info("pruned %d request-log rows and %d worker sessions", logs, sessions)
