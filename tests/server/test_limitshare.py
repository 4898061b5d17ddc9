"""Each process's share of a key's limits while the limit store in Redis cannot answer
(SPEC §13, §20): the shares add up to the limit, never the whole limit per process."""

from __future__ import annotations

import asyncio
import time

import pytest

from relay.core.limits import KeyLimits, Limit, Limiter, periods
from relay.server.cluster.limits import RedisLimitStore
from relay.server.cluster.limitshare import LimitShare, share
from relay.wire.errors import ConcurrencyLimited
from tests.clusterkit import private_redis, until
from tests.sentinelkit import free_ports


@pytest.mark.parametrize("processes", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("limit", [0, 1, 2, 3, 10, 99])
def test_the_shares_add_up_to_the_limit(limit, processes):
    shares = [share(limit, processes, rank) for rank in range(processes)]
    assert sum(shares) == limit
    assert max(shares) - min(shares) <= 1


async def test_a_process_admits_its_share_of_concurrency_counting_what_it_holds():
    at = periods(time.time())
    mine = LimitShare("b")
    mine.peers = frozenset({"a", "b", "c"})  # b is second: 5 // 3 = 1, +1 for rank < 2
    limits = KeyLimits(max_concurrent=5)
    assert await mine.acquire(1, limits, at, time.time(), held=1) is None
    refusal = await mine.acquire(1, limits, at, time.time(), held=2)
    assert refusal is not None and refusal.limit is Limit.CONCURRENCY
    last = LimitShare("c")
    last.peers = mine.peers
    assert await last.acquire(1, limits, at, time.time(), held=1) is not None


async def test_a_process_that_never_saw_the_others_counts_on_two():
    at = periods(time.time())
    alone = LimitShare("a")
    assert alone.place() == (2, 0)
    limits = KeyLimits(max_concurrent=1)
    assert await alone.acquire(1, limits, at, time.time(), held=0) is None  # 1 // 2 + 1
    second = LimitShare("b")
    second.peers = frozenset({"a", "b"})
    assert await second.acquire(1, limits, at, time.time(), held=0) is not None  # share 0


async def test_rate_and_budgets_are_shared_too():
    now = time.time()
    at = periods(now)
    mine = LimitShare("a")
    mine.peers = frozenset({"a", "b"})
    mine.learned({7: (90, 90)}, [7, 8])
    mine.begin(at)
    # A rate of 4 a minute: 2 here.
    rated = KeyLimits(requests_per_minute=4)
    assert await mine.acquire(8, rated, at, now, held=0) is None
    assert await mine.acquire(8, rated, at, now, held=0) is None
    refusal = await mine.acquire(8, rated, at, now, held=0)
    assert refusal is not None and refusal.limit is Limit.RATE
    # 100 tokens a day, 90 spent: 5 of the 10 left are this process's.
    budget = KeyLimits(tokens_per_day=100)
    assert await mine.acquire(7, budget, at, now, held=0) is None
    mine.charge(7, 5, at)
    refusal = await mine.acquire(7, budget, at, now, held=0)
    assert refusal is not None and refusal.limit is Limit.DAY


async def test_an_unreachable_store_admits_by_share_without_waiting_on_redis():
    """Nothing listens where Redis should be: the first admission finds it out, and the
    next ones go by the share at once; a key never gets more than its share here."""
    (port,) = free_ports(1)
    store = RedisLimitStore(f"redis://127.0.0.1:{port}/0", "mrtest-share", "a")
    limiter = Limiter(store)
    try:
        limits = KeyLimits(max_concurrent=3)  # two processes assumed: 2 here
        first = await limiter.admit(1, limits, "m")
        started = time.monotonic()
        second = await limiter.admit(1, limits, "m")
        assert time.monotonic() - started < 0.05
        with pytest.raises(ConcurrencyLimited):
            await limiter.admit(1, limits, "m")
        assert store.down and store.fallbacks == 2
        first.close()
        third = await limiter.admit(1, limits, "m")
        second.close()
        third.close()
        assert not store.held
    finally:
        if store.lean is not None:
            await store.lean.aclose()
        await store.redis.aclose()


async def test_slots_admitted_by_share_are_written_to_redis_when_it_answers(tmp_path):
    """Redis comes back: the slots held here (admitted by share meanwhile) are in its
    counts at once, with the hash's expiry, so the whole cluster counts them."""
    with private_redis(tmp_path / "redis") as (url, (start, stop)):
        store = RedisLimitStore(url, "mrtest-back", "a", lease_secs=1.5)
        task = asyncio.ensure_future(store.run())
        try:
            limiter = Limiter(store)
            limits = KeyLimits(max_concurrent=4)
            held = [await limiter.admit(1, limits, "m")]
            stop()
            held.append(await limiter.admit(1, limits, "m"))  # by share
            assert store.down
            start()

            async def counted() -> bool:
                return (
                    not store.down
                    and await store.redis.hget("mrtest-back:limits:slots:1", "a") == "2"
                )

            await until(counted, 10, "the slots held to be written back")
            assert await store.redis.pttl("mrtest-back:limits:slots:1") > 0
            for ticket in held:
                ticket.close()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
