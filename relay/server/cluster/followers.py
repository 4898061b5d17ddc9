"""Readers that follow resumable responses' logs in Redis, woken by one blocking read.

Every reader of this process that has read all there is of a log (a Redis stream) and
waits for more registers here with the last entry id it read; one connection runs one
``XREAD BLOCK`` over every stream waited on, and wakes the readers of a stream as soon as
it has an entry after theirs. A reader that registers while that read blocks has it
interrupted (``CLIENT UNBLOCK``), so the read starts over with its stream included.

Nothing here is trusted to be perfect: a wait has a bound (the reader then looks for
itself, and checks whether its log ended, was deleted, or lost its writer), and a failed
read wakes everyone and starts over after a short pause. The blocking read's connection
is built by the process's :class:`~relay.server.cluster.redissource.RedisSource` (it
follows the master through Sentinel) and bounded by its block time plus
REDIS_TIMEOUT_SECS: a Redis that stops answering fails it, never hangs it; a master
switch closes it, and the next read is on the new master.

:func:`read_log` is one reader: it replays a log from a unit (a byte offset, or an event
number) and follows it to its end marker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from relay.core.streamlog import PIECE_BYTES
from relay.server.cluster.redissource import RedisSource

logger = logging.getLogger("relay.streams")

#: The longest one blocking read lasts (a reader waits at most its own bound anyway).
BLOCK_MS = 5000
#: After a failed read, the next one starts this much later.
RETRY_SECS = 0.2
#: A follower that heard nothing for this long looks at its log's entry (ended,
#: deleted, or its writer gone).
CHECK_SECS = 2.0
#: Entries read per XRANGE.
READ_COUNT = 256
#: Tries to interrupt a read that has not blocked in Redis yet, this far apart.
UNBLOCK_TRIES = 20
UNBLOCK_EVERY = 0.005


class Followers:
    def __init__(self, source: RedisSource, name: str, control: aioredis.Redis) -> None:
        """``control``: a client of the store's, used to interrupt the blocking read."""
        self.timeout = source.target.timeout
        #: The longest the blocking read may take: its block time, plus the bound on
        #: any Redis call.
        self.read_secs = BLOCK_MS / 1000 + self.timeout
        #: The pool the blocking read's connection comes from (named ``name``).
        self.pool = source.client(name, timeout=self.read_secs)
        self.control = control
        #: stream key -> the waiting readers: (last id read, woken when there is more).
        self.waiting: dict[bytes, list[tuple[bytes, asyncio.Future[None]]]] = {}
        self._client: aioredis.Redis | None = None
        self._conn_id: int | None = None
        #: Which read is running (a registration interrupts only the one it missed).
        self._cycle = 0
        self._blocking = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._interrupts: set[asyncio.Task[None]] = set()

    async def wait(self, key: bytes, last_id: bytes, within: float) -> bool:
        """Return once ``key`` has an entry after ``last_id`` (True), or after ``within``
        seconds (False)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        mine = (last_id, future)
        self.waiting.setdefault(key, []).append(mine)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        self._changed.set()
        if self._blocking:
            interrupt = loop.create_task(self._interrupt(self._cycle))
            self._interrupts.add(interrupt)
            interrupt.add_done_callback(self._interrupts.discard)
        try:
            async with asyncio.timeout(within):
                await future
            return True
        except TimeoutError:
            return False
        finally:
            readers = self.waiting.get(key)
            if readers is not None:
                if mine in readers:
                    readers.remove(mine)
                if not readers:
                    del self.waiting[key]

    async def _interrupt(self, cycle: int) -> None:
        """End the blocking read of ``cycle`` (it may not have reached Redis yet)."""
        for _ in range(UNBLOCK_TRIES):
            if self._cycle != cycle or not self._blocking or self._conn_id is None:
                return
            try:
                if await self.control.client_unblock(self._conn_id):
                    return
            except RedisError:
                return
            await asyncio.sleep(UNBLOCK_EVERY)

    async def _run(self) -> None:
        while True:
            if not self.waiting:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._changed.clear()
            streams = {key: min(last for last, _ in ones) for key, ones in self.waiting.items()}
            try:
                reply = await self._read(streams)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost connection: everyone looks for themselves
                logger.warning("following retained streams failed: %s", exc)
                await self._reset()
                self._wake_all()
                await asyncio.sleep(RETRY_SECS)
                continue
            for key, _ in reply or ():
                for _, future in self.waiting.get(key, ()):
                    if not future.done():
                        future.set_result(None)

    async def _read(self, streams: dict[bytes, bytes]) -> Any:
        client = self._client
        if client is None:
            # One connection of its own, whose id the interrupt names.
            client = self._client = self.pool.client()
            async with asyncio.timeout(self.timeout):
                self._conn_id = int(await client.client_id())
        self._cycle += 1
        self._blocking = True
        try:
            # (Bounded besides its socket's timeout: finding the master is part of it.)
            async with asyncio.timeout(self.read_secs + self.timeout):
                return await client.xread(streams, count=1, block=BLOCK_MS)  # type: ignore[arg-type]
        finally:
            self._blocking = False

    def _wake_all(self) -> None:
        for readers in self.waiting.values():
            for _, future in readers:
                if not future.done():
                    future.set_result(None)

    async def _reset(self) -> None:
        client, self._client, self._conn_id = self._client, None, None
        if client is not None:
            try:
                # Closed before it goes back to the pool: a read cut short may have left
                # a reply on it.
                if client.connection is not None:
                    await client.connection.disconnect()
                await client.aclose()
            except Exception:
                pass

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._wake_all()
        await self._reset()
        await self.pool.aclose()


async def read_log(
    redis: aioredis.Redis,
    followers: Followers,
    log: str,
    bytewise: bool,
    start: int,
    still_kept: Callable[[int], Awaitable[bool]],
) -> AsyncGenerator[bytes, None]:
    """The log from unit ``start`` (entry ids are ``<first unit>-1``, the end marker
    ``<units>-2``), then what is appended, until its end marker. It ends early when the
    reader falls behind what the log keeps, or when a quiet wait finds the log gone or
    no longer holding where the reader is (``still_kept(unit)`` false)."""
    pos = start
    # The first read starts (inclusive) at the record holding unit ``start``; the next
    # ones after the last entry read.
    bound = f"{pos}-1".encode()
    before: Any
    entries: Any
    if bytewise and pos > 0:
        before = await redis.xrevrange(log, max=bound, min=b"-", count=1)
        bound = before[0][0] if before else b"0-0"
    log_key = log.encode()
    while True:
        entries = await redis.xrange(log, min=bound, max=b"+", count=READ_COUNT)
        if entries:
            pieces: list[bytes] = []
            size = 0
            for found_id, fields in entries:
                bound = b"(" + found_id
                data = fields.get(b"d")
                first, _ = _split(found_id)
                if data is None or first > pos:
                    # The end marker; or this reader fell behind what the bound keeps.
                    if pieces:
                        yield b"".join(pieces)
                    return
                after = first + (len(data) if bytewise else 1)
                if after <= pos:
                    continue  # before where this reader starts
                if first < pos:
                    data = data[pos - first :]
                pieces.append(data)
                size += len(data)
                pos = after
                if size >= PIECE_BYTES:
                    yield b"".join(pieces)
                    pieces, size = [], 0
            if pieces:
                yield b"".join(pieces)
            continue
        if bound.startswith(b"("):
            last = bound[1:]
        else:  # nothing at or after the start yet: wait for anything after it
            first, seq = _split(bound)
            last = f"{first}-{max(0, seq - 1)}".encode()
        if not await followers.wait(log_key, last, CHECK_SECS) and not await still_kept(pos):
            return


def _split(entry_id: bytes) -> tuple[int, int]:
    first, _, seq = entry_id.partition(b"-")
    return int(first), int(seq or b"0")
