"""Resumable responses kept in Redis (cluster mode, SPEC §18): the store against a real
Redis — replay from any unit and follow, the bounds the writer keeps, replacement,
lookups, expiry, a writer's process that is gone, and Redis out of reach."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest

from relay.core.streamlog import ENTRY_OVERHEAD, RECORD_OVERHEAD, Bounds, Entry, Kind
from relay.server.cluster.streamstore import RedisStreams
from relay.wire.errors import StreamGone, StreamNotFound, StreamsExceeded, StreamsUnavailable
from tests.conftest import REDIS_URL, require_redis
from tests.stall import STALL_BUDGET_MS, LoopStalls
from tests.upstream import unused_port

pytestmark = pytest.mark.redis


@pytest.fixture
async def stores():
    """Two processes' stores (instances "a" and "b") on one prefix; "a" is alive."""
    require_redis()
    prefix = f"mrtest-{secrets.token_hex(4)}"
    made = []

    def make(instance: str, **bounds: Any) -> RedisStreams:
        store = RedisStreams(REDIS_URL, prefix, instance, Bounds(**bounds), running_ttl=60)
        made.append(store)
        return store

    first = make("a")
    await first.redis.set(f"{prefix}:instance:a", "{}", ex=60)
    yield make
    for store in made:
        await store.aclose()


def entry(stream_id: str = "c", owner: int | None = 1, kind: Kind = "replay") -> Entry:
    return Entry(
        owner=owner, id=stream_id, kind=kind, flavor="openai", created=1.0, gen=secrets.token_hex(4)
    )


async def read_all(store: RedisStreams, owner: int | None, stream_id: str, start: int) -> bytes:
    return b"".join([piece async for piece in store.follow(owner, stream_id, start)])


async def test_another_process_replays_from_any_byte_and_follows_the_writer(stores):
    writer_store, reader_store = stores("a"), stores("b")
    made = entry()
    await writer_store.open(made, replace=True)
    writer = writer_store.writer(made)
    assert await writer.claim(60) == "ok"
    await writer.append([b"data: a\n\n", b"data: bb\n\n"])
    following = asyncio.ensure_future(read_all(reader_store, 1, "c", 5))
    await asyncio.sleep(0.05)
    assert not following.done()
    await writer.append([b"data: ccc\n\n"])
    await writer.end("ok", [b"data: [DONE]\n\n"])
    whole = b"data: a\n\ndata: bb\n\ndata: ccc\n\ndata: [DONE]\n\n"
    assert await asyncio.wait_for(following, 5) == whole[5:]
    for start in range(len(whole) + 2):
        assert await read_all(reader_store, 1, "c", start) == whole[start:]
    assert await reader_store.get(2, "c") is None  # another key
    with pytest.raises(StreamNotFound):
        await read_all(reader_store, 2, "c", 0)
    kept = await reader_store.get(1, "c")
    assert kept is not None and kept.done and kept.total == len(whole)


async def test_only_the_writer_writes_and_a_replaced_log_refuses_its_old_writer(stores):
    store, other = stores("a"), stores("b")
    first = entry()
    await store.open(first, replace=True)
    writer = store.writer(first)
    assert await writer.claim(60) == "ok"
    assert await other.writer(first).claim(60) == "gone"  # another process's claim
    second = entry()
    await store.open(second, replace=True)
    assert await writer.append([b"x"]) == "gone"
    fresh = store.writer(second)
    assert await fresh.claim(60) == "ok"
    assert await store.request_cancel(1, "c") is not None
    assert await fresh.append([b"y"]) == "cancel"


async def test_the_writer_keeps_a_log_and_its_process_within_their_bounds(stores):
    per_log = ENTRY_OVERHEAD + 3 * (100 + RECORD_OVERHEAD)
    total = 2 * per_log + ENTRY_OVERHEAD  # two logs, and the entry of a third
    store = stores("a", max_bytes=per_log, total_bytes=total, per_key=3)
    reader = stores("b")
    logs = []
    for n in range(3):
        made = entry(f"s{n}")
        await store.open(made, replace=False)
        writer = store.writer(made)
        await writer.claim(60)
        for i in range(10):
            await writer.append([bytes([65 + i]) * 100])
        await writer.end("ok", [])
        logs.append(made)
    kept = await reader.get(1, "s2")
    assert kept is not None and kept.first == 700 and kept.total == 1000
    assert await read_all(reader, 1, "s2", 750) == (b"H" * 100 + b"I" * 100 + b"J" * 100)[50:]
    with pytest.raises(StreamGone):
        await read_all(reader, 1, "s2", 699)
    # The total bound: the log that ended first lost its records, not its entry.
    emptied = await reader.get(1, "s0")
    assert emptied is not None and emptied.evicted
    with pytest.raises(StreamGone):
        await read_all(reader, 1, "s0", 700)
    assert store.bytes <= total
    # The per-key bound: all three ended, so a fourth takes the oldest's place ...
    await store.open(entry("s3"), replace=False)
    assert await reader.get(1, "s0") is None
    # ... but not when every one still runs.
    await store.open(entry("s4"), replace=False)
    await store.open(entry("s5"), replace=False)
    with pytest.raises(StreamsExceeded):
        await store.open(entry("s6"), replace=False)
    found = await reader.lookup(1, ["s3", "s4", "nothing"])
    assert sorted(e.id for e in found) == ["s3", "s4"]


async def test_past_the_total_bound_old_entries_go_too(stores):
    per_log = ENTRY_OVERHEAD + 3 * (100 + RECORD_OVERHEAD)
    store = stores("a", total_bytes=per_log + ENTRY_OVERHEAD)
    for n in range(3):
        made = entry(f"t{n}")
        await store.open(made, replace=False)
        writer = store.writer(made)
        await writer.claim(60)
        await writer.append([b"x" * 100] * 3)
        await writer.end("ok", [])
    assert store.bytes <= per_log + ENTRY_OVERHEAD
    assert await store.get(1, "t0") is None  # its records went, then its entry
    assert await read_all(store, 1, "t2", 0) == b"x" * 300


async def test_every_key_of_a_log_expires_its_log_made_by_the_first_append_too(stores):
    store = stores("a")
    made = entry()
    await store.open(made, replace=True)  # (a conversation's log has no record yet)
    writer = store.writer(made)
    await writer.claim(60)
    await writer.append([b"data: 1\n\n"])
    for key in store.keys_of(1, "c"):
        assert 0 < await store.redis.pttl(key) <= 3_600_000 + 61_000 + 600_000, key


async def test_lookup_finds_model_variants_and_expiry_forgets_ended_logs(stores):
    store = stores("a", retain_secs=0.3)
    for stream_id in ("conv", "conv::org/m", "conversation"):
        made = entry(stream_id)
        await store.open(made, replace=True)
        writer = store.writer(made)
        await writer.claim(60)
        await writer.end("ok", [b"data: x\n\n"])
    assert [e.id for e in await store.lookup(1, ["conv"])] == ["conv", "conv::org/m"]
    async with asyncio.timeout(10):
        while await store.get(1, "conv") is not None:
            await asyncio.sleep(0.05)
    assert await store.lookup(1, ["conv"]) == []


async def test_a_log_whose_writer_process_is_gone_is_ended_by_its_next_reader(stores):
    store, reader = stores("ghost"), stores("b")
    made = entry()
    await store.open(made, replace=True)
    writer = store.writer(made)
    await writer.claim(60)
    await writer.append([b"data: 1\n\n"])
    # "ghost" has no instance key (its process is gone): the reader settles the log.
    replayed = await read_all(reader, 1, "c", 0)
    assert replayed.startswith(b'data: 1\n\ndata: {"error":')
    ended = await reader.get(1, "c")
    assert ended is not None and ended.done and ended.outcome == "error"
    assert await writer.append([b"late"]) == "gone"


async def test_redis_out_of_reach_is_a_503_not_a_crash():
    store = RedisStreams(f"redis://127.0.0.1:{unused_port()}/0", "x", "a", Bounds(), running_ttl=60)
    try:
        with pytest.raises(StreamsUnavailable) as refused:
            await store.open(entry(), replace=False)
        assert refused.value.status == 503
        with pytest.raises(StreamsUnavailable):
            await store.get(1, "c")
        with pytest.raises(StreamsUnavailable):
            await read_all(store, 1, "c", 0)
    finally:
        await store.aclose()


async def test_replaying_the_largest_log_from_redis_never_holds_the_loop(stores):
    store, reader = stores("a"), stores("b")
    made = entry("big")
    await store.open(made, replace=True)
    writer = store.writer(made)
    await writer.claim(60)
    record = b"r" * (64 * 1024 - 1) + b"\n"
    for _ in range(store.bounds.max_bytes // len(record) // 8):
        await writer.append([record] * 8)  # 64 KiB records, as large as the writer cuts
    await writer.end("ok", [])
    kept = await reader.get(1, "big")
    assert kept is not None
    async with LoopStalls() as stalls:
        size = 0
        async for piece in reader.follow(1, "big", kept.first):
            size += len(piece)
            await asyncio.sleep(0)  # as the HTTP edge does between sends
    assert size == kept.total - kept.first > 7 * 1024 * 1024
    assert stalls.longest_ms < STALL_BUDGET_MS
