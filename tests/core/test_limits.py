"""Per-key limits in the core (SPEC §13): admission, tickets and the in-memory counters."""

from __future__ import annotations

import calendar
from collections.abc import Collection

import pytest

from relay.core.limits import (
    MAX_RESERVATION,
    KeyLimits,
    Limit,
    Limiter,
    LimitStoreUnavailable,
    Periods,
    Refusal,
    periods,
    reservation,
    tokens_of,
)
from relay.core.limitstore import MemoryLimitStore
from relay.core.state import Phase
from relay.wire import protocol
from relay.wire.errors import (
    ConcurrencyLimited,
    DailyQuotaExceeded,
    KeyExpired,
    ModelNotAllowed,
    MonthlyQuotaExceeded,
    RequestRateLimited,
    error_response,
)
from tests.corekit import attach, complete, make_relay

#: 2026-03-31 23:59:00 UTC: a minute before a day and a month end.
T0 = float(calendar.timegm((2026, 3, 31, 23, 59, 0, 0, 0, 0)))


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock | None = None) -> Limiter:
    return Limiter(MemoryLimitStore(), clock=clock or Clock())


async def test_an_expired_key_gets_401_and_a_model_not_allowed_403():
    clock = Clock()
    limits = KeyLimits(expires_at=T0 + 10, allowed_models=frozenset({"small"}))
    gate = limiter(clock)
    (await gate.admit(1, limits, "small")).close()
    with pytest.raises(ModelNotAllowed) as refused:
        await gate.admit(1, limits, "big")
    status, _, body = error_response(refused.value, "openai")
    assert status == 403 and b"may not use model 'big'" in body
    clock.now = T0 + 10
    with pytest.raises(KeyExpired, match="expired at 2026-03-31T23:59:10Z") as expired:
        await gate.admit(1, limits, "small")
    assert error_response(expired.value, "anthropic")[0] == 401


async def test_concurrency_counts_queued_and_running_and_every_ending_frees_it():
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=1)
    gate = limiter()
    limits = KeyLimits(max_concurrent=2)

    async def submit():
        ticket = await gate.admit(7, limits, "m")
        return relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=False,
            body="{}",
            headers={},
            key_id=7,
            ticket=ticket,
        )

    running, queued = await submit(), await submit()
    assert (running.phase, queued.phase) == (Phase.ASSIGNED, Phase.QUEUED)
    with pytest.raises(ConcurrencyLimited) as refused:
        await gate.admit(7, limits, "m")
    status, headers, body = error_response(refused.value, "openai")
    assert status == 429 and (b"retry-after", b"1") in headers
    assert b'"code":"rate_limit_exceeded"' in body and b"limit 2" in body
    relay.cancel(queued)  # a queued request that ends frees its slot
    again = await submit()
    complete(relay, worker, running.id)  # so does a completion
    assert again.phase is Phase.ASSIGNED
    third = await submit()
    relay._expire(third)  # and a timeout
    assert gate.open == {7: 1} and gate.store.slots == {7: 1}  # type: ignore[attr-defined]


async def test_requests_per_minute_allow_a_burst_then_refill_continuously():
    clock = Clock()
    gate = limiter(clock)
    limits = KeyLimits(requests_per_minute=3)
    for _ in range(3):
        (await gate.admit(1, limits, "m")).close()
    with pytest.raises(RequestRateLimited) as refused:
        await gate.admit(1, limits, "m")
    assert refused.value.retry_after == 20  # one more every 60/3 seconds
    assert "3 requests per minute" in refused.value.message
    clock.now += 19.5
    with pytest.raises(RequestRateLimited) as refused:
        await gate.admit(1, limits, "m")
    assert refused.value.retry_after == 1
    clock.now += 0.5
    (await gate.admit(1, limits, "m")).close()
    with pytest.raises(RequestRateLimited):
        await gate.admit(1, limits, "m")
    (await gate.admit(2, limits, "m")).close()  # another key has its own allowance


async def test_a_budget_crossed_midway_lets_that_request_finish_and_refuses_the_next():
    clock = Clock()
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=2)
    gate = limiter(clock)
    limits = KeyLimits(tokens_per_day=100)
    requests = []
    for _ in range(2):  # both start under budget
        ticket = await gate.admit(1, limits, "m")
        requests.append(
            relay.submit(
                model="m",
                endpoint_path="/v1/chat/completions",
                flavor="openai",
                is_streaming=False,
                body="{}",
                headers={},
                key_id=1,
                ticket=ticket,
            )
        )
    for r in requests:
        relay.on_complete(
            worker,
            protocol.ResponseComplete(
                request_id=r.id,
                status_code=200,
                headers={},
                body="{}",
                token_counts=protocol.TokenCounts(prompt_tokens=30, completion_tokens=30),
            ),
        )
        assert r.status == 200  # the one that crossed the budget finished too
    with pytest.raises(DailyQuotaExceeded) as refused:
        await gate.admit(1, limits, "m")
    status, headers, body = error_response(refused.value, "openai")
    assert status == 429 and (b"retry-after", b"60") in headers  # until 00:00 UTC
    assert b'"code":"insufficient_quota"' in body and b'"type":"insufficient_quota"' in body
    assert (await gate.spend([1])) == {1: (120, 120)}
    clock.now += 60  # a new day (and month): the budget renews
    (await gate.admit(1, limits, "m")).close()
    assert (await gate.spend([1])) == {}


async def test_a_spent_monthly_budget_is_reported_before_the_day_and_renews_on_the_first():
    clock = Clock(T0 - 86_400 * 3)
    gate = limiter(clock)
    limits = KeyLimits(tokens_per_day=10, tokens_per_month=50, requests_per_minute=1)
    gate.store.seed({1: (10, 50)}, gate.calendar.at(clock.now))  # type: ignore[attr-defined]
    with pytest.raises(MonthlyQuotaExceeded) as refused:
        await gate.admit(1, limits, "m")
    assert refused.value.retry_after == 3 * 86_400 + 60
    assert "renews on the 1st" in refused.value.message


async def test_checks_run_in_order_and_a_refusal_counts_nothing():
    gate = limiter()
    limits = KeyLimits(max_concurrent=1, requests_per_minute=2)
    held = await gate.admit(1, limits, "m")
    with pytest.raises(ConcurrencyLimited):
        await gate.admit(1, limits, "m")  # refused: does not use up the rate
    held.close()
    (await gate.admit(1, limits, "m")).close()
    with pytest.raises(RequestRateLimited):  # the rate is checked before concurrency
        await gate.admit(1, limits, "m")


async def test_a_budget_counts_what_requests_in_flight_reserved_until_each_settles():
    """A 10-token budget and requests that may cost 100: the first is admitted, the next
    waits for it to end; what it really cost is charged, the rest given back."""
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=4)
    gate = limiter()
    store = gate.store
    assert isinstance(store, MemoryLimitStore)
    limits = KeyLimits(tokens_per_day=10)

    async def submit(tokens: int = 100):
        return relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=False,
            body="{}",
            headers={},
            key_id=1,
            ticket=await gate.admit(1, limits, "m", tokens),
        )

    first = await submit()
    assert first.ticket is not None and first.ticket.reserved == 100
    assert store.reserved == {1: 100}
    with pytest.raises(DailyQuotaExceeded):  # 0 spent + 100 reserved: nothing more now
        await submit()
    relay.on_complete(
        worker,
        protocol.ResponseComplete(
            request_id=first.id,
            status_code=200,
            token_counts=protocol.TokenCounts(prompt_tokens=2, completion_tokens=2),
        ),
    )
    assert store.reserved == {} and await gate.spend([1]) == {1: (4, 4)}
    second = await submit()  # 4 spent: under budget again
    relay.cancel(second)  # cancelled: its reservation is released, nothing charged
    failed = await submit()
    relay.on_worker_error(worker, protocol.Error(request_id=failed.id, message="boom"))
    assert (failed.status, store.reserved) == (502, {})
    assert await gate.spend([1]) == {1: (4, 4)}
    last = await submit(6)  # 4 + 6 = 10: the budget is spent once it is admitted
    with pytest.raises(DailyQuotaExceeded):
        await submit(1)
    last.ticket.close()
    (await gate.admit(1, limits, "m", 1)).close()


async def test_a_request_that_cost_less_than_it_reserved_gives_the_rest_back():
    gate = limiter()
    limits = KeyLimits(tokens_per_day=250, tokens_per_month=10_000)
    running = [await gate.admit(1, limits, "m", 100) for _ in range(3)]  # 0, 100, 200 < 250
    with pytest.raises(DailyQuotaExceeded):  # 300 reserved
        await gate.admit(1, limits, "m", 100)
    running[0].close(protocol.TokenCounts(total_tokens=12))  # 12 spent + 200 reserved
    running.append(await gate.admit(1, limits, "m", 100))
    with pytest.raises(DailyQuotaExceeded):
        await gate.admit(1, limits, "m", 100)
    for ticket in running[1:]:
        ticket.close(protocol.TokenCounts(total_tokens=1))
    assert gate.store.reserved == {}  # type: ignore[attr-defined]
    assert await gate.spend([1]) == {1: (15, 15)}
    # The month counts reservations too.
    month = KeyLimits(tokens_per_month=50)
    held = await gate.admit(2, month, "m", 60)
    with pytest.raises(MonthlyQuotaExceeded):
        await gate.admit(2, month, "m", 1)
    held.close()


async def test_only_keys_with_a_budget_reserve_and_a_refusal_reserves_nothing():
    gate = limiter()
    store = gate.store
    assert isinstance(store, MemoryLimitStore)
    unbudgeted = await gate.admit(1, KeyLimits(max_concurrent=5), "m", 100)
    assert unbudgeted.reserved == 0 and store.reserved == {}
    unbudgeted.close()
    limits = KeyLimits(tokens_per_day=1000, max_concurrent=1)
    held = await gate.admit(2, limits, "m", 100)
    with pytest.raises(ConcurrencyLimited):  # refused after the budget check: no reservation
        await gate.admit(2, limits, "m", 100)
    assert store.reserved == {2: 100}
    held.close()
    held.close()  # once
    assert store.reserved == {} and store.slots == {}


def test_a_reservation_is_the_most_output_asked_for_plus_the_prompt():
    assert reservation(0) == 0
    assert reservation(10, None, 100, 30) == 100 + 3  # 10 bytes of prompt: 3 tokens
    assert reservation(4, True, 2.5, "9", -5, 7) == 7 + 1  # only positive integers count
    assert reservation(0, 10**30) == MAX_RESERVATION
    assert reservation(10**12) == MAX_RESERVATION


class _DownStore(MemoryLimitStore):
    async def acquire(self, *args: object) -> Refusal | None:
        raise LimitStoreUnavailable("connection refused")

    async def spend(self, key_ids: Collection[int], at: Periods) -> dict[int, tuple[int, int]]:
        raise LimitStoreUnavailable("connection refused")


async def test_when_the_store_is_down_requests_pass_without_the_counted_limits():
    gate = Limiter(_DownStore(), clock=Clock())
    limits = KeyLimits(max_concurrent=1, tokens_per_day=10, allowed_models=frozenset({"m"}))
    first, second = await gate.admit(1, limits, "m"), await gate.admit(1, limits, "m", 50)
    assert not first.held and gate.store_failures == 2
    assert second.reserved == 0  # nothing was reserved anywhere
    with pytest.raises(ModelNotAllowed):  # what needs no store still holds
        await gate.admit(1, limits, "other")
    first.close()
    second.close()
    assert await gate.spend([1]) == {}


async def test_a_ticket_closes_once_and_keys_without_counted_limits_skip_the_store():
    gate = limiter()
    ticket = await gate.admit(3, KeyLimits(weight=4), "m")
    assert (ticket.weight, ticket.held, gate.open) == (4, False, {3: 1})
    ticket.close(protocol.TokenCounts(total_tokens=9, prompt_tokens=1))
    ticket.close(protocol.TokenCounts(total_tokens=9))
    assert gate.open == {} and await gate.spend([3]) == {3: (9, 9)}


def test_periods_know_where_days_and_months_end():
    assert periods(T0) == Periods(
        day=int(T0 // 86_400),
        month=2026 * 12 + 2,
        day_ends=T0 + 60,
        month_ends=T0 + 60,
    )
    december = float(calendar.timegm((2026, 12, 15, 12, 0, 0, 0, 0, 0)))
    assert periods(december).month_ends == calendar.timegm((2027, 1, 1, 0, 0, 0, 0, 0, 0))
    assert tokens_of(None) == 0
    assert tokens_of(protocol.TokenCounts(prompt_tokens=2, completion_tokens=3)) == 5
    assert Refusal(Limit.RATE).retry_after == 0.0
