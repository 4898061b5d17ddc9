"""Models on demand in one process (SPEC §19): the relay decides what is loaded where.

Workers here speak the ``model_states`` extension through a recording link; a test
plays the worker's part by answering ``model_load`` / ``model_unload`` and sending
``model_states`` as a real worker would.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from relay.core.relay import Relay
from relay.core.state import Completion, Worker
from relay.wire import protocol
from relay.wire.errors import ModelLoadFailed, ModelLoadTimeout, QueueTimeout
from relay.wire.protocol import LOADABLE, LOADED, LOADING, SLEEPING
from tests.corekit import FAST, RecordingLink, attach, complete, make_relay, submit

ON_DEMAND = dataclasses.replace(
    FAST,
    heartbeat_interval=30.0,
    heartbeat_timeout=60.0,
    model_scale_out_wait=0.0,
    model_load_timeout=5.0,
)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def ops(link: RecordingLink) -> list[protocol.ModelLoad | protocol.ModelUnload]:
    return [f for f in link.frames if isinstance(f, protocol.ModelLoad | protocol.ModelUnload)]


def loads(link: RecordingLink) -> list[str]:
    return [f.model for f in link.of_type(protocol.ModelLoad)]


def unloads(link: RecordingLink) -> list[str]:
    return [f.model for f in link.of_type(protocol.ModelUnload)]


def report(relay: Relay, worker: Worker, **changes: str) -> None:
    """The worker sends every model's state, ``changes`` applied."""
    states = {**(worker.states or {}), **changes}
    relay.on_model_states(
        worker,
        protocol.ModelStates(
            states=[protocol.ModelState(model=m, state=s) for m, s in states.items()]
        ),
    )


def answer(
    relay: Relay, worker: Worker, link: RecordingLink, *, ok: bool = True, error: str = ""
) -> None:
    """The worker answers its oldest unanswered operation (and reports the new state)."""
    answered = set(worker.ops)
    op = next(f for f in ops(link) if f.op_id in answered)
    load = isinstance(op, protocol.ModelLoad)
    state = (LOADED if load else LOADABLE) if ok else (worker.states or {}).get(op.model, "")
    relay.on_model_result(
        worker,
        protocol.ModelResult(
            op_id=op.op_id,
            model=op.model,
            op="load" if load else "unload",
            ok=ok,
            state=state,
            error=error or None,
            duration_ms=10,
        ),
    )


async def test_a_model_loaded_nowhere_is_loaded_once_for_all_its_waiting_requests() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(relay, states={"a": LOADED, "b": LOADABLE}, max_concurrent=4)
    waiting = [submit(relay, "b") for _ in range(10)]
    assert loads(link) == ["b"]  # ten requests, one load
    assert not link.requests  # nothing goes to a worker that has not loaded it
    answer(relay, worker, link)
    assert [r.model for r in link.requests] == ["b"] * 4  # every slot of the worker
    assert all(r.awaits_load for r in waiting)
    assert worker.model_counts["b"].loads == 1 and worker.model_counts["b"].waited == 4
    assert relay.stats.model_loads == 1
    await relay.aclose()


async def test_a_request_for_a_loaded_model_is_served_as_today() -> None:
    relay = make_relay(ON_DEMAND)
    _, link = attach(relay, states={"a": LOADED, "b": LOADABLE})
    request = submit(relay, "a")
    assert [r.request_id for r in link.requests] == [request.id]
    assert not ops(link) and not request.awaits_load
    await relay.aclose()


async def test_a_worker_without_the_extension_serves_every_model_it_was_acked_for() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(relay, ["a", "b"])
    assert worker.states is None
    submit(relay, "b")
    assert [r.model for r in link.requests] == ["b"] and not ops(link)
    await relay.aclose()


async def test_the_load_goes_to_a_free_model_slot_before_anything_is_unloaded() -> None:
    relay = make_relay(ON_DEMAND)
    _, full_link = attach(relay, states={"a": LOADED, "c": LOADABLE}, model_capacity=1, name="full")
    _, free_link = attach(relay, states={"b": LOADED, "c": LOADABLE}, model_capacity=2, name="free")
    submit(relay, "c")
    assert loads(free_link) == ["c"]
    assert not ops(full_link)
    await relay.aclose()


async def test_a_sleeping_copy_is_woken_rather_than_one_loaded_from_disk() -> None:
    relay = make_relay(ON_DEMAND)
    _, disk_link = attach(relay, states={"c": LOADABLE}, name="disk")
    _, asleep_link = attach(relay, states={"c": SLEEPING}, name="asleep")
    submit(relay, "c")
    assert loads(asleep_link) == ["c"] and not ops(disk_link)
    await relay.aclose()


async def test_a_full_worker_unloads_its_least_recently_used_idle_model_first() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(
        relay,
        states={"a": LOADED, "b": LOADED, "c": LOADABLE},
        model_capacity=2,
        max_concurrent=4,
    )
    complete(relay, worker, submit(relay, "a").id)  # a was used after b
    await asyncio.sleep(0.001)
    complete(relay, worker, submit(relay, "b").id)
    complete(relay, worker, submit(relay, "a").id)
    waiting = submit(relay, "c")
    assert unloads(link) == ["b"] and not loads(link)  # unload first, then load
    answer(relay, worker, link)
    assert loads(link) == ["c"]
    answer(relay, worker, link)
    assert link.requests[-1].request_id == waiting.id
    assert worker.model_counts["b"].unloads == 1
    await relay.aclose()


async def test_a_model_with_requests_in_flight_or_queued_is_never_unloaded() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(
        relay, states={"a": LOADED, "c": LOADABLE}, model_capacity=1, max_concurrent=1
    )
    running = submit(relay, "a")  # in flight
    queued_a = submit(relay, "a")  # waits for the slot
    waiting_c = submit(relay, "c")
    assert not ops(link)  # a is busy: nothing can make room for c yet
    complete(relay, worker, running.id)
    assert link.requests[-1].request_id == queued_a.id  # queued a goes first, a stays
    assert not ops(link)
    complete(relay, worker, queued_a.id)
    assert unloads(link) == ["a"]  # idle now: it makes room for c
    answer(relay, worker, link)
    answer(relay, worker, link)
    assert link.requests[-1].request_id == waiting_c.id
    await relay.aclose()


async def test_a_failed_load_is_tried_on_the_next_worker_then_the_waiting_requests_fail() -> None:
    relay = make_relay(ON_DEMAND)
    first, first_link = attach(relay, states={"c": LOADABLE}, name="first")
    second, second_link = attach(relay, states={"c": LOADABLE}, name="second")
    request = submit(relay, "c")
    tried = first if loads(first_link) else second
    other, other_link = (second, second_link) if tried is first else (first, first_link)
    answer(relay, tried, first_link if tried is first else second_link, ok=False, error="oom")
    assert loads(other_link) == ["c"]
    answer(relay, other, other_link, ok=False, error="oom")
    events = await request.next_events()
    assert isinstance(events[-1], ModelLoadFailed) and events[-1].status == 503
    assert relay.stats.model_load_failures == 2
    await relay.aclose()


async def test_a_request_waits_for_its_load_within_the_load_timeout_then_gets_504() -> None:
    config = dataclasses.replace(ON_DEMAND, queue_timeout=0.05, model_load_timeout=0.3)
    relay = make_relay(config)
    _, link = attach(relay, states={"c": LOADABLE})
    request = submit(relay, "c")
    assert loads(link) == ["c"]
    started = relay.loop.time()
    events = await request.next_events()
    waited = relay.loop.time() - started
    assert isinstance(events[-1], ModelLoadTimeout) and events[-1].status == 504
    assert "could not be loaded in time" in events[-1].message
    assert waited >= 0.25  # the load's timeout, not the queue's
    await relay.aclose()


async def test_a_request_that_only_waits_for_a_busy_loaded_model_times_out_as_usual() -> None:
    config = dataclasses.replace(ON_DEMAND, queue_timeout=0.05, model_load_timeout=5.0)
    relay = make_relay(config)
    attach(relay, states={"a": LOADED})
    submit(relay, "a")
    request = submit(relay, "a")
    events = await request.next_events()
    assert isinstance(events[-1], QueueTimeout) and not request.awaits_load
    await relay.aclose()


async def test_a_loaded_models_long_queue_gets_a_second_copy_where_a_model_slot_is_free() -> None:
    config = dataclasses.replace(ON_DEMAND, model_scale_out_wait=0.1)
    relay = make_relay(config)
    _busy, busy_link = attach(relay, states={"a": LOADED}, name="busy")
    spare, spare_link = attach(relay, states={"a": LOADABLE, "b": LOADED}, name="spare")
    submit(relay, "a")
    waiting = submit(relay, "a")
    assert not ops(spare_link) and not waiting.awaits_load
    await until(lambda: loads(spare_link) == ["a"])
    answer(relay, spare, spare_link)
    assert spare_link.requests[-1].request_id == waiting.id
    assert not ops(busy_link)
    await relay.aclose()


async def test_a_model_idle_past_the_bound_is_unloaded_and_a_busy_one_is_not() -> None:
    config = dataclasses.replace(ON_DEMAND, model_idle_unload=0.1)
    relay = make_relay(config)
    worker, link = attach(relay, states={"a": LOADED, "b": LOADED}, max_concurrent=2)
    running = submit(relay, "b")
    await until(lambda: unloads(link) == ["a"])
    answer(relay, worker, link)
    assert worker.states == {"a": LOADABLE, "b": LOADED}
    assert unloads(link) == ["a"]  # b runs a request: kept
    complete(relay, worker, running.id)
    await until(lambda: unloads(link) == ["a", "b"])
    await relay.aclose()


async def test_a_model_the_backend_dropped_by_itself_is_loaded_again_for_what_waits() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(relay, states={"a": LOADED}, max_concurrent=1)
    running = submit(relay, "a")
    waiting = submit(relay, "a")
    report(relay, worker, a=LOADABLE)  # an operator unloaded it on the box
    assert worker.model_set == frozenset()
    complete(relay, worker, running.id, body="{}")
    assert loads(link) == ["a"] and waiting.awaits_load
    answer(relay, worker, link)
    assert link.requests[-1].request_id == waiting.id
    await relay.aclose()


async def test_a_load_the_backend_started_itself_is_waited_for_not_repeated() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(relay, states={"a": LOADING})
    request = submit(relay, "a")
    assert not ops(link)
    report(relay, worker, a=LOADED)
    assert link.requests[-1].request_id == request.id
    await relay.aclose()


async def test_a_worker_that_connects_holding_a_waited_for_model_loads_it() -> None:
    relay = make_relay(ON_DEMAND, declared_models=frozenset({"c"}))
    request = submit(relay, "c")  # declared, no worker yet: it waits in the queue
    worker, link = attach(relay, states={"c": LOADABLE})
    assert loads(link) == ["c"]
    answer(relay, worker, link)
    assert link.requests[-1].request_id == request.id and request.awaits_load
    await relay.aclose()


async def test_when_the_loading_worker_leaves_the_load_goes_to_another() -> None:
    relay = make_relay(ON_DEMAND)
    first, first_link = attach(relay, states={"c": LOADABLE}, name="first")
    second, second_link = attach(relay, states={"c": LOADABLE}, name="second")
    submit(relay, "c")
    loading, other_link = (first, second_link) if loads(first_link) else (second, first_link)
    relay.close_worker(loading, 1001, "gone")
    assert loads(other_link) == ["c"]
    await relay.aclose()


async def test_states_for_models_the_worker_was_not_acked_for_are_ignored() -> None:
    relay = make_relay(ON_DEMAND)
    worker, _ = attach(relay, states={"a": LOADED})
    report(relay, worker, intruder=LOADED)
    assert worker.states == {"a": LOADED}
    assert not relay.registry.serving("local", "intruder")
    await relay.aclose()


@pytest.mark.parametrize("state", ["asleep-ish", ""])
async def test_a_state_the_relay_does_not_know_counts_as_not_loaded(state: str) -> None:
    relay = make_relay(ON_DEMAND)
    _worker, link = attach(relay, states={"a": state})
    submit(relay, "a")
    assert not link.requests and loads(link) == ["a"]
    assert relay.registry.serving("local", "a") and not relay.registry.loaded("local", "a")
    await relay.aclose()


async def test_an_answer_to_an_operation_never_sent_is_dropped() -> None:
    relay = make_relay(ON_DEMAND)
    worker, _ = attach(relay, states={"a": LOADABLE})
    relay.on_model_result(
        worker,
        protocol.ModelResult(op_id="m-nope", model="a", op="load", ok=True, state=LOADED),
    )
    assert worker.states == {"a": LOADABLE}
    await relay.aclose()


async def test_a_completion_still_flows_while_a_model_loads_elsewhere_on_the_worker() -> None:
    relay = make_relay(ON_DEMAND)
    worker, link = attach(relay, states={"a": LOADED, "b": LOADABLE}, max_concurrent=2)
    running = submit(relay, "a")
    submit(relay, "b")
    assert loads(link) == ["b"]
    complete(relay, worker, running.id)
    events = await running.next_events()
    assert isinstance(events[-1], Completion) and events[-1].status == 200
    await relay.aclose()
