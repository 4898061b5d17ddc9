"""Each process's share of a key's limits while the limit store in Redis cannot answer
(SPEC §13, §20): the shares add up to the limit, never the whole limit per process."""

from __future__ import annotations

import asyncio
import time

import pytest

from relay.core.limits import KeyLimits, Limit, Limiter, periods
from relay.server.cluster.limits import RedisLimitStore
from relay.server.cluster.limitshare import LimitShare, share
from relay.wire import protocol
from relay.wire.errors import ConcurrencyLimited, DailyQuotaExceeded
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


async def test_tokens_reserved_in_flight_count_against_the_share_of_a_budget():
    now = time.time()
    at = periods(now)
    mine = LimitShare("a")
    mine.peers = frozenset({"a", "b"})
    mine.learned({7: (100, 100)}, [7])
    mine.begin(at)
    # 1,000 tokens a day, 100 spent: 450 of the 900 left are this process's.
    budget = KeyLimits(tokens_per_day=1000)
    assert await mine.acquire(7, budget, at, now, held=0, reserved=449) is None
    refusal = await mine.acquire(7, budget, at, now, held=0, reserved=450)
    assert refusal is not None and refusal.limit is Limit.DAY
    mine.charge(7, 400, at)  # what ended meanwhile counts with what is still reserved
    assert await mine.acquire(7, budget, at, now, held=0, reserved=49) is None
    refusal = await mine.acquire(7, budget, at, now, held=0, reserved=50)
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


async def test_reservations_while_redis_is_away_stay_within_the_share_and_are_written_back(
    tmp_path,
):
    """Redis goes away: a budgeted key's requests are admitted here only while what this
    process's requests in flight reserve (those admitted through Redis before included)
    and what they charged meanwhile stay below its share of the budget. Redis comes back
    empty (a restart): the slots and reservations held here are in its counts again, with
    their expiry, and the tokens charged meanwhile too, so the other process counts them."""
    with private_redis(tmp_path / "redis") as (url, (start, stop)):
        here = RedisLimitStore(url, "mrtest-reserve", "a", lease_secs=1.5)
        there = RedisLimitStore(url, "mrtest-reserve", "b", lease_secs=1.5)
        tasks = [asyncio.ensure_future(store.run()) for store in (here, there)]
        try:

            async def both_seen() -> bool:
                return here.share.peers == {"a", "b"}

            await until(both_seen, 10, "the limit store's heartbeat to see both processes")
            limiter = Limiter(here)
            # Two processes: 500 of the day's 1,000 tokens and 3 of the 5 slots are a's.
            budget = KeyLimits(tokens_per_day=1000, max_concurrent=5)
            first = await limiter.admit(1, budget, "m", 300)  # through Redis
            reserved, slots = here._key("reserved", 1), here._key("slots", 1)
            assert await here.redis.hget(reserved, "a") == "300"
            stop()
            second = await limiter.admit(1, budget, "m", 200)  # by share: 300 reserved < 500
            assert here.down and here.fallbacks == 1
            with pytest.raises(DailyQuotaExceeded):  # 500 reserved here: the share is taken
                await limiter.admit(1, budget, "m", 1)
            first.close(protocol.TokenCounts(total_tokens=250))  # 250 charged, 200 reserved
            third = await limiter.admit(1, budget, "m", 50)  # 450 < 500
            with pytest.raises(DailyQuotaExceeded):
                await limiter.admit(1, budget, "m", 1)
            assert here.fallbacks == 2 and here.reserved[1] == 250 and here.held[1] == 2
            start()

            async def written_back() -> bool:
                return (
                    not here.down
                    and await here.redis.hget(reserved, "a") == "250"
                    and await here.redis.hget(slots, "a") == "2"
                    and await here.spend([1], periods(time.time())) == {1: (250, 250)}
                )

            await until(written_back, 10, "the slots, reservations and tokens written back")
            assert min(await here.redis.pttl(reserved), await here.redis.pttl(slots)) > 0
            # Through Redis again, the other process counts them: 250 spent + 250 reserved
            # at a, + 500 reserved at b reaches the budget.
            other = Limiter(there)
            theirs = await other.admit(1, budget, "m", 500)
            with pytest.raises(DailyQuotaExceeded):
                await other.admit(1, budget, "m", 1)
            for ticket in (second, third, theirs):
                ticket.close()

            async def released() -> bool:
                return await here.redis.exists(reserved, slots) == 0

            await until(released, 10, "every slot and reservation given back")
            assert await here.spend([1], periods(time.time())) == {1: (250, 250)}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
