"""Each process's share of a key's limits while the limit store in Redis cannot answer
(SPEC §13, §20).

Behind Sentinel, a failover leaves every process without Redis for seconds; a Redis that
stops answering, longer. Admitting without the counted limits then would let each
process grant the whole limit, so a key would get as many times its limit as there are
processes. Instead each process grants its **share**, from the processes that held a
lease in the limit store at its last heartbeat (:data:`UNKNOWN_PROCESSES` when it never
saw them): ``limit // processes``, and one more for the first ``limit % processes`` of
them in the order of their ids, so the shares add up to the limit exactly. A share may be
0 (a key allowed one request at a time, on two processes: one of them takes it).

- ``max_concurrent``: the requests this process holds for the key (those admitted
  through Redis before it went away included) stay below its share;
- ``requests_per_minute``: its share of the rate, from a fresh allowance;
- ``tokens_per_day``, ``tokens_per_month``: its share of what was left at the last reading
  of the key's spend (``RedisLimitStore.spend``, every ``SYNC_SECS``), counting what it
  charges meanwhile and the tokens its requests in flight reserved (those admitted through
  Redis before it went away included) as spent already, as admission through Redis does.

When Redis answers again its counters are the truth again; the slots and reservations
this process holds and the tokens it charged meanwhile are written there
(:mod:`relay.server.cluster.limits`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from relay.core.limits import KeyLimits, Limit, Periods, Refusal
from relay.core.limitstore import MemoryLimitStore

#: The processes a process counts on when it never saw the limit store: a cluster has
#: at least two.
UNKNOWN_PROCESSES = 2


def share(limit: int, processes: int, rank: int) -> int:
    """The share of ``limit`` of the process ranked ``rank`` (0-based) among ``processes``."""
    base, extra = divmod(limit, processes)
    return base + (1 if rank < extra else 0)


class LimitShare:
    def __init__(self, instance: str) -> None:
        self.instance = instance
        #: The processes holding a lease at the last heartbeat (empty: never seen).
        self.peers: frozenset[str] = frozenset()
        #: Tokens spent per key (today, this month) as last read from Redis.
        self.known_spend: dict[int, tuple[int, int]] = {}
        self._local = MemoryLimitStore()
        self._spent_from: dict[int, tuple[int, int]] = {}

    def place(self) -> tuple[int, int]:
        """(processes, this process's rank among them)."""
        if not self.peers:
            return UNKNOWN_PROCESSES, 0
        ordered = sorted(self.peers | {self.instance})
        return len(ordered), ordered.index(self.instance)

    def begin(self, at: Periods) -> None:
        """Redis just went away: start from the spend last read, with a fresh rate."""
        self._local = MemoryLimitStore()
        self._spent_from = dict(self.known_spend)
        self._local.seed(self._spent_from, at)

    def charge(self, key_id: int, tokens: int, at: Periods) -> None:
        """Tokens a request charged while Redis could not be told."""
        if tokens:
            self._local.charge(key_id, tokens, tokens, at)

    def learned(self, spend: dict[int, tuple[int, int]], key_ids: Collection[int]) -> None:
        """A reading of the keys' spend (those absent spent nothing)."""
        for key_id in key_ids:
            self.known_spend[key_id] = spend.get(key_id, (0, 0))

    async def acquire(
        self,
        key_id: int,
        limits: KeyLimits,
        at: Periods,
        now: float,
        held: int,
        reserved: int = 0,
    ) -> Refusal | None:
        """Admit one request of ``key_id`` within this process's share (``held``: the
        concurrency slots it holds for the key now; ``reserved``: the tokens its requests
        in flight reserved against the key's budgets, which count as spent). Counts its
        rate; the caller counts its slot and its reservation."""
        processes, rank = self.place()
        most = limits.max_concurrent
        if most is not None and held >= share(most, processes, rank):
            return Refusal(Limit.CONCURRENCY)
        rate = limits.requests_per_minute
        if rate is not None and share(rate, processes, rank) == 0:
            return Refusal(Limit.RATE, 60.0)
        day, month = self._spent_from.get(key_id, (0, 0))
        local = dataclasses.replace(
            limits,
            max_concurrent=None,
            requests_per_minute=None if rate is None else share(rate, processes, rank),
            tokens_per_day=_budget(limits.tokens_per_day, day, processes, rank, reserved),
            tokens_per_month=_budget(limits.tokens_per_month, month, processes, rank, reserved),
        )
        return await self._local.acquire(key_id, local, at, now)


def _budget(limit: int | None, spent: int, processes: int, rank: int, reserved: int) -> int | None:
    """What may be spent in all, counting ``spent``: that plus a share of what is left,
    less what is ``reserved`` of the share (the local store counts what was charged)."""
    if limit is None:
        return None
    return spent + share(max(0, limit - spent), processes, rank) - reserved
