"""Requests that generate nothing (token counting) never take or wait for a generation
slot: they go at once to a worker serving the model, at most
NON_GENERATING_PER_WORKER at a time on each."""

from __future__ import annotations

import dataclasses

import pytest

from relay.core.state import Completion, Phase, RelayRequest
from relay.wire import protocol
from relay.wire.errors import QueueFull
from tests.corekit import FAST, attach, complete, make_relay, submit

COUNT = "/v1/messages/count_tokens"


def count_tokens(relay) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path=COUNT,
        flavor="anthropic",
        is_streaming=False,
        body='{"model":"m","messages":[]}',
        headers={"content-type": "application/json"},
    )


async def test_token_counting_runs_while_every_generation_slot_is_busy():
    relay = make_relay()
    worker, link = attach(relay, max_concurrent=1)
    generating = submit(relay)
    waiting = submit(relay)
    assert generating.worker is worker and waiting.phase is Phase.QUEUED
    counted = count_tokens(relay)
    assert counted.worker is worker and counted.phase is Phase.ASSIGNED
    assert link.requests[-1].endpoint_path == COUNT
    assert worker.load == 1 and worker.light == 1  # no generation slot taken
    complete(relay, worker, counted.id, body='{"input_tokens":3}')
    (answer,) = await counted.next_events()
    assert isinstance(answer, Completion) and answer.body == b'{"input_tokens":3}'
    assert worker.light == 0 and waiting.phase is Phase.QUEUED  # its end freed no slot
    complete(relay, worker, generating.id)
    assert waiting.worker is worker  # the generation slot goes to the one waiting


async def test_they_spread_over_workers_and_are_bounded_per_worker():
    relay = make_relay(dataclasses.replace(FAST, non_generating_per_worker=2))
    one, _ = attach(relay, name="one", max_concurrent=1)
    two, _ = attach(relay, name="two", max_concurrent=1)
    placed = [count_tokens(relay) for _ in range(4)]
    assert sorted(r.worker.name for r in placed if r.worker) == ["one", "one", "two", "two"]
    with pytest.raises(QueueFull):
        count_tokens(relay)
    assert relay.stats.by_outcome["queue_full"] == 1
    relay.on_worker_error(one, protocol.Error(request_id=placed[0].id, message="boom"))
    assert one.light == 1
    assert count_tokens(relay).worker is one  # room again
    assert one.load == 0 and two.load == 0


async def test_one_lost_with_its_worker_is_requeued_and_counts_no_slot_anywhere():
    relay = make_relay()
    gone, _ = attach(relay, name="gone", max_concurrent=1)
    counted = count_tokens(relay)
    relay.detach_worker(gone, "closed")
    assert counted.phase is Phase.QUEUED and gone.light == 0
    stays, _ = attach(relay, name="stays", max_concurrent=1)
    assert counted.worker is stays and stays.load == 0 and stays.light == 1


async def test_without_a_worker_serving_the_model_it_waits_like_any_request():
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=1)
    relay.on_models_update(worker, [], 0)  # known model, no worker right now
    counted = count_tokens(relay)
    assert counted.phase is Phase.QUEUED
    relay.on_models_update(worker, ["m"], 0)
    assert counted.worker is worker and worker.load == 0


async def test_one_the_cluster_placed_under_a_lease_holds_a_slot_like_any():
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=1)
    relay.on_models_update(worker, [], 0)
    counted = count_tokens(relay)  # queued: no worker serves the model here
    relay.on_models_update(worker, ["other"], 0)
    counted.lease = "lease-1"  # what the placement does before assign_to
    assert relay.assign_to(counted, worker)
    assert not counted.light and worker.light == 0 and worker.load == 1
