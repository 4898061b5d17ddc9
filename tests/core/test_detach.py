"""A stream's client that leaves after the stream's last event (``Relay.detach``): the
request is finished, not cancelled, when its completion comes, within a grace."""

from __future__ import annotations

import asyncio
import dataclasses

from relay.core.limits import KeyLimits, Limiter
from relay.core.limitstore import MemoryLimitStore
from relay.core.state import Phase
from relay.core.stats import RequestRecord
from relay.wire import protocol
from tests.corekit import FAST, attach, make_relay, submit

COUNTS = protocol.TokenCounts(prompt_tokens=7, completion_tokens=5)


def finish(relay, worker, request_id: str) -> None:
    relay.on_complete(
        worker,
        protocol.ResponseComplete(
            request_id=request_id, status_code=200, headers={}, token_counts=COUNTS
        ),
    )


async def test_a_detached_stream_is_finished_ok_and_charged_and_its_worker_is_not_cancelled():
    relay = make_relay()
    records: list[RequestRecord] = []
    relay.observers.append(records.append)
    worker, link = attach(relay)
    gate = Limiter(MemoryLimitStore())
    request = relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=True,
        body="{}",
        headers={},
        key_id=1,
        ticket=await gate.admit(1, KeyLimits(tokens_per_day=1000), "m"),
    )
    relay.on_chunk(worker, request.id, "data: [DONE]\n\n")
    relay.detach(request)
    relay.detach(request)  # the watcher and the edge's finally both say so: once
    assert request.phase is Phase.ASSIGNED and worker.load == 1
    assert link.cancels == [] and relay.stats.left_after_end == 1
    relay.on_chunk(worker, request.id, "\n")  # nobody reads it: not buffered
    assert request.pending == len("data: [DONE]\n\n")
    relay.release(request)
    finish(relay, worker, request.id)
    assert (request.status, request.outcome, worker.load) == (200, "ok", 0)
    assert [(r.status, r.outcome, r.prompt_tokens, r.completion_tokens) for r in records] == [
        (200, "ok", 7, 5)
    ]
    assert await gate.spend([1]) == {1: (12, 12)}
    assert link.cancels == [] and relay.buffered == 0


async def test_without_a_completion_within_the_grace_it_is_cancelled_as_a_disconnect():
    relay = make_relay(dataclasses.replace(FAST, stream_end_grace=0.05))
    worker, link = attach(relay)
    request = submit(relay, stream=True)
    relay.detach(request)
    async with asyncio.timeout(2):
        while request.phase is not Phase.DONE:
            await asyncio.sleep(0.01)
    assert (request.status, request.outcome) == (499, "cancelled")
    assert [c.reason for c in link.cancels] == ["client_disconnect"]
    assert worker.load == 0


async def test_a_deadline_before_the_grace_ends_stands():
    relay = make_relay(dataclasses.replace(FAST, stream_end_grace=60.0), request_timeout=0.05)
    _, link = attach(relay)
    request = submit(relay, stream=True)
    relay.detach(request)
    async with asyncio.timeout(2):
        while request.phase is not Phase.DONE:
            await asyncio.sleep(0.01)
    assert (request.status, request.outcome) == (504, "request_timeout")
    assert [c.reason for c in link.cancels] == ["timeout"]


async def test_a_request_not_in_flight_is_cancelled_and_an_ended_one_left_alone():
    relay = make_relay()
    worker, link = attach(relay)
    running = submit(relay, stream=True)
    queued = submit(relay, stream=True)
    relay.detach(queued)
    assert (queued.status, queued.outcome) == (499, "cancelled")
    finish(relay, worker, running.id)
    relay.detach(running)
    assert (running.status, running.outcome) == (200, "ok")
    assert link.cancels == [] and relay.stats.left_after_end == 0
