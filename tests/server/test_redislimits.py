"""The per-key limit counters in Redis (SPEC §11, §13), two stores standing for two
server processes. Needs Redis on 127.0.0.1:6379 (skipped without it, failed in CI)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import pytest

from relay.core.limits import KeyLimits, Limiter
from relay.server.cluster.limits import RedisLimitStore
from relay.server.cluster.redisconf import RedisTarget
from relay.server.cluster.redissource import RedisSource
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


class _Link:
    """One client connection through :class:`HoldingProxy`."""

    def __init__(self, up_writer: asyncio.StreamWriter) -> None:
        self.up_writer = up_writer
        #: What the client sent while held (b"": then it closed the connection).
        self.kept: list[bytes] | None = None
        #: The client reset the connection while held: what it sent is lost with it.
        self.reset = False

    def send(self, data: bytes) -> None:
        if self.kept is not None:
            self.kept.append(data)
        elif data:
            self.up_writer.write(data)
        else:
            self.up_writer.close()


class HoldingProxy:
    """Between a client and Redis, standing for a Redis that stops reading and goes on
    (``SIGSTOP``, ``SIGCONT``): from :meth:`hold`, what every connection sends is kept, as
    a stopped Redis leaves it unread; :meth:`release` hands it over and lets everything
    through again. (A connection reset meanwhile loses what it sent, as it does.) While
    ``muted``, Redis's replies are dropped on the way: its commands run, and their
    callers never hear."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.holding = False
        self.muted = False
        self._links: list[_Link] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    def kept(self, part: bytes) -> bool:
        """Whether a connection still open sent ``part`` since :meth:`hold`."""
        return any(part in data for link in self._links for data in link.kept or ())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        link = _Link(up_writer)
        if self.holding:
            link.kept = []
        self._links.append(link)

        async def back() -> None:
            try:
                while data := await up_reader.read(65536):
                    if not self.muted:
                        writer.write(data)
            except ConnectionError:
                pass
            finally:
                writer.close()

        task = asyncio.ensure_future(back())
        self._tasks.add(task)
        try:
            while data := await reader.read(65536):
                link.send(data)
            link.send(b"")
        except ConnectionError:
            link.reset = True
            up_writer.transport.abort()

    def hold(self) -> None:
        self.holding = True
        for link in self._links:
            if link.kept is None:
                link.kept = []

    def release(self) -> None:
        self.holding = False
        for link in self._links:
            kept, link.kept = link.kept, None
            if kept is not None and not link.reset:
                for data in kept:
                    link.send(data)

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_redis_back_counts_what_was_admitted_by_share_before_it_admits_again():
    """Redis stops reading: an admission times out, and the store admits by its share. A
    heartbeat is on its way when Redis goes on; it carries the counts of when it was sent,
    without what was admitted by share since. Before the store admits through Redis again,
    Redis counts every slot it holds, so a request elsewhere is refused."""
    require_redis()
    url = urlsplit(URL)
    proxy = HoldingProxy((url.hostname or "127.0.0.1", url.port or 6379))
    prefix = f"mrtest-{secrets.token_hex(4)}"
    target = RedisTarget(url=await proxy.start(), timeout=0.3)
    store = RedisLimitStore(RedisSource(target), prefix, "a", lease_secs=3)
    other = RedisLimitStore(URL, prefix, "b", lease_secs=3)
    tasks = [asyncio.ensure_future(s.run()) for s in (store, other)]
    try:
        here, there = Limiter(store), Limiter(other)
        async with asyncio.timeout(5):
            while store.share.peers != {"a", "b"}:
                await asyncio.sleep(0.01)
        limits = KeyLimits(max_concurrent=4)  # two processes: 2 each by share
        held = [await here.admit(1, limits, "m")]
        proxy.hold()
        held.append(await here.admit(1, limits, "m"))  # times out: by share
        assert store.down and store.held[1] == 2
        async with asyncio.timeout(5):
            while not proxy.kept(b"SCRIPT"):  # a heartbeat on its way, saying 2
                await asyncio.sleep(0.01)
        with pytest.raises(ConcurrencyLimited):
            await here.admit(1, limits, "m")  # 2 by share already
        held[0].close()
        held.append(await here.admit(1, limits, "m"))  # by share, after the beat was sent
        assert store.held[1] == 2
        proxy.release()
        async with asyncio.timeout(5):
            while store.down:
                await asyncio.sleep(0.005)
        slots = store._key("slots", 1)
        assert await other.redis.hget(slots, "a") == "2"
        held.append(await there.admit(1, limits, "m"))
        held.append(await there.admit(1, limits, "m"))
        with pytest.raises(ConcurrencyLimited):
            await there.admit(1, limits, "m")
        for ticket in held:
            ticket.close()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await proxy.aclose()
        keys = [k async for k in other.redis.scan_iter(match=f"{prefix}:*")]
        if keys:
            await other.redis.delete(*keys)
        await other.redis.aclose()
