"""The relay core when a worker's backend cannot be reached (``backend_health``).

A request handed back with ``backend_unreachable`` goes to the front of the queue under
the requeue rules of SPEC §6 and is served by another worker; a worker that withdrew
its models because of its backend is shown as such and comes back with them.
"""

from __future__ import annotations

from relay.core import snapshot
from relay.core.state import Completion, Phase
from relay.wire import protocol
from relay.wire.errors import RequeueExhausted, WorkerFailed
from tests.corekit import FAST, attach, complete, make_relay, submit

HEALTH = [protocol.FLOW_CONTROL, protocol.BACKEND_HEALTH]


def hand_back(relay, worker, request_id: str) -> None:
    relay.on_worker_error(
        worker,
        protocol.Error(
            request_id=request_id,
            code=protocol.BACKEND_UNREACHABLE,
            message="the backend did not take the request: ConnectError",
        ),
    )


async def test_a_request_its_backend_never_took_is_served_by_another_worker():
    relay = make_relay()
    dead, dead_link = attach(relay, name="dead", features=HEALTH)
    alive, alive_link = attach(relay, name="alive", features=HEALTH)
    alive.in_flight["busy"] = object()  # type: ignore[assignment]  # "dead" is picked first
    request = submit(relay)
    assert request.worker is dead
    # The worker withdraws its models first, then hands the request back.
    relay.on_models_update(dead, [], 0, "ConnectError: connection refused")
    del alive.in_flight["busy"]
    hand_back(relay, dead, request.id)
    assert request.worker is alive and request.phase is Phase.ASSIGNED
    assert [r.request_id for r in alive_link.requests] == [request.id]
    assert request.requeues == 1 and relay.stats.requeues == 1
    complete(relay, alive, request.id, body="ok")
    events = await request.next_events()
    assert isinstance(events[-1], Completion) and events[-1].body == b"ok"
    # Withdrawn: nothing more is offered to it, and operators see why.
    later = submit(relay)
    assert later.worker is alive
    (dead_row,) = [w for w in snapshot.workers(relay) if w["name"] == "dead"]
    assert dead_row["backend"] == "unreachable" and "refused" in dead_row["backend_error"]
    assert dead_row["models"] == []
    assert len(dead_link.requests) == 1


async def test_it_waits_in_the_queue_for_a_worker_whose_backend_returns():
    relay = make_relay()
    worker, link = attach(relay, features=HEALTH)
    request = submit(relay)
    relay.on_models_update(worker, [], 0, "ConnectError")
    hand_back(relay, worker, request.id)
    assert request.phase is Phase.QUEUED and relay.queue_depth() == 1
    relay.on_models_update(worker, ["m"], 0, None)  # the probe found the backend again
    assert request.worker is worker and worker.backend_error is None
    assert [r.request_id for r in link.requests] == [request.id, request.id]
    row = snapshot.workers(relay)[0]
    assert row["backend"] == "ok" and row["backend_error"] is None


async def test_hand_backs_spend_the_requeue_budget():
    relay = make_relay(FAST)
    worker, _ = attach(relay, features=HEALTH)
    request = submit(relay)
    for _ in range(FAST.max_requeue_count):
        hand_back(relay, worker, request.id)
        assert request.worker is worker  # (its models were not withdrawn: sent again)
    hand_back(relay, worker, request.id)
    events = await request.next_events()
    assert isinstance(events[-1], RequeueExhausted)


async def test_a_worker_without_the_feature_fails_the_request_as_before():
    relay = make_relay()
    worker, _ = attach(relay)  # announced no backend_health
    request = submit(relay)
    hand_back(relay, worker, request.id)
    events = await request.next_events()
    assert isinstance(events[-1], WorkerFailed)
