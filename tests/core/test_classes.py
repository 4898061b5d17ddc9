"""Priority classes on the relay core (SPEC §15): order across classes, clamping, aging,
and preempt-and-requeue before the first byte only."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from relay.core import classes
from relay.core.classqueue import ClassedQueue
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, Phase, RelayRequest
from relay.wire import protocol
from relay.wire.errors import BadRequest
from tests.corekit import FAST, attach, complete, make_relay


def submit(relay: Relay, service_class: str, *, stream: bool = False) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=stream,
        body='{"model":"m"}',
        headers={"content-type": "application/json"},
        service_class=service_class,
    )


def test_what_a_request_asks_for_and_what_it_gets():
    assert classes.asked(b"Flex", None) == "flex"
    assert classes.asked(None, "priority") == "priority"
    assert classes.asked(None, "standard_only") == "default"  # Anthropic's
    assert classes.asked(None, "auto") is None  # the key's default
    assert classes.asked(b"default", "flex") == "default"  # the header wins
    for bad in ("urgent", 3, ["flex"]):
        with pytest.raises(BadRequest):
            classes.asked(None, bad)
    with pytest.raises(BadRequest):
        classes.asked(b"high", None)
    # Asking above the key's highest class is clamped, not refused.
    assert classes.resolve("priority", "flex", highest="default") == "default"
    assert classes.resolve(None, "flex", highest="default") == "flex"
    assert classes.resolve("flex", "default", highest="priority") == "flex"


async def test_when_a_slot_frees_the_highest_class_waiting_goes_first():
    relay = make_relay()
    worker, link = attach(relay)
    busy = submit(relay, "flex")
    flex = submit(relay, "flex")
    default = submit(relay, "default")
    # The busy one had sent nothing: the default request took its slot at once.
    assert link.cancels[-1].request_id == busy.id
    assert link.cancels[-1].reason == "client_disconnect"  # (no extensions announced)
    assert link.requests[-1].request_id == default.id
    priority = submit(relay, "priority")
    assert priority.phase is Phase.QUEUED  # only flex requests lose their slot
    complete(relay, worker, default.id)
    assert link.requests[-1].request_id == priority.id
    complete(relay, worker, priority.id)
    # flex: the preempted one first (back at the front of its class), then the other.
    assert link.requests[-1].request_id == busy.id
    complete(relay, worker, busy.id)
    assert link.requests[-1].request_id == flex.id
    await relay.aclose()


async def test_a_flex_stream_that_has_sent_bytes_is_never_preempted():
    relay = make_relay()
    worker, link = attach(relay)
    streaming = submit(relay, "flex", stream=True)
    relay.on_chunk(worker, streaming.id, "data: one\n\n")
    waiting = submit(relay, "priority")
    assert link.cancels == []
    assert waiting.phase is Phase.QUEUED
    complete(relay, worker, streaming.id)
    assert link.requests[-1].request_id == waiting.id
    await relay.aclose()


async def test_a_preempted_request_completes_intact_and_its_client_sees_one_response():
    relay = make_relay()
    worker, link = attach(relay, features=[protocol.FLOW_CONTROL])
    victim = submit(relay, "flex")
    winner = submit(relay, "default")
    assert link.cancels[-1] == protocol.Cancel(request_id=victim.id, reason="preempted")
    assert victim.phase is Phase.QUEUED and victim.requeues == 0 and victim.preemptions == 1
    complete(relay, worker, winner.id, body='{"w":1}')
    assert link.requests[-1].request_id == victim.id  # sent again, same id
    complete(relay, worker, victim.id, body='{"v":1}')
    events = await victim.next_events()
    assert events == [Completion(200, {}, b'{"v":1}')]
    assert relay.stats.preemptions == 1
    await relay.aclose()


async def test_a_flex_request_is_preempted_at_most_n_times_then_keeps_its_slot():
    relay = make_relay(dataclasses.replace(FAST, max_preemptions=2))
    worker, link = attach(relay)
    victim = submit(relay, "flex")
    for _ in range(2):
        winner = submit(relay, "priority")
        assert link.requests[-1].request_id == winner.id
        complete(relay, worker, winner.id)
        assert link.requests[-1].request_id == victim.id
    assert victim.preemptions == 2
    third = submit(relay, "priority")
    assert third.phase is Phase.QUEUED  # the victim keeps its slot now
    assert link.requests[-1].request_id == victim.id
    await relay.aclose()


async def test_with_nothing_of_a_higher_class_waiting_flex_uses_every_slot():
    relay = make_relay()
    _, link = attach(relay, max_concurrent=3)
    bulk = [submit(relay, "flex") for _ in range(5)]
    assert {r.id for r in bulk[:3]} == {f.request_id for f in link.requests}
    assert link.cancels == []
    assert [r.phase for r in bulk[3:]] == [Phase.QUEUED, Phase.QUEUED]
    for request in bulk:
        relay.cancel(request)
    await relay.aclose()


async def test_a_flood_of_bulk_work_never_fills_the_queue_for_people():
    relay = make_relay(dataclasses.replace(FAST, max_queue_len=2))
    attach(relay)
    submit(relay, "default")  # busy
    for _ in range(2):
        submit(relay, "flex")
    from relay.wire.errors import QueueFull

    with pytest.raises(QueueFull):
        submit(relay, "flex")
    person = submit(relay, "default")  # the bound is per class
    assert person.phase is Phase.QUEUED
    await relay.aclose()


def waiting(seq: int, service_class: str, requeued: bool = False) -> RelayRequest:
    """A request as the queue sees it (``requeued``: it was dispatched before)."""
    r = RelayRequest(
        id=f"r{seq}",
        seq=seq,
        provider="p",
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=False,
        body="{}",
        headers={},
        key_id=None,
        created_wall=0.0,
        now=0.0,
        deadline=1e9,
    )
    r.service_class = service_class
    r.rank = classes.RANK[service_class]
    r.worker_id = "w" if requeued else None
    return r


def test_a_request_waiting_past_the_aging_bound_counts_one_class_higher():
    now = [0.0]
    queue = ClassedQueue(aging=10.0, clock=lambda: now[0])
    old_flex = waiting(1, "flex")
    queue.push(old_flex)
    now[0] = 5.0
    default = waiting(2, "default")
    queue.push(default)
    models = frozenset({"m"})
    assert queue.next_for(models) is default
    now[0] = 11.0  # the flex one waited past the bound: it counts as default now, and
    # is older than every default request waiting
    assert queue.next_for(models) is old_flex
    assert old_flex.rank == classes.RANK["default"]
    assert old_flex.service_class == "flex"
    assert queue.pop_for(models) is old_flex
    assert queue.pop_for(models) is default
    assert len(queue) == 0
    # ... and on to priority after another bound: nothing starves.
    late = waiting(3, "flex")
    queue.push(late)
    now[0] = 40.0
    queue.push(waiting(4, "priority"))
    assert queue.pop_for(models) is late  # promoted twice, ahead of the newer priority
    assert late.rank == 0


AGING = 0.1
AGED = dataclasses.replace(FAST, priority_aging=AGING)


async def until_aged(relay: Relay) -> None:
    """Until the one queued request, a flex one, counts as default (a few real ms past
    the shrunk bound)."""
    queue = relay.providers["local"].queue
    async with asyncio.timeout(5):
        while queue.depth_by_class() != {"priority": 0, "default": 1, "flex": 0}:
            await asyncio.sleep(AGING / 4)


async def test_a_flex_request_dispatched_after_aging_is_not_preempted_by_later_work():
    relay = make_relay(AGED)
    worker, link = attach(relay)
    busy = submit(relay, "default")
    aged = submit(relay, "flex")
    await until_aged(relay)
    complete(relay, worker, busy.id)
    assert link.requests[-1].request_id == aged.id and aged.rank == classes.RANK["default"]
    # Work that arrived after it crossed the aging bound does not pass it: a default
    # request waits (it counts as default itself), a priority request too (only what
    # counts as flex now loses its slot).
    later = [submit(relay, "default"), submit(relay, "priority")]
    assert link.cancels == [] and all(r.phase is Phase.QUEUED for r in later)
    assert relay.stats.preemptions == 0
    complete(relay, worker, aged.id)
    assert (await aged.next_events())[-1] == Completion(200, {}, b"{}")
    assert link.requests[-1].request_id == later[1].id
    await relay.aclose()


async def test_the_slot_a_preemption_frees_goes_to_an_aged_request_which_keeps_it():
    relay = make_relay(AGED)
    worker, link = attach(relay)
    victim = submit(relay, "flex")
    aged = submit(relay, "flex")
    await until_aged(relay)
    # A default request that arrives after the waiting flex one aged takes the slot of
    # the running flex one (it counts as flex), for the aged one: it was first.
    person = submit(relay, "default")
    assert [c.request_id for c in link.cancels] == [victim.id]
    assert link.requests[-1].request_id == aged.id
    assert person.phase is Phase.QUEUED and victim.phase is Phase.QUEUED
    # ... and what that decision placed is never preempted, then or later.
    urgent = submit(relay, "priority")
    assert [c.request_id for c in link.cancels] == [victim.id]
    assert aged.preemptions == 0 and urgent.phase is Phase.QUEUED
    for following in (aged, urgent, person, victim):
        assert link.requests[-1].request_id == following.id
        complete(relay, worker, following.id)
    assert relay.stats.preemptions == 1
    await relay.aclose()


def test_nothing_that_arrived_after_a_request_aged_passes_it():
    """The order the cluster's shared queue keeps too (test_cluster_routing)."""
    now = [0.0]
    queue = ClassedQueue(aging=10.0, clock=lambda: now[0])
    early = waiting(1, "default", requeued=True)  # put back: it arrived first
    flex, late, new = (
        waiting(2, "flex"),
        waiting(3, "default", requeued=True),
        waiting(4, "default"),
    )
    queue.push(flex)
    now[0] = 14.0
    for request in (early, late, new):
        queue.push(request)
    now[0] = 19.0  # the flex one counts as default since 10; the others are not aged
    models = frozenset({"m"})
    assert [queue.pop_for(models) for _ in range(4)] == [early, flex, late, new]


async def test_a_cancelled_or_finished_request_leaves_nothing_in_the_queue():
    relay = make_relay()
    attach(relay)
    submit(relay, "default")
    queued = [submit(relay, c) for c in ("flex", "default", "priority")]
    for r in queued:
        relay.cancel(r)
        assert (await r.next_events())[-1] is CANCELLED
    assert relay.queue_depth() == 0
    await relay.aclose()
