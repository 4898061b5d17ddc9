"""The per-key limit counters in Redis, shared by every server process (SPEC §11, §13).

Implements :class:`relay.core.limits.LimitStore`. Redis keys, under
``<REDIS_PREFIX>:limits:``:

``live``
    ZSET: server process → the end of its lease (Redis time, ms). Every admission of
    a process renews its lease, and so does its heartbeat, every third of
    ``LIMITS_LEASE_SECS``.
``slots:<key id>``
    HASH: server process → concurrency slots it holds for that key. The admission
    script counts a process's slots only while its lease runs: the slots of a
    process that died stop counting within ``LIMITS_LEASE_SECS``, and its field is
    deleted once it has been gone for an hour. Nothing leaks when a process dies.
``reserved:<key id>``
    HASH: server process → tokens its requests in flight reserved against the key's
    budgets (see :mod:`relay.core.limits`), counted like the slots: only while the
    process's lease runs, so the reservations of a process that died stop counting
    within ``LIMITS_LEASE_SECS``.
``rate:<key id>``
    the request-rate allowance (GCRA: the "theoretical arrival time", ms), expiring
    two minutes after it was last moved.
``day:<key id>:<day>``, ``month:<key id>:<month>``
    tokens spent (UTC day and month numbers, see :class:`relay.core.limits.Periods`),
    expiring a day after their period ends.

Admission is one ``EVALSHA`` of :data:`ADMIT`: every check and every increment at
once, atomically — one round trip, and none for a key without counted limits. When a
request ends, its slot, its reservation and its tokens are queued here and written by
the store's own task, batched into one pipeline per wake-up: never on the request path.
If such a write fails (or finds less held than it gives back), the tokens are retried
and this process's slot and reservation counts for the keys concerned are re-asserted
from memory by the next heartbeat. Every script sets the expiry of what it writes.

If Redis cannot be reached, :meth:`RedisLimitStore.acquire` raises
:class:`~relay.core.limits.LimitStoreUnavailable` and the limiter admits without the
counted limits (logged, counted in ``/admin/stats``): the relay keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.core.limits import DAY, KeyLimits, Limit, LimitStoreUnavailable, Periods, Refusal
from relay.server.cluster.leanredis import Script, lean_client
from relay.server.cluster.scripts import lua

logger = logging.getLogger("relay.limits")

#: The longest a limit check may wait for Redis before the request is admitted without it.
REDIS_TIMEOUT_SECS = 2.0
#: A process gone this long is forgotten (its slot fields deleted).
FORGET_MS = 3_600_000
#: Token charges kept for retry while Redis is unreachable (beyond: dropped, logged).
MAX_PENDING = 100_000

#: The limit scripts, kept as ``.lua`` files next to the cluster's others (see
#: :mod:`relay.server.cluster.scripts`).
ADMIT = lua("now", "admit")
FINISH = lua("finish")
BEAT = lua("now", "beat")

_REFUSALS = {1: Limit.MONTH, 2: Limit.DAY, 3: Limit.RATE, 4: Limit.CONCURRENCY}
_FAILURES = (RedisError, OSError, TimeoutError)


def _unless_cancelled(exc: BaseException | None = None) -> None:
    """redis-py may swallow a cancellation that lands mid-command, or turn it into a
    connection error: raise it again, so the task ends as asked."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


#: What the token counters of each key should hold (day, month) per the request log, read
#: when Redis lost them (its restart, a flush, an eviction).
SpendSource = Callable[[Periods], Awaitable[dict[int, tuple[int, int]]]]


class RedisLimitStore:
    def __init__(
        self,
        url: str,
        prefix: str,
        instance: str,
        *,
        lease_secs: float = 15.0,
        spend_source: SpendSource | None = None,
        calendar: Callable[[], Periods] | None = None,
    ) -> None:
        """``spend_source`` and ``calendar``: where the tokens spent so far are read
        back from after Redis lost its counters, and the periods of now."""
        # Named, so that CLIENT LIST tells each process's connections and their roles apart.
        self.redis = aioredis.from_url(
            url,
            decode_responses=True,
            socket_timeout=REDIS_TIMEOUT_SECS,
            socket_connect_timeout=REDIS_TIMEOUT_SECS,
            client_name=f"modelrelay:{instance}:limits",
        )
        self.prefix = f"{prefix}:limits"
        self.instance = instance
        self.lease_ms = max(1, int(lease_secs * 1000))
        #: Admission is on the request path: through the lean client where it applies.
        self.lean = lean_client(url, REDIS_TIMEOUT_SECS, f"modelrelay:{instance}:admit")
        self._admit = Script(self.lean, ADMIT) if self.lean else self.redis.register_script(ADMIT)
        self._finish = self.redis.register_script(FINISH)
        self._beat = self.redis.register_script(BEAT)
        #: Slots and reserved tokens this process holds per key: the truth the
        #: heartbeat re-asserts.
        self.held: Counter[int] = Counter()
        self.reserved: Counter[int] = Counter()
        self._repair: set[int] = set()
        self._pending: list[tuple[int, bool, int, Periods, int]] = []
        self._wake = asyncio.Event()
        self._spend_source = spend_source
        self._calendar = calendar
        #: Times this store found its lease gone and re-asserted what it holds.
        self.recoveries = 0

    def _key(self, *parts: object) -> str:
        return ":".join((self.prefix, *map(str, parts)))

    async def acquire(
        self, key_id: int, limits: KeyLimits, at: Periods, now: float, reserve: int = 0
    ) -> Refusal | None:
        keys = [
            self._key("live"),
            self._key("slots", key_id),
            self._key("rate", key_id),
            self._key("day", key_id, at.day),
            self._key("month", key_id, at.month),
            self._key("reserved", key_id),
        ]
        reserving = reserve if limits.budgeted and reserve > 0 else 0
        args: list[str | int] = [
            self.instance,
            self.lease_ms,
            limits.max_concurrent or 0,
            limits.requests_per_minute or 0,
            limits.tokens_per_day or 0,
            limits.tokens_per_month or 0,
            reserving,
        ]
        counted = limits.max_concurrent is not None
        # Before the round trip, so a heartbeat that crosses it cannot re-assert a
        # count without this slot and reservation.
        self._hold(key_id, counted, reserving)
        try:
            code, retry_ms = await self._admit(keys=keys, args=args)
        except _FAILURES as exc:
            self._unhold(key_id, counted, reserving)
            _unless_cancelled(exc)
            raise LimitStoreUnavailable(str(exc) or type(exc).__name__) from exc
        except asyncio.CancelledError:
            if counted or reserving:  # the script may have run: give back either way
                self.finish(key_id, counted, 0, at, reserving)
            raise
        if code == 0:
            try:
                _unless_cancelled()
            except asyncio.CancelledError:
                if counted or reserving:
                    self.finish(key_id, counted, 0, at, reserving)
                raise
            return None
        self._unhold(key_id, counted, reserving)
        return Refusal(_REFUSALS[int(code)], int(retry_ms) / 1000)

    def _hold(self, key_id: int, slot: bool, tokens: int) -> None:
        if slot:
            self.held[key_id] += 1
        if tokens:
            self.reserved[key_id] += tokens

    def _unhold(self, key_id: int, slot: bool, tokens: int) -> None:
        for counts, amount in ((self.held, int(slot)), (self.reserved, tokens)):
            if amount:
                left = counts[key_id] - amount
                if left > 0:
                    counts[key_id] = left
                else:
                    counts.pop(key_id, None)

    def finish(self, key_id: int, held: bool, tokens: int, at: Periods, reserved: int = 0) -> None:
        self._unhold(key_id, held, reserved)
        if len(self._pending) < MAX_PENDING:
            self._pending.append((key_id, held, tokens, at, reserved))
        else:
            logger.warning("limit store backlog full: dropping a token charge of key %s", key_id)
            if held or reserved:
                self._repair.add(key_id)
        self._wake.set()

    async def spend(self, key_ids: Collection[int], at: Periods) -> dict[int, tuple[int, int]]:
        ids = list(key_ids)
        if not ids:
            return {}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.mget([self._key("day", k, at.day) for k in ids])
                pipe.mget([self._key("month", k, at.month) for k in ids])
                days, months = await pipe.execute()
        except _FAILURES as exc:
            _unless_cancelled(exc)
            raise LimitStoreUnavailable(str(exc) or type(exc).__name__) from exc
        out = {}
        for key_id, day, month in zip(ids, days, months, strict=True):
            if month:
                out[key_id] = (int(day or 0), int(month))
        return out

    async def run(self) -> None:
        """Owned by the runtime: write what ended, renew this process's lease. On
        cancel, a last write and the lease dropped, so others need not wait it out."""
        every = self.lease_ms / 3000
        loop = asyncio.get_running_loop()
        next_beat = 0.0
        try:
            while True:
                if loop.time() >= next_beat:
                    await self._heartbeat()
                    _unless_cancelled()
                    next_beat = loop.time() + every
                # A timer, not asyncio.timeout(): nothing here may take a cancel for
                # a timeout.
                beat = loop.call_at(next_beat, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    beat.cancel()
                self._wake.clear()
                await self._write()
                _unless_cancelled()
        finally:
            await self._leave()

    async def _leave(self) -> None:
        """Last writes and the lease dropped, while the task is being cancelled."""
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        for _ in range(cancels):  # so that the writes below are not cut short
            task.uncancel()  # type: ignore[union-attr]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_SECS):
                await self._write()
                await self.redis.zrem(self._key("live"), self.instance)
        except (*_FAILURES, asyncio.CancelledError):
            logger.warning("could not leave the limit store cleanly", exc_info=True)
        finally:
            if self.lean is not None:
                await self.lean.aclose()
            await self.redis.aclose()
            if task is not None and cancels:
                task.cancel()  # still on its way out: the caller's cancel stands

    async def _write(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id, held, tokens, at, reserved in batch:
                    now = at.day_ends - DAY  # within the day; TTLs need not be exact
                    await self._finish(
                        keys=[
                            self._key("slots", key_id),
                            self._key("day", key_id, at.day),
                            self._key("month", key_id, at.month),
                            self._key("reserved", key_id),
                        ],
                        args=[
                            self.instance,
                            1 if held else 0,
                            tokens,
                            int((at.day_ends - now + DAY) * 1000),
                            int((at.month_ends - now + DAY) * 1000),
                            reserved,
                        ],
                        client=pipe,
                    )
                shorts = await pipe.execute()
        except (*_FAILURES, asyncio.CancelledError) as exc:
            self._repair.update(k for k, held, _, _, reserved in batch if held or reserved)
            retry = [(k, False, tokens, at, 0) for k, _, tokens, at, _ in batch if tokens]
            self._pending[:0] = retry[: MAX_PENDING - len(self._pending)]
            if isinstance(exc, asyncio.CancelledError):
                raise
            _unless_cancelled(exc)
            logger.warning("could not write %d finished request(s) to Redis: %s", len(batch), exc)
            return
        # Redis held less for this process than it gave back (it lost some): re-assert.
        self._repair.update(entry[0] for entry, short in zip(batch, shorts, strict=True) if short)

    async def _heartbeat(self) -> None:
        repair, self._repair = self._repair, set()
        keys = [self._key("live")]
        args: list[str | int] = [self.instance, self.lease_ms, FORGET_MS]
        for key_id in repair:  # this process's counts, as it knows them
            keys += [self._key("slots", key_id), self._key("reserved", key_id)]
            args += [self.held.get(key_id, 0), self.reserved.get(key_id, 0)]
        try:
            lost = await self._beat(keys=keys, args=args)
        except _FAILURES as exc:
            self._repair |= repair
            _unless_cancelled(exc)
            logger.warning("could not renew this process's lease in Redis: %s", exc)
            return
        if int(lost):
            await self._recover()

    async def _recover(self) -> None:
        """Our lease was gone: Redis may have lost every counter. Re-assert the slots and
        reservations this process holds, and put back the tokens spent so far where a
        counter is missing (from the request log, which every process writes: the first
        to get there wins)."""
        self.recoveries += 1
        logger.warning("limit store: this process's lease was gone; re-asserting its slots")
        self._repair |= set(self.held) | set(self.reserved)
        if self._spend_source is None or self._calendar is None:
            return
        at = self._calendar()
        try:
            spend = await self._spend_source(at)
        except Exception:
            logger.warning("could not read the tokens spent from the request log", exc_info=True)
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id, (day, month) in spend.items():
                    now = at.day_ends - DAY
                    pipe.set(
                        self._key("day", key_id, at.day),
                        day,
                        nx=True,
                        px=int((at.day_ends - now + DAY) * 1000),
                    )
                    pipe.set(
                        self._key("month", key_id, at.month),
                        month,
                        nx=True,
                        px=int((at.month_ends - now + DAY) * 1000),
                    )
                await pipe.execute()
        except _FAILURES as exc:
            _unless_cancelled(exc)
            logger.warning("could not put the tokens spent back in Redis: %s", exc)
            return
        await self._heartbeat()  # the slots now, not a beat later
