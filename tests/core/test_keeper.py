"""The pump of a resumable response (SPEC §18): it writes the request's events to the
log whatever its clients do, and ends the log as a live client would have seen the
response end (its last event, the error event, the backend's whole answer)."""

from __future__ import annotations

import asyncio
import json

from relay.core.background import queued_response
from relay.core.keeper import StreamKeeper, Tee
from relay.core.state import CANCELLED, Completion, Phase
from relay.core.streamlog import Bounds, Entry
from relay.core.streamstore import MemoryStreams
from relay.wire import protocol
from tests.corekit import attach, complete, make_relay, submit


def replay_entry(stream_id: str = "c") -> Entry:
    return Entry(owner=None, id=stream_id, kind="replay", flavor="openai", created=1.0, gen="g")


def background_entry() -> Entry:
    queued = queued_response("resp_1", "m", 1)
    return Entry(
        owner=None,
        id="resp_1",
        kind="background",
        flavor="responses",
        created=1.0,
        gen="g",
        response=queued,
    )


async def settled(keeper: StreamKeeper) -> None:
    async with asyncio.timeout(2):
        while keeper._tasks:
            await asyncio.sleep(0)


async def logged(store: MemoryStreams, stream_id: str) -> bytes:
    return b"".join([piece async for piece in store.follow(None, stream_id, 0)])


async def test_a_replay_stream_is_logged_byte_for_byte_and_ends_with_its_completion():
    relay = make_relay()
    worker, link = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = replay_entry()
    await keeper.open(entry, replace=True)
    request = submit(relay, stream=True)
    keeper.start(request, entry)
    for text in ("data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"):
        relay.on_chunk(worker, request.id, text)
        await asyncio.sleep(0)
    complete(relay, worker, request.id, body="")
    await settled(keeper)
    assert await logged(store, "c") == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    kept = await store.get(None, "c")
    assert kept is not None and (kept.state, kept.outcome) == ("done", "ok")
    assert link.cancels == [] and relay.buffered == 0 and request.outcome == "ok"


async def test_a_worker_lost_mid_stream_ends_the_log_with_the_error_event():
    relay = make_relay()
    worker, _ = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = replay_entry()
    await keeper.open(entry, replace=True)
    request = submit(relay, stream=True)
    keeper.start(request, entry)
    relay.on_chunk(worker, request.id, "data: 1\n\n")
    await asyncio.sleep(0)
    relay.close_worker(worker, 1001, "gone")
    await settled(keeper)
    text = await logged(store, "c")
    assert text.startswith(b'data: 1\n\ndata: {"error":')
    kept = await store.get(None, "c")
    assert kept is not None and kept.outcome == "error"


async def test_an_answer_before_any_byte_is_kept_whole():
    relay = make_relay()
    worker, _ = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = replay_entry()
    await keeper.open(entry, replace=True)
    request = submit(relay, stream=True)
    keeper.start(request, entry)
    complete(relay, worker, request.id, status=429, body='{"error":"busy"}')
    await settled(keeper)
    kept = await store.get(None, "c")
    assert kept is not None and kept.unary is not None
    assert (kept.unary.status, kept.unary.body, kept.outcome) == (429, b'{"error":"busy"}', "error")


async def test_a_cancel_asked_of_the_store_stops_the_request_at_its_next_bytes():
    relay = make_relay()
    worker, link = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = replay_entry()
    await keeper.open(entry, replace=True)
    request = submit(relay, stream=True)
    keeper.start(request, entry)
    relay.on_chunk(worker, request.id, "data: 1\n\n")
    await asyncio.sleep(0)
    await store.request_cancel(None, "c")
    relay.on_chunk(worker, request.id, "data: 2\n\n")
    await settled(keeper)
    assert [c.reason for c in link.cancels] == ["client_disconnect"]
    kept = await store.get(None, "c")
    assert kept is not None and kept.outcome == "cancelled"
    assert await logged(store, "c") == b"data: 1\n\ndata: 2\n\n"


async def test_a_cancel_reaches_a_queued_request_and_ends_its_log():
    relay = make_relay()
    attach(relay)
    submit(relay, stream=True)  # takes the only slot
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = background_entry()
    await keeper.open(entry, replace=False)
    request = submit(relay, stream=True)  # waits for it
    keeper.start(request, entry)
    assert request.phase is Phase.QUEUED
    ended = await keeper.cancel(None, "resp_1")
    assert ended is not None and not ended.done
    await settled(keeper)
    kept = await store.get(None, "resp_1")
    assert kept is not None and kept.outcome == "cancelled"
    assert json.loads(kept.response)["status"] == "cancelled"
    assert keeper.counters.cancels == 1


async def test_a_background_response_is_numbered_and_built_from_its_events():
    relay = make_relay()
    worker, _ = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = background_entry()
    await keeper.open(entry, replace=False)
    request = submit(relay, stream=True)
    keeper.start(request, entry)
    created = {"type": "response.created", "sequence_number": 7, "response": {"id": "x"}}
    done = {"type": "response.completed", "response": {"id": "x", "status": "completed"}}
    relay.on_chunk(worker, request.id, f"data: {json.dumps(created)}\n\n")
    relay.on_chunk(worker, request.id, f"event: response.completed\ndata: {json.dumps(done)}\n")
    relay.on_chunk(worker, request.id, "\n")
    complete(relay, worker, request.id, body="")
    await settled(keeper)
    events = [
        json.loads(line[6:])
        for line in (await logged(store, "resp_1")).split(b"\n")
        if line[:5] == b"data:"
    ]
    assert [(e["type"], e["sequence_number"]) for e in events] == [
        ("response.queued", 0),
        ("response.created", 1),
        ("response.completed", 2),
    ]
    assert {e["response"]["id"] for e in events} == {"resp_1"}
    kept = await store.get(None, "resp_1")
    assert kept is not None and kept.outcome == "completed"
    assert json.loads(kept.response) == {"id": "resp_1", "status": "completed", "background": True}


async def test_the_tee_passes_the_bytes_and_the_end_and_gives_up_past_its_bound():
    tee = Tee(limit=10)
    tee.put(b"12345")
    tee.put(Completion(200, {}, b""))
    assert await tee.next_events() == [b"12345", Completion(200, {}, b"")]
    tee.put(b"more")  # after its end: nothing
    slow = Tee(limit=4)
    slow.put(b"12345")
    assert await slow.next_events() == [CANCELLED]


async def test_a_request_placed_here_by_another_process_leaves_a_requeue_to_it():
    relay = make_relay()
    worker, _ = attach(relay)
    store = MemoryStreams(Bounds())
    keeper = StreamKeeper(relay, store)
    entry = replay_entry()
    await keeper.open(entry, replace=True)
    request = submit(relay, stream=True)
    request.relay_role = "worker"
    keeper.start(request, entry)
    relay.on_worker_error(
        worker,
        protocol.Error(request_id=request.id, code=protocol.WORKER_DRAINING, message="bye"),
    )
    await settled(keeper)
    kept = await store.get(None, "c")
    assert kept is not None and kept.state == "queued"  # the client's process places it again
