"""The log of a resumable response kept in memory (SPEC §18): replay from any unit and
follow, its bounds (per response, in total, per key), expiry, replacement; and the
pieces it is made of: whole SSE events from any cut, background events renumbered."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from relay.core.background import BackgroundEvents, backend_body, queued_response
from relay.core.streamlog import ENTRY_OVERHEAD, RECORD_OVERHEAD, Bounds, Entry, Kind
from relay.core.streamstore import MemoryStreams
from relay.wire.errors import QueueTimeout, StreamGone, StreamNotFound, StreamsExceeded
from relay.wire.sse import EventSplitter
from tests.stall import STALL_BUDGET_MS, LoopStalls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(stream_id: str = "c", owner: int | None = 1, kind: Kind = "replay") -> Entry:
    return Entry(
        owner=owner, id=stream_id, kind=kind, flavor="openai", created=1000.0, gen=stream_id
    )


async def opened(store: MemoryStreams, *args: object, **kw: object):
    made = entry(*args, **kw)  # type: ignore[arg-type]
    await store.open(made, replace=True)
    writer = store.writer(made)
    assert await writer.claim(10.0) == "ok"
    return made, writer


async def read_all(store: MemoryStreams, owner: int | None, stream_id: str, start: int) -> bytes:
    return b"".join([piece async for piece in store.follow(owner, stream_id, start)])


async def test_a_reader_replays_from_any_byte_and_follows_the_live_end():
    store = MemoryStreams(Bounds())
    _, writer = await opened(store)
    await writer.append([b"data: a\n\n", b"data: bb\n\n"])
    reader = asyncio.ensure_future(read_all(store, 1, "c", 7))
    await asyncio.sleep(0)
    assert not reader.done()  # waits for more
    await writer.append([b"data: ccc\n\n"])
    await writer.end("ok", [b"data: [DONE]\n\n"])
    whole = b"data: a\n\ndata: bb\n\ndata: ccc\n\ndata: [DONE]\n\n"
    assert await asyncio.wait_for(reader, 1) == whole[7:]
    for start in range(len(whole) + 3):  # every offset, and past the end
        assert await read_all(store, 1, "c", start) == whole[start:]
    found = await store.get(1, "c")
    assert found is not None and found.done and found.total == len(whole)


async def test_another_owner_never_sees_a_stream():
    store = MemoryStreams(Bounds())
    await opened(store, "c", 1)
    assert await store.get(2, "c") is None
    assert await store.get(None, "c") is None
    with pytest.raises(StreamNotFound):
        await read_all(store, 2, "c", 0)
    assert await store.lookup(2, ["c"]) == []
    assert await store.request_cancel(2, "c") is None
    assert await store.delete(2, "c") is None
    assert await store.get(1, "c") is not None


async def test_one_log_keeps_its_newest_bytes_and_a_replay_of_dropped_ones_is_gone():
    store = MemoryStreams(Bounds(max_bytes=ENTRY_OVERHEAD + 3 * (100 + RECORD_OVERHEAD)))
    _, writer = await opened(store)
    chunks = [bytes([65 + i]) * 100 for i in range(10)]
    for chunk in chunks:
        await writer.append([chunk])
    await writer.end("ok", [])
    kept = await store.get(1, "c")
    assert kept is not None and kept.first == 700 and kept.total == 1000
    assert await read_all(store, 1, "c", 700) == b"".join(chunks[7:])
    assert await read_all(store, 1, "c", 750) == b"".join(chunks[7:])[50:]
    with pytest.raises(StreamGone):
        await read_all(store, 1, "c", 699)
    assert store.trimmed == 7
    # One record larger than the bound: its tail is kept.
    _, writer = await opened(store, "big")
    await writer.append([b"x" * 5000])
    await writer.end("ok", [])
    kept = await store.get(1, "big")
    assert kept is not None and kept.size <= store.bounds.max_bytes
    assert await read_all(store, 1, "big", kept.first) == b"x" * (kept.total - kept.first)


async def test_past_the_total_bound_the_responses_that_ended_first_go_first():
    clock = Clock()
    per = ENTRY_OVERHEAD + 1000 + RECORD_OVERHEAD
    store = MemoryStreams(Bounds(total_bytes=3 * per), clock=clock)
    for n in range(3):
        _, writer = await opened(store, f"s{n}")
        await writer.append([b"y" * 1000])
    for n in (1, 0, 2):  # ended in this order
        clock.now += 1
        await store.writer(await store.get(1, f"s{n}")).end("ok", [])  # type: ignore[arg-type]
    assert store.bytes == 3 * per
    _, writer = await opened(store, "s3")
    await writer.append([b"z" * 1000])
    # s1 then s0 ended first: their records went (s3's entry and its record need room
    # for two, with the entries they leave), their entries stay (410, not 404) ...
    for gone in ("s1", "s0"):
        evicted = await store.get(1, gone)
        assert evicted is not None and evicted.evicted
        with pytest.raises(StreamGone):
            await read_all(store, 1, gone, 0)
    assert await read_all(store, 1, "s2", 0) == b"y" * 1000
    assert store.bytes <= store.bounds.total_bytes
    # ... until more room is needed: then the entry goes too, then running logs' heads.
    _, writer = await opened(store, "s4")
    for _ in range(6):
        await writer.append([b"w" * 1000])
    assert store.bytes <= store.bounds.total_bytes
    assert await store.get(1, "s1") is None
    totals = store.totals()
    assert totals.bytes == store.bytes and totals.evicted >= 2


async def test_a_thousand_retained_responses_of_100_kib_stay_within_the_bound():
    bound = 32 * 1024 * 1024
    store = MemoryStreams(Bounds(total_bytes=bound, per_key=2000))
    body = b"e" * 1024
    for n in range(1000):
        _, writer = await opened(store, f"r{n}")
        for _ in range(100):
            await writer.append([body])
        await writer.end("ok", [])
        assert store.bytes <= bound
    totals = store.totals()
    assert totals.responses == 1000 and totals.bytes <= bound
    # The newest are whole; the oldest kept their entries only.
    assert await read_all(store, 1, "r999", 0) == body * 100
    oldest = await store.get(1, "r0")
    assert oldest is not None and oldest.evicted


async def test_a_key_holds_at_most_its_bound_and_ended_responses_make_room():
    store = MemoryStreams(Bounds(per_key=2))
    _, writer = await opened(store, "a")
    await opened(store, "b")
    with pytest.raises(StreamsExceeded) as refused:
        await store.open(entry("c"), replace=False)
    assert refused.value.status == 429 and store.refused == 1
    await opened(store, "c", 2)  # another key's own bound
    await writer.end("ok", [])
    await opened(store, "c")  # takes the place of "a", which ended
    assert await store.get(1, "a") is None
    assert {e.id for e in await store.lookup(1, ["a", "b", "c"])} == {"b", "c"}


async def test_an_ended_response_is_forgotten_after_the_retention():
    clock = Clock()
    store = MemoryStreams(Bounds(retain_secs=600), clock=clock)
    _, writer = await opened(store)
    await writer.append([b"data: x\n\n"])
    clock.now += 10_000  # a running response is never expired
    assert await store.get(1, "c") is not None
    await writer.end("ok", [])
    clock.now += 599
    assert await store.get(1, "c") is not None
    clock.now += 2
    await store.sweep()
    assert await store.get(1, "c") is None and store.bytes == 0


async def test_a_new_stream_of_a_conversation_replaces_the_old_one_whose_writer_stops():
    store = MemoryStreams(Bounds())
    _, old_writer = await opened(store)
    reader = asyncio.ensure_future(read_all(store, 1, "c", 0))
    await old_writer.append([b"old"])
    await asyncio.sleep(0)
    renewed = entry()
    renewed.gen = "second"
    await store.open(renewed, replace=True)
    assert await asyncio.wait_for(reader, 1) == b"old"  # its reader ended
    assert await old_writer.append([b"more"]) == "gone"
    writer = store.writer(renewed)
    assert await writer.claim(1.0) == "ok"
    assert await writer.append([b"new"]) == "ok"
    assert await store.request_cancel(1, "c") is not None
    assert await writer.append([b"!"]) == "cancel"
    assert await read_all_ended(store, writer) == b"new!"


async def read_all_ended(store: MemoryStreams, writer) -> bytes:
    await writer.end("cancelled", [])
    return await read_all(store, 1, "c", 0)


async def test_lookup_names_an_id_and_its_model_variants():
    store = MemoryStreams(Bounds())
    for stream_id in ("conv", "conv::org/model", "conversation", "other"):
        await opened(store, stream_id)
    found = await store.lookup(1, ["conv"])
    assert [e.id for e in found] == ["conv", "conv::org/model"]
    assert found[0].describe().keys() == {
        "conversation_id",
        "is_done",
        "total_bytes",
        "started_at",
        "completed_at",
    }


async def test_following_a_large_log_never_holds_the_loop():
    store = MemoryStreams(Bounds(max_bytes=64 * 1024 * 1024))
    _, writer = await opened(store)
    for _ in range(64):
        await writer.append([b"d" * 4096] * 64)  # 16 MiB in 4 KiB records
    await writer.end("ok", [])
    async with LoopStalls() as stalls:
        size = 0
        async for piece in store.follow(1, "c", 0):
            size += len(piece)
            await asyncio.sleep(0)  # as the HTTP edge does between sends
    assert size == 16 * 1024 * 1024
    assert stalls.longest_ms < STALL_BUDGET_MS


# ------------------------------------------------------------------- SSE events


EVENTS = [b"event: a\ndata: 1", b"data: 2", b': comment\ndata: {"x": 3}', b"data: 4"]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_events_come_out_whole_wherever_the_reads_cut_them(ending: bytes):
    stream = b"".join(e.replace(b"\n", ending) + ending * 2 for e in EVENTS)
    for cut in range(len(stream) + 1):
        for second in (cut, min(len(stream), cut + 1), len(stream)):
            splitter = EventSplitter()
            out = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:second])
            out += splitter.feed(stream[second:])
            assert out == EVENTS, (cut, second)
            assert splitter.rest() == b""


def test_events_split_byte_by_byte_and_a_torn_last_event_is_the_rest():
    stream = b"data: 1\r\n\r\ndata: 2\n\ndata: 3\r\rdata: torn"
    splitter = EventSplitter()
    out = [event for byte in stream for event in splitter.feed(bytes([byte]))]
    assert out == [b"data: 1", b"data: 2", b"data: 3"]
    assert splitter.rest() == b"data: torn"


def random_cuts(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(data):
        step = rng.randint(1, 40)
        pieces.append(data[at : at + step])
        at += step
    return pieces


def backend_stream(tokens: int) -> bytes:
    response: dict[str, Any] = {
        "id": "resp_backend",
        "object": "response",
        "status": "in_progress",
        "output": [],
    }
    lines: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": response})]
    lines += [("response.output_text.delta", {"delta": f"t{i}"}) for i in range(tokens)]
    item = {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "t"}]}
    lines.append(("response.output_item.done", {"item": item, "output_index": 0}))
    done = dict(response, status="completed", output=[item])
    lines.append(("response.completed", {"response": done}))
    out = b""
    for n, (kind, fields) in enumerate(lines):
        data = json.dumps({"type": kind, "sequence_number": 100 + n, **fields})
        out += f"event: {kind}\r\ndata: {data}\r\n\r\n".encode()
    return out + b"data: [DONE]\n\n"


async def test_background_events_get_the_relays_numbers_and_id_however_they_are_cut():
    queued = queued_response("resp_relay", "m", 5)
    stream = backend_stream(5)
    for seed in range(20):
        events = BackgroundEvents("resp_relay", queued)
        records: list[bytes] = []
        for piece in random_cuts(stream, seed):
            got, _ = await events.feed(piece)
            records += got
        records += await events.rest()
        documents = [json.loads(r.split(b"data: ", 1)[1]) for r in records]
        assert [d["sequence_number"] for d in documents] == list(range(1, 9))
        assert documents[0]["response"]["id"] == "resp_relay"
        assert documents[0]["response"]["background"] is True
        assert records[0].startswith(b"event: response.created\ndata: ")
        assert events.ended == "completed"
        final = json.loads(events.final("completed"))
        assert final["id"] == "resp_relay" and final["status"] == "completed"


async def test_a_background_response_cut_short_is_built_from_the_items_it_completed():
    events = BackgroundEvents("resp_relay", queued_response("resp_relay", "m", 5))
    whole = backend_stream(3)
    await events.feed(whole[: whole.index(b"event: response.completed")])
    error = events.error(QueueTimeout())
    assert json.loads(error.split(b"data: ", 1)[1])["type"] == "error"
    final = json.loads(events.final("failed", {"code": "x", "message": "y"}))
    assert final["status"] == "failed" and final["error"] == {"code": "x", "message": "y"}
    assert final["output"][0]["id"] == "m" and final["id"] == "resp_relay"


def test_the_backend_gets_the_body_without_background_and_with_stream():
    body = b'{"model":"m","background":true,"input":"hi","stream":false,"x":[1,{"a":2}]}'
    assert json.loads(backend_body(body)) == {
        "model": "m",
        "input": "hi",
        "stream": True,
        "x": [1, {"a": 2}],
    }
