"""Resumable responses in Redis when Redis fails (SPEC §18, §20): a writer keeps what Redis
did not take and writes it once when Redis answers; a master that took over without a
log's last records has the log ended there, as lost, and a reader past that point gets
410; the logs a process ended are looked at again after a master switch; a follower's
blocking read is bounded; a Redis in trouble makes no live writer an orphan.

A new master lacking the last writes is staged on one Redis: the log's keys are dumped
when the replica would have had them, and restored over what the old master took since.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from relay.core.streamlog import Bounds, Entry
from relay.server.cluster import followers
from relay.server.cluster.redisconf import RedisTarget
from relay.server.cluster.redissource import RedisSource
from relay.server.cluster.streamrecovery import SETTLE_GRACE_SECS
from relay.server.cluster.streamstore import RedisStreams
from relay.wire.errors import StreamGone, StreamsUnavailable
from tests.conftest import REDIS_URL, require_redis
from tests.server.test_redislimits import HoldingProxy
from tests.server.test_streamstore_redis import entry, read_all

pytestmark = pytest.mark.redis

Make = Callable[..., RedisStreams]


@pytest.fixture
async def stores() -> AsyncIterator[Make]:
    """Stores of processes sharing a prefix (``redis``: a URL or a source; the Redis of
    the tests by default); every instance named is alive."""
    require_redis()
    prefix = f"mrtest-{secrets.token_hex(4)}"
    made: list[RedisStreams] = []
    direct = aioredis.from_url(REDIS_URL)

    def make(instance: str, redis: str | RedisSource = REDIS_URL) -> RedisStreams:
        store = RedisStreams(redis, prefix, instance, Bounds(), running_ttl=60)
        made.append(store)
        return store

    make.prefix = prefix  # type: ignore[attr-defined]
    make.direct = direct  # type: ignore[attr-defined]
    for instance in ("a", "b"):
        await direct.set(f"{prefix}:instance:{instance}", "{}", ex=60)
    yield make
    for store in made:
        await store.aclose()
    await direct.aclose()


async def until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    async with asyncio.timeout(timeout):
        while not (found := await check()):
            await asyncio.sleep(0.01)
    return found


class Snapshot:
    """A log's keys as a replica had them, restored later as the new master's."""

    def __init__(self, redis: aioredis.Redis, keys: list[str]) -> None:
        self.redis = redis
        self.keys = keys
        self.kept: list[tuple[str, bytes, int]] = []

    async def take(self) -> Snapshot:
        for key in self.keys:
            dumped = await self.redis.dump(key)
            assert dumped is not None, key
            self.kept.append((key, dumped, await self.redis.pttl(key)))
        return self

    async def restore(self) -> None:
        for key, dumped, ttl in self.kept:
            await self.redis.restore(key, ttl, dumped, replace=True)


def held_keys(store: RedisStreams, made: Entry) -> list[str]:
    meta, log, _ = store.keys_of(made.owner, made.id)
    return [meta, log]


async def test_a_writer_keeps_what_redis_did_not_take_and_writes_it_once_when_redis_answers(
    stores: Make,
) -> None:
    url = urlsplit(REDIS_URL)
    proxy = HoldingProxy((url.hostname or "127.0.0.1", url.port or 6379))
    try:
        target = RedisTarget(url=await proxy.start(), timeout=0.2)
        store, reader = stores("a", RedisSource(target)), stores("b")
        made = entry()
        await store.open(made, replace=True)
        writer = store.writer(made)
        assert await writer.claim(60) == "ok"
        assert await writer.append([b"data: 1\n\n"]) == "ok"
        # Redis runs the next write, and its reply is lost: the writer keeps it.
        proxy.muted = True
        assert await writer.append([b"data: 2\n\n"]) == "ok"
        assert [data for _, data in writer.pending] == [b"data: 2\n\n"]
        # Then Redis stops reading: the next try (both records) is not taken either.
        proxy.muted = False
        proxy.hold()
        await until(lambda: _past(writer.retry_at), "the writer's backoff to pass")
        assert await writer.append([b"data: 3\n\n"]) == "ok"
        assert len(writer.pending) == 2 and writer.confirmed == len(b"data: 1\n\n")
        # Redis answers again: what it ran is not added twice, the rest follows, and the
        # end is written as soon as Redis takes it.
        proxy.release()
        await writer.end("ok", [b"data: [DONE]\n\n"])
        ended = await until(lambda: _done(reader, made), "the end to be written")
        whole = b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
        assert ended.total == len(whole) and ended.outcome == "ok"
        assert await read_all(reader, 1, made.id, 0) == whole
    finally:
        await proxy.aclose()


async def _past(when: float) -> bool:
    return asyncio.get_running_loop().time() >= when


async def _done(store: RedisStreams, made: Entry) -> Entry | None:
    found = await store.get(made.owner, made.id)
    return found if found is not None and found.done else None


async def test_a_master_without_the_last_records_has_the_log_ended_there_as_lost(
    stores: Make,
) -> None:
    store, reader = stores("a"), stores("b")
    made = entry()
    await store.open(made, replace=True)
    writer = store.writer(made)
    assert await writer.claim(60) == "ok"
    head = b"data: 1\n\ndata: 2\n\n"
    await writer.append([b"data: 1\n\n", b"data: 2\n\n"])
    replica = await Snapshot(stores.direct, held_keys(store, made)).take()  # type: ignore[attr-defined]
    await writer.append([b"data: 3\n\n"])  # the old master took it; the replica never did
    past = len(head + b"data: 3\n\n")
    follower = asyncio.ensure_future(read_all(reader, 1, made.id, past))  # had it all
    await until(lambda: _waiting(reader), "the follower to wait")
    await replica.restore()  # the replica is the master now
    # The next write finds the log short: the writer ends it where the master holds it.
    assert await writer.append([b"data: 4\n\n"]) == "lost"
    ended = await until(lambda: _done(reader, made), "the log to be ended")
    assert ended.outcome == "error" and ended.cut == len(head)
    assert store.lost == 1
    # From the start, or from the cut: what is held, then the error as a live client
    # would see it; past the cut (the bytes lost): 410.
    replayed = await read_all(reader, 1, made.id, 0)
    assert replayed.startswith(head + b'data: {"error":')
    assert b"stream_lost" in replayed[len(head) :]
    assert await read_all(reader, 1, made.id, len(head)) == replayed[len(head) :]
    with pytest.raises(StreamGone):
        await read_all(reader, 1, made.id, len(head) + 1)
    # The reader that waited past the cut is let go (its client reattaches: 410).
    async with asyncio.timeout(5):
        assert await follower == b""
    # The writer has nothing more to say, its end included.
    assert await writer.append([b"data: 5\n\n"]) == "lost"
    await writer.end("ok", [])
    assert await read_all(reader, 1, made.id, 0) == replayed


async def test_a_background_log_without_its_last_events_fails_with_the_error_event(
    stores: Make,
) -> None:
    store, reader = stores("a"), stores("b")
    made = entry("resp_1", kind="background")
    made.response = b'{"id":"resp_1","status":"queued"}'
    await store.open(made, replace=False, records=[b"event: response.queued\n\n"])
    writer = store.writer(made)
    assert await writer.claim(60) == "ok"
    await writer.append([b"event: one\n\n"], b'{"id":"resp_1","status":"in_progress"}')
    replica = await Snapshot(stores.direct, held_keys(store, made)).take()  # type: ignore[attr-defined]
    await writer.append([b"event: two\n\n"])
    await replica.restore()
    assert await writer.append([b"event: three\n\n"]) == "lost"
    ended = await until(lambda: _done(reader, made), "the log to be ended")
    assert (ended.outcome, ended.cut, ended.total) == ("failed", 2, 3)
    assert b'"status":"failed"' in ended.response and b"stream_lost" in ended.response
    (error,) = [piece async for piece in reader.follow(1, made.id, 2)]
    assert b'"sequence_number":2' in error and b"stream_lost" in error
    with pytest.raises(StreamGone):  # starting after event 2, which was lost
        await read_all(reader, 1, made.id, 3)


async def test_after_a_master_switch_a_log_ended_here_but_not_there_is_ended_as_lost(
    stores: Make,
) -> None:
    source = RedisSource(RedisTarget(url=REDIS_URL))
    store, reader = stores("a", source), stores("b")
    made = entry()
    await store.open(made, replace=True)
    writer = store.writer(made)
    await writer.claim(60)
    await writer.append([b"data: 1\n\n"])
    replica = await Snapshot(stores.direct, held_keys(store, made)).take()  # type: ignore[attr-defined]
    await writer.end("ok", [b"data: 2\n\n"])
    await replica.restore()  # the new master holds the log running: its end was lost
    assert not (await reader.get(1, made.id)).done  # type: ignore[union-attr]
    await source._switched()  # as when the sentinels name another master
    ended = await until(lambda: _done(reader, made), "the log to be ended as lost")
    assert ended.cut == len(b"data: 1\n\n") and ended.outcome == "error"
    assert (await read_all(reader, 1, made.id, 0)).startswith(b'data: 1\n\ndata: {"error":')
    with pytest.raises(StreamGone):
        await read_all(reader, 1, made.id, ended.cut + 1)


async def test_a_writer_whose_log_the_new_master_never_had_stops_as_after_a_flush(
    stores: Make,
) -> None:
    store, reader = stores("a"), stores("b")
    made = entry()
    await store.open(made, replace=True)
    writer = store.writer(made)
    await writer.claim(60)
    await writer.append([b"data: 1\n\n"])
    await stores.direct.delete(*held_keys(store, made))  # type: ignore[attr-defined]
    assert await writer.append([b"data: 2\n\n"]) == "gone"
    assert await reader.get(1, made.id) is None


async def test_redis_in_trouble_makes_no_live_writer_an_orphan_for_a_while(stores: Make) -> None:
    store, reader = stores("ghost"), stores("b")
    made = entry()
    await store.open(made, replace=True)
    writer = store.writer(made)
    await writer.claim(60)
    await writer.append([b"data: 1\n\n"])
    # "ghost" has no key on Redis; just after Redis trouble (a new master may lack every
    # process's key for a moment) that says nothing yet.
    reader.recovery.trouble()
    found = await reader.get(1, made.id)
    assert found is not None and not found.done
    reader.recovery.troubled_at -= SETTLE_GRACE_SECS  # the grace is over: it is an orphan
    found = await reader.get(1, made.id)
    assert found is not None and found.done and found.outcome == "error"


async def test_a_follower_on_a_redis_that_stops_answering_is_let_go_within_its_bound(
    stores: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(followers, "BLOCK_MS", 200)
    url = urlsplit(REDIS_URL)
    proxy = HoldingProxy((url.hostname or "127.0.0.1", url.port or 6379))
    try:
        target = RedisTarget(url=await proxy.start(), timeout=0.2)
        store, reader = stores("a"), stores("b", RedisSource(target))
        assert reader.followers.read_secs == pytest.approx(0.4)
        made = entry()
        await store.open(made, replace=True)
        writer = store.writer(made)
        await writer.claim(60)
        await writer.append([b"data: 1\n\n"])
        following = asyncio.ensure_future(read_all(reader, 1, made.id, 0))
        await until(lambda: _waiting(reader), "the follower to wait")
        proxy.hold()  # Redis stops answering: no wait outlasts its bound
        async with asyncio.timeout(5):
            replayed = await following
        assert replayed == b"data: 1\n\n"  # (it ended there: its client reattaches)
        with pytest.raises(StreamsUnavailable):
            await read_all(reader, 1, made.id, 0)
    finally:
        proxy.release()
        await proxy.aclose()


async def _waiting(store: RedisStreams) -> bool:
    return bool(store.followers.waiting) and store.followers._blocking
