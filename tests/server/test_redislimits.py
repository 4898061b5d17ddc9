"""The per-key limit counters in Redis (SPEC §11, §13), two stores standing for two
server processes. Needs Redis on 127.0.0.1:6379 (skipped without it, failed in CI)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable

import pytest

from relay.core.limits import KeyLimits, Limiter
from relay.server.cluster.limits import RedisLimitStore
from relay.wire import protocol
from relay.wire.errors import (
    ConcurrencyLimited,
    DailyQuotaExceeded,
    MonthlyQuotaExceeded,
    RequestRateLimited,
)
from tests.conftest import REDIS_URL, require_redis

pytestmark = pytest.mark.redis

URL = REDIS_URL


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., RedisLimitStore]]:
    """``make(instance, lease_secs=..., run=True)``: stores sharing one fresh prefix;
    each runs its own task (writes, heartbeat) until the test ends. With ``run=False``
    it stands for a process that dies right after its admissions: nothing renews its
    lease and nothing it ends is written."""
    require_redis()
    prefix = f"mrtest-{secrets.token_hex(4)}"
    tasks: list[asyncio.Task[None]] = []

    made: list[RedisLimitStore] = []

    def make(instance: str, *, lease_secs: float = 5.0, run: bool = True) -> RedisLimitStore:
        store = RedisLimitStore(URL, prefix, instance, lease_secs=lease_secs)
        made.append(store)
        if run:
            tasks.append(asyncio.get_running_loop().create_task(store.run()))
        return store

    yield make
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for store in made:
        await store.redis.aclose()
    cleaner = RedisLimitStore(URL, prefix, "cleaner")
    keys = [k async for k in cleaner.redis.scan_iter(match=f"{prefix}:*")]
    if keys:
        await cleaner.redis.delete(*keys)
    await cleaner.redis.aclose()


async def settled(store: RedisLimitStore) -> None:
    """Wait until the store's task wrote everything that ended."""
    async with asyncio.timeout(5):
        while store._pending or store._wake.is_set():
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the pipeline in flight


async def test_concurrency_is_counted_across_processes_and_freed_when_requests_end(stores):
    a, b = Limiter(stores("a")), Limiter(stores("b"))
    limits = KeyLimits(max_concurrent=2)
    first = await a.admit(1, limits, "m")
    second = await b.admit(1, limits, "m")
    assert first.held and second.held
    with pytest.raises(ConcurrencyLimited):
        await a.admit(1, limits, "m")
    (await a.admit(2, limits, "m")).close()  # another key is counted apart
    second.close()
    await settled(b.store)  # type: ignore[arg-type]
    third = await a.admit(1, limits, "m")
    first.close()
    third.close()


async def test_the_slots_of_a_process_that_died_stop_counting_after_its_lease(stores):
    survivor = Limiter(stores("alive", lease_secs=0.3))
    doomed = Limiter(stores("doomed", lease_secs=0.3, run=False))
    limits = KeyLimits(max_concurrent=1)
    held = await doomed.admit(1, limits, "m")  # its process dies holding the slot
    assert held.held
    with pytest.raises(ConcurrencyLimited):
        await survivor.admit(1, limits, "m")
    async with asyncio.timeout(5):
        while True:
            try:
                ticket = await survivor.admit(1, limits, "m")
                break
            except ConcurrencyLimited:
                await asyncio.sleep(0.05)
    ticket.close()


async def test_the_request_rate_and_budgets_are_shared(stores):
    a, b = Limiter(stores("a")), Limiter(stores("b"))
    rated = KeyLimits(requests_per_minute=2)
    (await a.admit(1, rated, "m")).close()
    (await b.admit(1, rated, "m")).close()
    with pytest.raises(RequestRateLimited) as refused:
        await a.admit(1, rated, "m")
    assert refused.value.retry_after is not None
    assert 29 <= refused.value.retry_after <= 30
    budget = KeyLimits(tokens_per_day=100)
    ticket = await a.admit(2, budget, "m")
    ticket.close(protocol.TokenCounts(prompt_tokens=80, completion_tokens=40))
    await settled(a.store)  # type: ignore[arg-type]
    with pytest.raises(DailyQuotaExceeded):
        await b.admit(2, budget, "m")
    assert await b.spend([2, 3]) == {2: (120, 120)}


async def test_reservations_are_shared_and_settled_with_the_real_tokens(stores):
    a, b = Limiter(stores("a")), Limiter(stores("b"))
    budget = KeyLimits(tokens_per_day=10, tokens_per_month=1000)
    first = await a.admit(1, budget, "m", 100)
    assert first.reserved == 100
    with pytest.raises(DailyQuotaExceeded):  # 0 spent, 100 reserved at a
        await b.admit(1, budget, "m", 100)
    first.close(protocol.TokenCounts(total_tokens=4))  # cost 4: the other 96 given back
    await settled(a.store)  # type: ignore[arg-type]
    second = await b.admit(1, budget, "m", 100)
    assert await a.spend([1]) == {1: (4, 4)}
    second.close()  # failed or cancelled: released, nothing charged
    await settled(b.store)  # type: ignore[arg-type]
    store = a.store
    assert isinstance(store, RedisLimitStore)
    assert await store.redis.hgetall(store._key("reserved", 1)) == {}
    assert await a.spend([1]) == {1: (4, 4)}
    monthly = KeyLimits(tokens_per_month=50)
    held = await b.admit(2, monthly, "m", 60)
    with pytest.raises(MonthlyQuotaExceeded):
        await a.admit(2, monthly, "m", 1)
    held.close()


async def test_the_reservations_of_a_process_that_died_stop_counting_after_its_lease(stores):
    survivor = Limiter(stores("alive", lease_secs=0.3))
    doomed = Limiter(stores("doomed", lease_secs=0.3, run=False))
    budget = KeyLimits(tokens_per_day=10)
    assert (await doomed.admit(1, budget, "m", 100)).reserved == 100  # and it dies
    with pytest.raises(DailyQuotaExceeded):
        await survivor.admit(1, budget, "m")
    async with asyncio.timeout(5):
        while True:
            try:
                ticket = await survivor.admit(1, budget, "m")
                break
            except DailyQuotaExceeded:
                await asyncio.sleep(0.05)
    ticket.close()


async def test_what_redis_lost_of_a_process_s_reservations_is_put_back_with_expiries(stores):
    store = stores("a", lease_secs=0.3)
    a = Limiter(store)
    budget = KeyLimits(tokens_per_day=1000, max_concurrent=5)
    one, two = await a.admit(1, budget, "m", 100), await a.admit(1, budget, "m", 200)
    reserved, slots = store._key("reserved", 1), store._key("slots", 1)
    assert await store.redis.hget(reserved, "a") == "300"
    assert min(await store.redis.pttl(reserved), await store.redis.pttl(slots)) > 0
    await store.redis.delete(reserved, slots)  # evicted, say
    one.close()  # gives back more than Redis holds: the heartbeat re-asserts the rest
    async with asyncio.timeout(5):
        while await store.redis.hget(reserved, "a") != "200":
            await asyncio.sleep(0.02)
    assert await store.redis.hget(slots, "a") == "1"
    assert min(await store.redis.pttl(reserved), await store.redis.pttl(slots)) > 0
    two.close()
    await settled(store)
    assert await store.redis.exists(reserved, slots) == 0
