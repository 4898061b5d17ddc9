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

If Redis cannot be reached (or does not answer within ``REDIS_TIMEOUT_SECS``),
:meth:`RedisLimitStore.acquire` admits within this process's share of each limit
(:mod:`relay.server.cluster.limitshare`; a budget's share counts the tokens this
process's requests in flight reserved), and goes on doing so without asking Redis until
a heartbeat (every :data:`RETRY_SECS` meanwhile) gets through: the relay keeps serving,
and no key gets more than its limit from the cluster as a whole. Then the slots and the
reservations this process holds are re-asserted (by that heartbeat's script) and the
tokens it charged meanwhile written. After Sentinel moved the master, the new one may
lack the last writes of the old one: the same recovery as for a lost lease runs at once,
which raises the token counters to the request log's figures (never lowers one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection

from redis.exceptions import RedisError

from relay.core.limits import DAY, KeyLimits, Limit, LimitStoreUnavailable, Periods, Refusal
from relay.server.cluster.leanredis import Script
from relay.server.cluster.limitshare import LimitShare
from relay.server.cluster.redissource import RedisSource, source_of
from relay.server.cluster.scripts import lua

logger = logging.getLogger("relay.limits")

#: While Redis does not answer, a heartbeat tries again this often.
RETRY_SECS = 0.5
#: Heartbeats sent at once, when Redis answers again, for the admissions by share made
#: while the one before was on its way.
CATCH_UP_BEATS = 3
#: A process gone this long is forgotten (its slot fields deleted).
FORGET_MS = 3_600_000
#: Token charges kept for retry while Redis is unreachable (beyond: dropped, logged).
MAX_PENDING = 100_000

#: The limit scripts, kept as ``.lua`` files next to the cluster's others (see
#: :mod:`relay.server.cluster.scripts`).
ADMIT = lua("now", "admit")
FINISH = lua("finish")
BEAT = lua("now", "beat")
ATLEAST = lua("atleast")
PEERS = lua("now", "peers")

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
        redis: str | RedisSource,
        prefix: str,
        instance: str,
        *,
        lease_secs: float = 15.0,
        spend_source: SpendSource | None = None,
        calendar: Callable[[], Periods] | None = None,
    ) -> None:
        """``redis``: where Redis is (the process's :class:`RedisSource`, or a URL);
        ``spend_source`` and ``calendar``: where the tokens spent so far are read back
        from after Redis lost its counters, and the periods of now."""
        source = source_of(redis)
        #: The longest a limit check waits for Redis before this process's share decides.
        self.timeout = source.target.timeout
        # Named, so that CLIENT LIST tells each process's connections and their roles apart.
        self.redis = source.client(f"modelrelay:{instance}:limits", decode_responses=True)
        self.prefix = f"{prefix}:limits"
        self.instance = instance
        self.lease_ms = max(1, int(lease_secs * 1000))
        #: Admission is on the request path: through the lean client where it applies.
        self.lean = source.lean(f"modelrelay:{instance}:admit")
        self._admit = Script(self.lean, ADMIT) if self.lean else self.redis.register_script(ADMIT)
        self._finish = self.redis.register_script(FINISH)
        self._beat = self.redis.register_script(BEAT)
        self._atleast = self.redis.register_script(ATLEAST)
        self._peers = self.redis.register_script(PEERS)
        #: This process's share of each limit, while Redis cannot answer.
        self.share = LimitShare(instance)
        #: Set while Redis did not answer: admissions go by the share without asking it.
        self.down = False
        #: Requests admitted by this process's share (Redis unreachable).
        self.fallbacks = 0
        self._switched = False
        source.on_switch(self._master_switched)
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
        counted = limits.max_concurrent is not None
        reserving = reserve if limits.budgeted and reserve > 0 else 0
        if self.down:
            return await self._by_share(key_id, limits, at, now, reserving)
        keys = [
            self._key("live"),
            self._key("slots", key_id),
            self._key("rate", key_id),
            self._key("day", key_id, at.day),
            self._key("month", key_id, at.month),
            self._key("reserved", key_id),
        ]
        args: list[str | int] = [
            self.instance,
            self.lease_ms,
            limits.max_concurrent or 0,
            limits.requests_per_minute or 0,
            limits.tokens_per_day or 0,
            limits.tokens_per_month or 0,
            reserving,
        ]
        # Before the round trip, so a heartbeat that crosses it cannot re-assert a
        # count without this slot and reservation.
        self._hold(key_id, counted, reserving)
        try:
            code, retry_ms = await self._admit(keys=keys, args=args)
        except _FAILURES as exc:
            self._unhold(key_id, counted, reserving)
            _unless_cancelled(exc)
            self._went_down(exc, at)
            return await self._by_share(key_id, limits, at, now, reserving)
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

    def _went_down(self, exc: BaseException, at: Periods) -> None:
        if self.down:
            return
        self.down = True
        self.share.begin(at)
        processes, _ = self.share.place()
        logger.warning(
            "limit store unreachable (%s): admitting within this process's share of each "
            "limit (1/%d) until Redis answers",
            str(exc) or type(exc).__name__,
            processes,
        )
        self._wake.set()  # the heartbeat tries again soon

    async def _by_share(
        self, key_id: int, limits: KeyLimits, at: Periods, now: float, reserve: int
    ) -> Refusal | None:
        """Admit by this process's share (Redis unreachable): its slots and the tokens
        its requests in flight reserved count against it, those admitted through Redis
        before included; what this admits is written to Redis by the heartbeat that
        gets through."""
        refusal = await self.share.acquire(
            key_id, limits, at, now, self.held.get(key_id, 0), self.reserved.get(key_id, 0)
        )
        if refusal is None:
            self.fallbacks += 1
            counted = limits.max_concurrent is not None
            if counted or reserve:
                self._hold(key_id, counted, reserve)
                self._repair.add(key_id)  # Redis hears of it with the next heartbeat
        return refusal

    def _master_switched(self) -> None:
        """Sentinel moved the master, which may lack the last writes: recover at once."""
        self._switched = True
        self._wake.set()

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
        if self.down:
            self.share.charge(key_id, tokens, at)
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
        self.share.learned(out, ids)
        return out

    async def run(self) -> None:
        """Owned by the runtime: write what ended, renew this process's lease. On
        cancel, a last write and the lease dropped, so others need not wait it out."""
        every = self.lease_ms / 3000
        loop = asyncio.get_running_loop()
        next_beat = 0.0
        try:
            while True:
                if loop.time() >= next_beat or self._switched:
                    await self._heartbeat()
                    _unless_cancelled()
                    next_beat = loop.time() + (RETRY_SECS if self.down else every)
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
            async with asyncio.timeout(2 * self.timeout):
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
        if self.down:
            return  # (kept until a heartbeat gets through: then written at once)
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
            self._went_down(exc, batch[-1][3])
            return
        # Redis held less for this process than it gave back (it lost some): re-assert.
        self._repair.update(entry[0] for entry, short in zip(batch, shorts, strict=True) if short)

    async def _heartbeat(self, catch_up: int = CATCH_UP_BEATS) -> None:
        """Renew this process's lease, learn the processes holding one (the shares), and
        re-assert, in the same script, this process's slot and reservation counts for
        the keys to repair (each hash's expiry set with its write). When Redis answers
        again, admissions go through it only once it counts all of this process's."""
        repair, self._repair = self._repair, set()
        switched, self._switched = self._switched, False
        keys = [self._key("live")]
        args: list[str | int] = [self.instance, self.lease_ms, FORGET_MS]
        for key_id in repair:  # this process's counts, as it knows them
            keys += [self._key("slots", key_id), self._key("reserved", key_id)]
            args += [self.held.get(key_id, 0), self.reserved.get(key_id, 0)]
        # The requests that ended before now are out of those counts: the writes of theirs
        # still waiting must not give back their slots and reservations a second time
        # (those that end from here on are in the counts, and give back theirs).
        settled = len(self._pending)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                await self._beat(keys=keys, args=args, client=pipe)
                await self._peers(keys=[self._key("live")], client=pipe)
                lost, peers = await pipe.execute()
        except _FAILURES as exc:
            self._repair |= repair
            self._switched |= switched
            _unless_cancelled(exc)
            if not self.down:
                logger.warning("could not renew this process's lease in Redis: %s", exc)
            return
        if repair:
            self._pending[:settled] = [
                (entry[0], False, entry[2], entry[3], 0) if entry[0] in repair else entry
                for entry in self._pending[:settled]
            ]
        self.share.peers = frozenset(peers)
        if self.down and self._repair and catch_up:
            # Redis answers again, but this beat carried the counts of when it was sent,
            # maybe a timeout ago: what was admitted by share since is not in them, and
            # Redis would admit on counts short of it. Once more, before it decides alone.
            self._switched |= switched or bool(int(lost))  # (recovered after that beat)
            await self._heartbeat(catch_up - 1)
            return
        if self.down:
            self.down = False
            logger.warning("limit store: Redis answers again; admitting through it")
            self._wake.set()  # the writes kept meanwhile go now
        if int(lost) or switched:
            await self._recover()

    async def _recover(self) -> None:
        """Our lease was gone, or the master moved: Redis may have lost counters (all of
        them, or the last writes). Re-assert the slots and reservations this process
        holds, and raise each token counter to at least what the request log says (which
        every process writes; a counter is never lowered)."""
        self.recoveries += 1
        logger.warning("limit store: Redis may have lost counters; re-asserting this process's")
        # (Also the keys whose last slot or reservation here ended since: Redis may or may
        # not count it.)
        self._repair |= (
            set(self.held)
            | set(self.reserved)
            | {k for k, held, _, _, reserved in self._pending if held or reserved}
        )
        if self._spend_source is None or self._calendar is None:
            return
        at = self._calendar()
        try:
            spend = await self._spend_source(at)
        except Exception:
            logger.warning("could not read the tokens spent from the request log", exc_info=True)
            return
        now = at.day_ends - DAY
        keys: list[str] = []
        args: list[int] = []
        for key_id, (day, month) in spend.items():
            keys += [self._key("day", key_id, at.day), self._key("month", key_id, at.month)]
            args += [day, int((at.day_ends - now + DAY) * 1000)]
            args += [month, int((at.month_ends - now + DAY) * 1000)]
        try:
            if keys:
                await self._atleast(keys=keys, args=args)
        except _FAILURES as exc:
            _unless_cancelled(exc)
            logger.warning("could not put the tokens spent back in Redis: %s", exc)
            return
        await self._heartbeat()  # the slots and reservations now, not a beat later
