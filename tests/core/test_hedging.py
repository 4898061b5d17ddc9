"""Hedged priority streams in the core (SPEC §21): one response to the client from the
attempt that answered first, one charge, the other cancelled; the share and the
saturated pool stop hedges."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from relay.core.affinity import AffinityConfig
from relay.core.config import HedgeConfig
from relay.core.limits import KeyLimits, Limiter
from relay.core.limitstore import MemoryLimitStore
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, Event, RelayRequest, Worker
from relay.core.stats import RequestRecord
from relay.wire import protocol
from tests.core.test_speeds import chat, teach
from tests.corekit import FAST, RecordingLink, attach, make_relay

HEDGED = dataclasses.replace(
    FAST,
    affinity=AffinityConfig(policy="predicted"),
    heartbeat_interval=5.0,
    heartbeat_timeout=10.0,
    hedging=HedgeConfig(max_share=1.0, min_delay=0.01),
)


def fast(relay: Relay, w: Worker) -> None:
    """``w`` answers in ~6 ms (so a hedge comes after ~12 ms, its predicted p95)."""
    now = relay.loop.time()
    for i in range(20):
        teach(relay.rates, w, now, tokens=100 + 10 * i, ttft=0.005 + (100 + 10 * i) / 1e6)


def two(relay: Relay, **options: object) -> tuple[Worker, RecordingLink, Worker, RecordingLink]:
    a, la = attach(relay, name="a", max_concurrent=4, **options)  # type: ignore[arg-type]
    b, lb = attach(relay, name="b", max_concurrent=4, **options)  # type: ignore[arg-type]
    fast(relay, a)
    fast(relay, b)
    return a, la, b, lb


def send(
    relay: Relay, *, service_class: str = "priority", stream: bool = True, n: int = 0, **kw: object
) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=stream,
        body=chat(400, n),
        headers={},
        service_class=service_class,
        **kw,  # type: ignore[arg-type]
    )


async def until(check: Callable[[], bool], timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


def attempts(link: RecordingLink, request: RelayRequest) -> int:
    return sum(1 for f in link.requests if f.request_id == request.id)


def drain(request: RelayRequest) -> list[Event]:
    events = request._events
    request._events = []
    return events


async def test_the_second_attempt_answers_first_wins_and_the_first_is_cancelled():
    relay = make_relay(HEDGED)
    a, la, b, lb = two(relay)
    records: list[RequestRecord] = []
    relay.observers.append(records.append)
    limiter = Limiter(MemoryLimitStore())
    ticket = await limiter.admit(7, KeyLimits(tokens_per_day=10_000), "m")
    r = send(relay, ticket=ticket, key_id=7)
    first, (second, link2), link1 = (
        r.worker,
        (b, lb) if r.worker is a else (a, la),
        (la if r.worker is a else lb),
    )
    assert first is not None
    await until(lambda: attempts(link2, r) == 1)  # no first byte by its predicted p95
    assert second.load == 1 and first.load == 1 and relay.hedges["sent"] == 1
    relay.on_chunk(second, r.id, "data: second\n\n")
    assert r.worker is second and r.worker_name == second.name
    assert [c.request_id for c in link1.cancels] == [r.id]
    assert first.load == 0  # its slot is free again
    relay.on_chunk(first, r.id, "data: first\n\n")  # late: a stray, dropped
    counts = protocol.TokenCounts(prompt_tokens=100, completion_tokens=5)
    relay.on_complete(
        second,
        protocol.ResponseComplete(request_id=r.id, status_code=200, token_counts=counts),
    )
    relay.on_complete(first, protocol.ResponseComplete(request_id=r.id, status_code=200))
    events = drain(r)
    assert events[0] == b"data: second\n\n" and isinstance(events[1], Completion)
    assert len(events) == 2  # not a byte of the first attempt
    assert relay.stats.dropped_frames == 2
    assert len(records) == 1 and records[0].worker_name == second.name
    assert not ticket.open and limiter.open[7] == 0
    spent = await limiter.spend({7})
    assert spent[7][0] == 105  # charged once
    assert (relay.hedges["sent"], relay.hedges["won"], relay.hedges["lost"]) == (1, 1, 0)
    assert second.requests_served == 1 and first.requests_served == 0


async def test_when_the_first_attempt_answers_first_the_hedge_is_cancelled():
    relay = make_relay(HEDGED)
    a, la, b, lb = two(relay)
    r = send(relay)
    first = r.worker
    second, link2 = (b, lb) if first is a else (a, la)
    assert first is not None
    await until(lambda: attempts(link2, r) == 1)
    relay.on_chunk(first, r.id, "data: first\n\n")
    assert [c.request_id for c in link2.cancels] == [r.id] and second.load == 0
    relay.on_chunk(second, r.id, "data: second\n\n")  # dropped
    relay.on_complete(first, protocol.ResponseComplete(request_id=r.id, status_code=200))
    events = drain(r)
    assert events[0] == b"data: first\n\n" and isinstance(events[1], Completion)
    assert len(events) == 2 and relay.hedges["lost"] == 1


async def test_an_attempt_that_fails_leaves_the_other_to_answer():
    relay = make_relay(HEDGED)
    a, la, b, lb = two(relay)
    r = send(relay)
    first = r.worker
    second, link2 = (b, lb) if first is a else (a, la)
    assert first is not None
    await until(lambda: attempts(link2, r) == 1)
    relay.on_worker_error(second, protocol.Error(request_id=r.id, message="backend 500"))
    assert r.worker is first and second.load == 0 and not r.done
    relay.on_chunk(first, r.id, "data: first\n\n")
    relay.on_complete(first, protocol.ResponseComplete(request_id=r.id, status_code=200))
    assert isinstance(drain(r)[-1], Completion) and relay.hedges["failed"] == 1


async def test_a_lost_first_worker_hands_the_request_to_its_hedge_not_to_the_queue():
    relay = make_relay(HEDGED)
    a, la, b, lb = two(relay)
    r = send(relay)
    first = r.worker
    second, link2 = (b, lb) if first is a else (a, la)
    assert first is not None
    await until(lambda: attempts(link2, r) == 1)
    relay.close_worker(first, 1011, "gone")
    assert r.worker is second and r.requeues == 0 and relay.queue_depth() == 0
    relay.on_chunk(second, r.id, "data: second\n\n")
    relay.on_complete(second, protocol.ResponseComplete(request_id=r.id, status_code=200))
    events = drain(r)
    assert events[0] == b"data: second\n\n" and isinstance(events[-1], Completion)
    assert attempts(link2, r) == 1  # sent once there: the hedge, nothing requeued


async def test_a_client_that_leaves_cancels_both_attempts():
    relay = make_relay(HEDGED)
    a, la, b, lb = two(relay)
    r = send(relay)
    await until(lambda: attempts(la, r) + attempts(lb, r) == 2)
    relay.cancel(r)
    assert [c.request_id for c in la.cancels] == [r.id] == [c.request_id for c in lb.cancels]
    assert a.load == b.load == 0 and drain(r) == [CANCELLED]


async def test_hedges_stay_within_their_share_of_priority_requests():
    config = dataclasses.replace(HEDGED, hedging=HedgeConfig(max_share=0.1, min_delay=0.01))
    relay = make_relay(config)
    a, la = attach(relay, name="a", max_concurrent=64)
    b, lb = attach(relay, name="b", max_concurrent=64)
    fast(relay, a)
    fast(relay, b)
    stalled = [send(relay, n=n) for n in range(40)]  # none ever answers
    await until(lambda: relay.hedges["sent"] + relay.hedges["over_share"] >= 80)
    # Never more than a tenth of them (the credit saved up: one hedge), however often
    # the others look again for a hedge.
    assert 1 <= relay.hedges["sent"] <= 4
    assert len(la.requests) + len(lb.requests) == 40 + relay.hedges["sent"]
    for r in stalled:
        relay.cancel(r)


async def test_no_hedge_while_the_pool_is_saturated():
    relay = make_relay(HEDGED)
    a, la = attach(relay, name="a", max_concurrent=1)
    b, lb = attach(relay, name="b", max_concurrent=1)
    fast(relay, a)
    fast(relay, b)
    first = send(relay, n=1)
    second = send(relay, n=2)  # every slot taken
    await until(lambda: relay.hedges["saturated"] >= 4)  # looked again, still full
    assert len(la.requests) + len(lb.requests) == 2
    relay.cancel(first)
    relay.cancel(second)


async def test_a_request_the_share_kept_from_its_hedge_gets_one_when_the_share_allows():
    config = dataclasses.replace(HEDGED, hedging=HedgeConfig(max_share=0.5, min_delay=0.01))
    relay = make_relay(config)
    a, la, _b, lb = two(relay)
    r = send(relay)  # half a credit: its timer finds the share spent
    first = r.worker
    link2 = lb if first is a else la
    assert first is not None
    await until(lambda: relay.hedges["over_share"] >= 1)
    other = send(relay, n=1)  # another priority stream: the credit is whole now
    assert other.worker is not None
    relay.on_chunk(other.worker, other.id, "data: x\n\n")  # (answers: no hedge of its own)
    await until(lambda: attempts(link2, r) == 1)  # the silent one looked again, and got it
    assert relay.hedges["sent"] == 1
    relay.cancel(r)
    relay.cancel(other)


async def test_only_priority_streams_are_hedged_and_hedging_is_off_by_default():
    relay = make_relay(HEDGED)
    two(relay)
    default = send(relay, service_class="default", n=1)
    unary = send(relay, stream=False, n=2)
    assert default.hedge is None and unary.hedge is None
    off = make_relay(dataclasses.replace(HEDGED, hedging=HedgeConfig()))
    two(off)
    assert send(off, n=3).hedge is None
