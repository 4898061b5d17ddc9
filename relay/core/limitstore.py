"""The counters of the per-key limits in this process's memory (no Redis).

Implements :class:`relay.core.limits.LimitStore` with plain dicts: a few dictionary
operations per admission, no ``await`` that suspends. Everything is keyed by API
key id and bounded by the number of keys (reservations also by the requests in flight,
each of which releases its own when it ends). Token spend survives a restart only
through :meth:`MemoryLimitStore.seed`, which the runtime calls once at start with
the request log's sums for the current day and month.
"""

from __future__ import annotations

from collections.abc import Collection

from relay.core.limits import KeyLimits, Limit, Periods, Refusal

#: Slack for float arithmetic in the rate check (a burst of exactly N must pass).
_EPSILON = 1e-6


class _Spend:
    __slots__ = ("day", "day_tokens", "month", "month_tokens")

    def __init__(self) -> None:
        self.day = self.month = -1
        self.day_tokens = self.month_tokens = 0

    def roll(self, at: Periods) -> None:
        if self.day != at.day:
            self.day, self.day_tokens = at.day, 0
        if self.month != at.month:
            self.month, self.month_tokens = at.month, 0


class MemoryLimitStore:
    def __init__(self) -> None:
        #: Concurrency slots held, per key (absent: none).
        self.slots: dict[int, int] = {}
        #: Tokens reserved by requests in flight, per key (absent: none).
        self.reserved: dict[int, int] = {}
        #: GCRA "theoretical arrival time" per key (Unix time).
        self._tat: dict[int, float] = {}
        self._spend: dict[int, _Spend] = {}

    async def acquire(
        self, key_id: int, limits: KeyLimits, at: Periods, now: float, reserve: int = 0
    ) -> Refusal | None:
        budgeted = limits.budgeted
        reserved = 0
        if budgeted:
            # What requests in flight may still cost counts as spent already.
            reserved = self.reserved.get(key_id, 0)
            day = month = reserved
            spend = self._spend.get(key_id)
            if spend is not None:
                spend.roll(at)
                day += spend.day_tokens
                month += spend.month_tokens
            if limits.tokens_per_month is not None and month >= limits.tokens_per_month:
                return Refusal(Limit.MONTH)
            if limits.tokens_per_day is not None and day >= limits.tokens_per_day:
                return Refusal(Limit.DAY)
        rate = limits.requests_per_minute
        tat = 0.0
        if rate is not None:
            interval = 60.0 / rate
            tat = max(self._tat.get(key_id, 0.0), now)
            slack = 60.0 - interval
            if tat - now > slack + _EPSILON:
                return Refusal(Limit.RATE, tat - slack - now)
            tat += interval
        if limits.max_concurrent is not None:
            held = self.slots.get(key_id, 0)
            if held >= limits.max_concurrent:
                return Refusal(Limit.CONCURRENCY)
            self.slots[key_id] = held + 1
        if rate is not None:
            self._tat[key_id] = tat
        if budgeted and reserve > 0:
            self.reserved[key_id] = reserved + reserve
        return None

    def finish(self, key_id: int, held: bool, tokens: int, at: Periods, reserved: int = 0) -> None:
        if held:
            left = self.slots.get(key_id, 0) - 1
            if left > 0:
                self.slots[key_id] = left
            else:
                self.slots.pop(key_id, None)
        if reserved:
            left = self.reserved.get(key_id, 0) - reserved
            if left > 0:
                self.reserved[key_id] = left
            else:
                self.reserved.pop(key_id, None)
        if tokens:
            self.charge(key_id, tokens, tokens, at)

    def charge(self, key_id: int, day_tokens: int, month_tokens: int, at: Periods) -> None:
        spend = self._spend.get(key_id)
        if spend is None:
            spend = self._spend[key_id] = _Spend()
        spend.roll(at)
        spend.day_tokens += day_tokens
        spend.month_tokens += month_tokens

    def seed(self, spent: dict[int, tuple[int, int]], at: Periods) -> None:
        """Start from what the request log says was spent (today, this month) per key."""
        for key_id, (day_tokens, month_tokens) in spent.items():
            self.charge(key_id, day_tokens, month_tokens, at)

    async def spend(self, key_ids: Collection[int], at: Periods) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for key_id in key_ids:
            spend = self._spend.get(key_id)
            if spend is not None:
                spend.roll(at)
                if spend.month_tokens:
                    out[key_id] = (spend.day_tokens, spend.month_tokens)
        return out
