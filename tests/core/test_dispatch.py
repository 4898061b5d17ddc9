"""The relay core's contract (SPEC §6), exercised without Django or sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from relay.core.config import ProviderPolicy
from relay.core.state import CANCELLED, Completion, Phase, RelayRequest
from relay.wire import protocol
from relay.wire.errors import (
    ModelNotFound,
    ProviderDisabled,
    ProviderGone,
    QueueFull,
    QueueTimeout,
    RequestTimeout,
    RequeueExhausted,
    ShuttingDown,
    StreamTooLarge,
    WorkerFailed,
    WorkerLost,
)
from tests.corekit import FAST, RecordingLink, attach, complete, make_relay, submit


async def terminal(request: RelayRequest, timeout: float = 2.0) -> object:
    """Wait for the request's final event; returns it (chunks are skipped)."""
    async with asyncio.timeout(timeout):
        while True:
            for event in await request.next_events():
                if not isinstance(event, bytes):
                    return event


# -- selection ---------------------------------------------------------------


async def test_it_routes_to_the_lowest_loaded_worker():
    relay = make_relay()
    _, busy_link = attach(relay, max_concurrent=4, name="busy", load=3)
    idle, idle_link = attach(relay, max_concurrent=4, name="idle", load=1)
    request = submit(relay)
    assert request.worker is idle
    assert [r.request_id for r in idle_link.requests] == [request.id]
    assert busy_link.requests == []


async def test_it_round_robins_between_equally_loaded_workers():
    relay = make_relay()
    links = [attach(relay, max_concurrent=10, name=f"w{i}")[1] for i in range(3)]
    for _ in range(3):
        request = submit(relay)
        assert request.worker is not None
        complete(relay, request.worker, request.id)  # back to equal load each time
    assert [len(link.requests) for link in links] == [1, 1, 1]


async def test_a_completion_frees_its_slot_at_once_whatever_the_last_pong_said():
    relay = make_relay()
    worker, link = attach(relay, max_concurrent=1)
    first = submit(relay)
    relay.on_pong(worker, 1)  # the worker counts the request it runs: nothing extra
    second = submit(relay)
    assert second.phase is Phase.QUEUED
    complete(relay, worker, first.id)
    assert second.phase is Phase.ASSIGNED  # no pong needed to see the free slot
    assert [r.request_id for r in link.requests] == [first.id, second.id]


async def test_a_pong_adds_only_load_the_server_does_not_know_about():
    relay = make_relay()
    worker, link = attach(relay, max_concurrent=2, load=1)  # one request of its own
    first = submit(relay)
    assert first.phase is Phase.ASSIGNED
    assert worker.load == 2
    second = submit(relay)
    assert second.phase is Phase.QUEUED
    relay.on_pong(worker, 1)  # its own request finished: only ours is left
    assert second.phase is Phase.ASSIGNED  # the freed slot is used at once
    assert worker.load == 2
    relay.on_pong(worker, 5)  # three more the server no longer tracks (cancelled ones)
    assert worker.load == 5
    complete(relay, worker, first.id)
    assert worker.load == 4
    relay.on_pong(worker, 1)  # they stopped: only the second request is left
    assert worker.load == 1
    assert len(link.requests) == 2


async def test_it_routes_only_to_workers_acked_for_the_model():
    relay = make_relay()
    _, other_link = attach(relay, ["other"], name="other")
    _, m_link = attach(relay, ["m"], name="m")
    request = submit(relay, "m")
    assert request.worker_name == "m"
    assert other_link.requests == []
    assert m_link.requests[0].model == "m"


async def test_it_never_routes_to_a_draining_worker():
    relay = make_relay()
    draining, _ = attach(relay, max_concurrent=5, name="draining")
    submit(relay)  # keep it busy so drain does not close it at once
    relay.drain_worker(draining.id)
    _, fresh_link = attach(relay, max_concurrent=5, name="fresh", load=3)
    request = submit(relay)
    assert request.worker_name == "fresh"
    assert len(fresh_link.requests) == 1


async def test_the_request_frame_carries_the_raw_body_and_headers():
    relay = make_relay()
    _, link = attach(relay)
    body = '{"model":"m",  "messages":[{"role":"user","content":"h\\u00e9"}]}'
    request = submit(relay, body=body, stream=True)
    frame = link.requests[0]
    assert frame == protocol.Request(
        request_id=request.id,
        model="m",
        endpoint_path="/v1/chat/completions",
        is_streaming=True,
        body=body,
        headers={"content-type": "application/json"},
    )


# -- queue -------------------------------------------------------------------


async def test_queued_work_is_dispatched_the_moment_a_slot_frees():
    relay = make_relay()
    worker, link = attach(relay)
    first = submit(relay)
    second = submit(relay)
    assert second.phase is Phase.QUEUED
    complete(relay, worker, first.id)
    assert second.phase is Phase.ASSIGNED
    assert [r.request_id for r in link.requests] == [first.id, second.id]
    assert relay.queue_depth() == 0


async def test_queue_is_fifo_among_requests_a_worker_can_serve():
    relay = make_relay()
    worker, link = attach(relay, ["a", "b"])
    blocker = submit(relay, "a")
    older_b = submit(relay, "b")
    newer_a = submit(relay, "a")
    relay.on_models_update(worker, ["a"], None)  # now only "a" is compatible
    complete(relay, worker, blocker.id)
    assert newer_a.phase is Phase.ASSIGNED  # oldest compatible, skipping "b"
    assert older_b.phase is Phase.QUEUED
    relay.on_models_update(worker, ["a", "b"], None)
    complete(relay, worker, newer_a.id)
    assert older_b.phase is Phase.ASSIGNED
    assert [r.request_id for r in link.requests] == [blocker.id, newer_a.id, older_b.id]


async def test_a_new_worker_takes_queued_work_at_once():
    relay = make_relay(declared_models=frozenset({"m"}))
    request = submit(relay)  # declared model, nobody connected: queued, not 404
    assert request.phase is Phase.QUEUED
    _, link = attach(relay)
    assert request.phase is Phase.ASSIGNED
    assert link.requests[0].request_id == request.id


async def test_a_pong_with_lower_load_dispatches_queued_work():
    relay = make_relay()
    worker, link = attach(relay, max_concurrent=2, load=2)
    request = submit(relay)
    assert request.phase is Phase.QUEUED
    relay.on_pong(worker, 0)
    assert request.phase is Phase.ASSIGNED
    assert link.requests[0].request_id == request.id


async def test_models_update_dispatches_queued_work_for_new_models():
    relay = make_relay()
    worker, _ = attach(relay, ["m"])
    attach(relay, ["n"], name="other", load=1)
    request = submit(relay, "n")
    assert request.phase is Phase.QUEUED
    relay.on_models_update(worker, ["m", "n"], 0)
    assert request.worker is worker


async def test_a_full_queue_rejects_with_429():
    relay = make_relay(max_queue_len=1)
    attach(relay)
    submit(relay)
    submit(relay)
    with pytest.raises(QueueFull) as err:
        submit(relay)
    assert err.value.status == 429
    assert err.value.message == "Service temporarily at capacity, please retry"
    assert relay.stats.by_outcome["queue_full"] == 1


async def test_queue_bound_zero_rejects_when_no_capacity():
    relay = make_relay(max_queue_len=0)
    attach(relay)
    assert submit(relay).phase is Phase.ASSIGNED
    with pytest.raises(QueueFull):
        submit(relay)


async def test_queue_timeout_fails_with_504_and_no_worker_hears_of_it():
    relay = make_relay(queue_timeout=0.05)
    _, link = attach(relay)
    submit(relay)
    waiting = submit(relay)
    result = await terminal(waiting)
    assert isinstance(result, QueueTimeout)
    assert result.status == 504
    assert result.message == "Request timed out waiting for worker"
    assert relay.queue_depth() == 0
    assert len(link.requests) == 1 and link.cancels == []


async def test_unknown_model_is_404_but_a_recently_seen_one_queues():
    relay = make_relay()
    with pytest.raises(ModelNotFound) as err:
        submit(relay, "ghost")
    assert err.value.message == "model 'ghost' is not served here"
    worker, _ = attach(relay, ["m"])
    relay.close_worker(worker, 1001, "restarting")
    request = submit(relay, "m")  # remembered for model_memory seconds
    assert request.phase is Phase.QUEUED


# -- cancellation ------------------------------------------------------------


async def test_cancel_while_queued_removes_it_silently():
    relay = make_relay()
    worker, link = attach(relay)
    first = submit(relay)
    queued = submit(relay)
    relay.cancel(queued)
    assert await terminal(queued) is CANCELLED
    assert relay.queue_depth() == 0
    complete(relay, worker, first.id)
    assert [r.request_id for r in link.requests] == [first.id]
    assert link.cancels == []


async def test_cancel_in_flight_sends_one_cancel_and_frees_the_slot_at_once():
    relay = make_relay()
    worker, link = attach(relay)
    first = submit(relay)
    queued = submit(relay)
    relay.cancel(first, "client_disconnect")
    relay.cancel(first, "client_disconnect")  # idempotent
    assert link.cancels == [protocol.Cancel(request_id=first.id, reason="client_disconnect")]
    assert first.id not in worker.in_flight
    assert queued.worker is worker  # the freed slot went straight to the queue
    assert relay.stats.cancels["client_disconnect"] == 1


async def test_only_cancels_that_reach_a_worker_are_counted_as_sent():
    relay = make_relay()
    attach(relay)
    submit(relay)
    queued = submit(relay)
    relay.cancel(queued)  # removed from the queue: no worker ever hears of it
    assert relay.stats.cancels == {}
    assert relay.stats.by_outcome["cancelled"] == 1


async def test_late_frames_for_a_cancelled_request_are_dropped():
    relay = make_relay()
    worker, _ = attach(relay)
    request = submit(relay, stream=True)
    relay.cancel(request)
    relay.on_chunk(worker, request.id, "data: late\n\n")
    complete(relay, worker, request.id)
    assert await request.next_events() == [CANCELLED]
    assert worker.load == 0
    assert relay.stats.dropped_frames == 2


async def test_request_timeout_cancels_the_worker_with_reason_timeout():
    relay = make_relay(request_timeout=0.05)
    worker, link = attach(relay)
    request = submit(relay)
    result = await terminal(request)
    assert isinstance(result, RequestTimeout) and result.status == 504
    assert link.cancels == [protocol.Cancel(request_id=request.id, reason="timeout")]
    assert worker.load == 0


async def test_queued_request_never_outlives_its_request_timeout():
    relay = make_relay(request_timeout=0.05, queue_timeout=30)
    attach(relay)
    submit(relay)
    waiting = submit(relay)
    assert isinstance(await terminal(waiting), RequestTimeout)


# -- worker loss -------------------------------------------------------------


async def test_worker_loss_requeues_ahead_of_newer_arrivals():
    relay = make_relay()
    doomed, _ = attach(relay, name="doomed")
    survivor, survivor_link = attach(relay, name="survivor", load=1)
    lost = submit(relay)
    assert lost.worker is doomed
    newer = submit(relay)
    assert newer.phase is Phase.QUEUED
    relay.detach_worker(doomed, "connection lost")
    assert lost.phase is Phase.QUEUED and lost.requeues == 1
    relay.on_pong(survivor, 0)
    assert lost.worker is survivor  # the older request goes first
    assert newer.phase is Phase.QUEUED
    assert survivor_link.requests[0].request_id == lost.id
    assert relay.stats.requeues == 1


async def test_requeue_is_capped_then_503():
    relay = make_relay()
    request = None
    for attempt in range(FAST.max_requeue_count + 1):
        worker, _ = attach(relay, name=f"w{attempt}")
        if request is None:
            request = submit(relay)
        assert request.worker is worker
        relay.detach_worker(worker, "crash")
    assert request is not None
    result = await terminal(request)
    assert isinstance(result, RequeueExhausted)
    assert result.message == "Request could not be processed after multiple attempts"
    assert result.status == 503


async def test_a_stream_that_already_sent_bytes_is_not_requeued():
    relay = make_relay()
    worker, _ = attach(relay)
    request = submit(relay, stream=True)
    relay.on_chunk(worker, request.id, "data: one\n\n")
    relay.detach_worker(worker, "crash")
    events = await request.next_events()
    assert events[0] == b"data: one\n\n"
    assert isinstance(events[1], WorkerLost)
    assert relay.queue_depth() == 0


async def test_requeue_keeps_the_first_arrival_deadline():
    relay = make_relay(request_timeout=0.2, queue_timeout=5)
    worker, _ = attach(relay)
    request = submit(relay)
    deadline = request.deadline
    relay.detach_worker(worker, "crash")
    assert request.deadline == deadline
    assert request.queue_deadline <= deadline
    assert isinstance(await terminal(request), RequestTimeout)


async def test_non_streaming_partial_chunks_are_discarded_on_requeue():
    relay = make_relay()
    first, _ = attach(relay, name="first")
    request = submit(relay)
    relay.on_chunk(first, request.id, "partial")
    relay.detach_worker(first, "crash")
    second, _ = attach(relay, name="second")
    relay.on_chunk(second, request.id, '{"a":')
    complete(relay, second, request.id, body="1}")
    result = await terminal(request)
    assert isinstance(result, Completion) and result.body == b'{"a":1}'


# -- worker reports ----------------------------------------------------------


async def test_invalid_status_fails_the_request_with_502_and_frees_the_slot():
    relay = make_relay()
    worker, _ = attach(relay)
    request = submit(relay)
    complete(relay, worker, request.id, status=999)
    result = await terminal(request)
    assert isinstance(result, WorkerFailed) and result.status == 502
    assert worker.load == 0


async def test_worker_error_with_request_id_fails_that_request_with_502():
    relay = make_relay()
    worker, _ = attach(relay, max_concurrent=2)
    failing = submit(relay)
    healthy = submit(relay)
    relay.on_worker_error(worker, protocol.Error(request_id=failing.id, message="oom"))
    relay.on_worker_error(worker, protocol.Error(message="just a note"))
    assert isinstance(await terminal(failing), WorkerFailed)
    assert healthy.phase is Phase.ASSIGNED
    assert worker.load == 1


async def test_upstream_errors_pass_through_as_completions():
    relay = make_relay()
    worker, _ = attach(relay)
    request = submit(relay)
    relay.on_complete(
        worker,
        protocol.ResponseComplete(
            request_id=request.id,
            status_code=422,
            headers={"content-type": "application/json", "x-upstream": "1"},
            body='{"error":"bad"}',
            token_counts=protocol.TokenCounts(prompt_tokens=3, completion_tokens=0),
        ),
    )
    result = await terminal(request)
    assert result == Completion(
        422, {"content-type": "application/json", "x-upstream": "1"}, b'{"error":"bad"}'
    )
    record = relay.stats.recent[-1]
    assert (record.outcome, record.status, record.prompt_tokens) == ("upstream_error", 422, 3)


async def test_stream_ceiling_ends_the_stream_and_cancels_the_worker():
    relay = make_relay(dataclasses.replace(FAST, max_stream_bytes=10))
    worker, link = attach(relay)
    request = submit(relay, stream=True)
    relay.on_chunk(worker, request.id, "123456")
    relay.on_chunk(worker, request.id, "7890ab")
    events = await request.next_events()
    assert events[0] == b"123456"
    assert isinstance(events[1], StreamTooLarge)
    # A worker of the reference protocol gets the nearest reason it knows.
    assert link.cancels == [protocol.Cancel(request_id=request.id, reason="client_disconnect")]
    assert worker.load == 0


async def test_workers_that_announce_features_hear_what_really_ended_a_stream():
    relay = make_relay(dataclasses.replace(FAST, max_stream_bytes=10))
    link = RecordingLink()
    worker, _ = relay.attach_worker(
        provider="local",
        name="new",
        models=["m"],
        max_concurrent=1,
        current_load=0,
        link=link,
        features=[protocol.FLOW_CONTROL, "something-from-the-future"],
    )
    assert worker.features == {protocol.FLOW_CONTROL}
    assert link.of_type(protocol.RegisterAck)[0].features == [protocol.FLOW_CONTROL]
    request = submit(relay, stream=True)
    relay.on_chunk(worker, request.id, "x" * 11)
    assert link.cancels == [protocol.Cancel(request_id=request.id, reason="stream_limit")]
    assert relay.stats.cancels == {"stream_limit": 1}


async def test_chunks_arrive_in_order_and_then_the_completion():
    relay = make_relay()
    worker, _ = attach(relay)
    request = submit(relay, stream=True)
    for i in range(5):
        relay.on_chunk(worker, request.id, f"data: {i}\n\n")
    complete(relay, worker, request.id, body="")
    events = await request.next_events()
    assert events[:5] == [f"data: {i}\n\n".encode() for i in range(5)]
    assert isinstance(events[5], Completion)
    record = relay.stats.recent[-1]
    assert record.ttfb is not None and record.outcome == "ok"


# -- heartbeat, drain, providers, shutdown ------------------------------------


async def test_silent_workers_are_pinged_then_closed_and_their_work_requeued():
    relay = make_relay()
    _, silent_link = attach(relay, name="silent")
    request = submit(relay)
    async with asyncio.timeout(2):
        while silent_link.closed is None:
            await asyncio.sleep(0.01)
            if silent_link.of_type(protocol.Ping) and len(silent_link.of_type(protocol.Ping)) > 10:
                break
    assert silent_link.of_type(protocol.Ping), "the server pings"
    assert silent_link.closed == (1001, "worker heartbeat timed out")
    assert request.phase is Phase.QUEUED and request.requeues == 1
    await relay.aclose()


async def test_a_ponging_worker_stays_connected():
    relay = make_relay()
    worker, link = attach(relay)
    async with asyncio.timeout(2):
        while len(link.of_type(protocol.Ping)) < 8:
            await asyncio.sleep(0.01)
            relay.on_pong(worker, 0)
    assert link.closed is None
    await relay.aclose()


async def test_drain_lets_in_flight_finish_then_closes_the_worker():
    relay = make_relay()
    worker, link = attach(relay, max_concurrent=2)
    request = submit(relay)
    assert relay.drain_worker(worker.id, timeout=30, reason="maintenance")
    assert link.of_type(protocol.GracefulShutdown) == [
        protocol.GracefulShutdown(reason="maintenance", drain_timeout_secs=30)
    ]
    assert relay.registry.select("local", "m") is None  # no new work while draining
    assert link.closed is None
    complete(relay, worker, request.id)
    assert link.closed == (1000, "worker drained")
    assert not worker.attached


async def test_drain_deadline_closes_and_requeues_what_is_left():
    relay = make_relay()
    worker, link = attach(relay)
    request = submit(relay)
    relay.drain_worker(worker.id, timeout=0.05)
    async with asyncio.timeout(2):
        while link.closed is None:
            await asyncio.sleep(0.01)
    assert link.closed == (1000, "drain timeout")
    assert request.phase is Phase.QUEUED and request.requeues == 1


async def test_draining_an_unknown_worker_reports_false():
    relay = make_relay()
    assert relay.drain_worker("w-nope") is False
    assert relay.refresh_models("w-nope") is False


async def test_refresh_models_sends_models_refresh():
    relay = make_relay()
    worker, link = attach(relay)
    assert relay.refresh_models(worker.id)
    assert link.of_type(protocol.ModelsRefresh) == [protocol.ModelsRefresh(reason="operator")]


async def test_disabling_a_provider_fails_its_queue_and_closes_its_workers():
    relay = make_relay()
    worker, link = attach(relay)
    in_flight = submit(relay)
    queued = submit(relay)
    relay.set_provider(ProviderPolicy.from_overrides(FAST, "local", enabled=False))
    assert isinstance(await terminal(queued), ProviderDisabled)
    assert isinstance(await terminal(in_flight), ProviderDisabled)
    assert link.closed == (1008, "provider disabled")
    with pytest.raises(ProviderDisabled) as err:
        relay.submit(
            model="m",
            endpoint_path="/v1/messages",
            flavor="anthropic",
            is_streaming=False,
            body="{}",
            headers={},
        )
    assert err.value.message == "Provider is currently disabled"
    del worker


async def test_deleting_a_provider_fails_its_queue_with_the_generic_error():
    relay = make_relay(declared_models=frozenset({"m"}))
    queued = submit(relay)
    relay.remove_provider("local")
    result = await terminal(queued)
    assert isinstance(result, ProviderGone) and result.status == 503
    with pytest.raises(ModelNotFound):
        submit(relay)


async def test_provider_sync_keeps_providers_touched_after_the_snapshot():
    relay = make_relay()
    as_of = relay.loop.time()
    relay.set_provider(ProviderPolicy.from_overrides(FAST, "new"))  # touched after as_of
    relay.sync_providers([ProviderPolicy.from_overrides(FAST, "local")], as_of=as_of)
    assert set(relay.providers) == {"local", "new"}
    relay.sync_providers([], as_of=relay.loop.time() + 1)
    assert relay.providers == {}


async def test_shutdown_refuses_new_work_finishes_in_flight_then_closes_1012():
    relay = make_relay()
    worker, link = attach(relay)
    request = submit(relay)
    stopping = asyncio.ensure_future(relay.shutdown(grace=5))
    await asyncio.sleep(0)
    with pytest.raises(ShuttingDown):
        submit(relay)
    assert link.closed is None
    complete(relay, worker, request.id)
    await asyncio.wait_for(stopping, 2)
    assert isinstance(await terminal(request), Completion)
    assert link.closed == (1012, "server restarting")


async def test_register_ack_reports_sanitized_models_and_warnings():
    relay = make_relay(max_models_per_worker=2)
    _, link = attach(relay, [" a", "a", "", "b", "c"])
    ack = link.of_type(protocol.RegisterAck)[0]
    assert ack.models == ["a", "b"]
    assert ack.warnings == [
        "trimmed whitespace from 1 model name(s)",
        "dropped 1 empty model name(s)",
        "dropped 1 duplicate model name(s)",
        "accepted only the first 2 models; dropped 1",
    ]
    assert link.frames[0] == ack  # the ack precedes any request


async def test_load_returns_to_zero_after_every_ending():
    relay = make_relay(queue_timeout=0.05, request_timeout=0.1)
    worker, _ = attach(relay, max_concurrent=10)
    a, b, c, d = (submit(relay, stream=True) for _ in range(4))
    complete(relay, worker, a.id)
    relay.cancel(b)
    relay.on_worker_error(worker, protocol.Error(request_id=c.id, message="x"))
    complete(relay, worker, "r-unknown")
    complete(relay, worker, a.id)  # duplicate completion
    await terminal(d)  # request timeout
    assert worker.load == 0 and not worker.in_flight
    assert relay.active == 0


async def test_churn_of_names_and_ids_from_outside_leaves_nothing_behind():
    """Everything keyed by a worker id or a model name a worker chose is dropped when it
    leaves, or remembered for MODEL_MEMORY_SECS within a bound (SPEC §6)."""
    relay = make_relay(dataclasses.replace(FAST, model_memory=0.0))
    registry = relay.registry
    baseline = (len(registry.workers), len(registry._by_model), registry.remembered())
    for i in range(10_000):
        worker, _ = attach(relay, [f"model-{i}", f"other-{i}"], name=f"box-{i}")
        relay.on_models_update(worker, [f"renamed-{i}"], 0)
        if i % 10 == 0:  # a thousand of them serve a request under a name of their own
            request = submit(relay, f"renamed-{i}", stream=True)
            complete(relay, worker, request.id)
        relay.close_worker(worker, 1000, "gone")
    registry.forget_expired(relay.loop.time() + 1)
    assert (len(registry.workers), len(registry._by_model), registry.remembered()) == baseline
    assert len(registry._cursor) <= len(relay.providers)
    assert relay._drain_timers == {}
    # Counters keep what they counted, under a bounded number of labels.
    assert len(relay.stats._models) <= 500
    assert relay.stats.by_outcome["ok"] == 1000
    assert len(relay.stats.by_endpoint_model_outcome) == 501  # 500 names, then "(other)"


async def test_model_memory_stays_bounded_however_fast_names_churn():
    relay = make_relay(dataclasses.replace(FAST, model_memory=3600.0))
    for i in range(12_000):
        worker, _ = attach(relay, [f"model-{i}"], name=f"box-{i}")
        relay.close_worker(worker, 1000, "gone")
    assert relay.registry.remembered() <= 10_000
    assert relay.registry.remembers("local", "model-11999", relay.loop.time())


# -- exclusive models ------------------------------------------------------------


async def test_a_model_declared_exclusive_is_never_routed_to_another_providers_worker():
    relay = make_relay()
    relay.set_provider(ProviderPolicy.from_overrides(FAST, "b", exclusive_models=frozenset({"m"})))
    squatter, squatter_link = attach(relay, ["m", "own"], name="squatter")
    ack = squatter_link.of_type(protocol.RegisterAck)[0]
    assert ack.models == ["own"]
    assert ack.warnings == ["not acked, reserved for another provider: 'm'"]
    request = submit(relay, "m")
    assert request.phase is Phase.QUEUED and request.provider == "b"  # waits for b
    owner, owner_link = attach(relay, ["m"], provider="b", name="owner")
    assert request.worker is owner
    assert relay.routable_models()["m"] == {"b"}
    relay.on_models_update(squatter, ["m", "own", "more"], 0)
    assert squatter.models == ("own", "more")
    assert [r.request_id for r in squatter_link.requests] == []
    assert [r.request_id for r in owner_link.requests] == [request.id]


async def test_reserving_a_model_later_takes_it_from_other_providers_workers():
    relay = make_relay()
    squatter, _ = attach(relay, ["m", "own"], name="squatter", max_concurrent=3)
    assert submit(relay, "m").worker is squatter
    relay.set_provider(ProviderPolicy.from_overrides(FAST, "b", exclusive_models=frozenset({"m"})))
    assert squatter.models == ("own",)
    assert submit(relay, "m").provider == "b"
    relay.remove_provider("b")
    assert relay.reserved == {}
    relay.on_models_update(squatter, ["m", "own"], 0)  # free for anyone again
    assert submit(relay, "m").worker is squatter
