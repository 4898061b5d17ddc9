"""Resumable responses kept in this process's memory (one process, no Redis).

:class:`MemoryStreams` is the :class:`~relay.core.streamlog.StreamStore` of a relay
without Redis. Each response's log is a list of records with the unit each starts at,
so a reader finds where to start by bisection and replays from there; readers waiting
for more are woken by the writer's next append or by the end.

Bounds (:class:`~relay.core.streamlog.Bounds`), applied as each record arrives:

- one log holds at most ``max_bytes``: its oldest records go first (a replay byte log
  keeps the tail of a record larger than that);
- all logs hold at most ``total_bytes``: the records of the responses that ended first
  go first (each leaves a small entry, so its id answers 410 rather than 404 until it
  expires), then those entries, then the oldest records of running logs;
- an owner holds at most ``per_key`` responses: a new one takes the place of the
  owner's oldest ended one, or is refused while all of them run;
- a response is forgotten ``retain_secs`` after it ended.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace as copy_of

from relay.core.streamlog import (
    ENTRY_OVERHEAD,
    PIECE_BYTES,
    RECORD_OVERHEAD,
    Bounds,
    Entry,
    Retained,
    Unary,
    Verdict,
)
from relay.wire.errors import StreamGone, StreamNotFound, StreamsExceeded

Key = tuple[int | None, str]
#: Dropped records are compacted away once this many pile up at a log's head.
COMPACT_AFTER = 1024


class _Log:
    """One response's records: ``records[i]`` starts at unit ``starts[i]``; those before
    ``head`` were dropped (compacted away now and then)."""

    __slots__ = ("bytewise", "cancel", "entry", "gone", "head", "records", "starts", "waiters")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.bytewise = entry.kind == "replay"
        self.records: list[bytes] = []
        self.starts: list[int] = []
        self.head = 0
        self.waiters: list[asyncio.Future[None]] = []
        self.cancel = False
        #: Deleted, replaced or expired: readers stop, the writer is told.
        self.gone = False

    def units(self, record: bytes) -> int:
        return len(record) if self.bytewise else 1

    def add(self, record: bytes) -> int:
        """Append one record; the bytes it holds."""
        entry = self.entry
        self.records.append(record)
        self.starts.append(entry.total)
        entry.total += self.units(record)
        return len(record) + RECORD_OVERHEAD

    def drop_head(self) -> int:
        """Drop the oldest record; the bytes freed."""
        record = self.records[self.head]
        self.records[self.head] = b""
        self.head += 1
        entry = self.entry
        entry.first = self.starts[self.head] if self.head < len(self.starts) else entry.total
        if self.head >= COMPACT_AFTER and self.head * 2 >= len(self.records):
            del self.records[: self.head]
            del self.starts[: self.head]
            self.head = 0
        return len(record) + RECORD_OVERHEAD

    def clip(self, limit: int) -> int:
        """Keep only the last ``limit`` bytes of a byte log's only record; bytes freed."""
        record = self.records[self.head]
        cut = len(record) - limit
        self.records[self.head] = record[cut:]
        self.starts[self.head] += cut
        self.entry.first = self.starts[self.head]
        return cut

    def held(self) -> int:
        return len(self.records) - self.head

    def read(self, pos: int) -> tuple[bytes, int]:
        """What is held from unit ``pos`` (up to about PIECE_BYTES), and the unit after it."""
        if pos >= self.entry.total or self.head >= len(self.records):
            return b"", pos
        at = max(bisect.bisect_right(self.starts, pos, self.head) - 1, self.head)
        first = self.records[at]
        if self.bytewise:
            first = first[pos - self.starts[at] :]
        pieces = [first]
        size = len(first)
        at += 1
        while at < len(self.records) and size < PIECE_BYTES:
            pieces.append(self.records[at])
            size += len(self.records[at])
            at += 1
        end = self.starts[at] if at < len(self.starts) else self.entry.total
        return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), end

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        finally:
            if not waiter.done():
                waiter.cancel()


class MemoryStreams:
    """:class:`~relay.core.streamlog.StreamStore` in this process's memory."""

    def __init__(self, bounds: Bounds, *, clock: Callable[[], float] = time.time) -> None:
        self.bounds = bounds
        self.clock = clock
        self._logs: dict[Key, _Log] = {}
        #: owner -> its ids, oldest first.
        self._owners: dict[int | None, dict[str, None]] = {}
        #: Ended responses whose records are held, and those whose records were
        #: dropped (the total bound), each in the order they ended.
        self._ended: OrderedDict[Key, None] = OrderedDict()
        self._emptied: OrderedDict[Key, None] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.trimmed = 0
        self.refused = 0

    # -- the StreamStore protocol ---------------------------------------------------

    async def open(self, entry: Entry, *, replace: bool, records: Sequence[bytes] = ()) -> None:
        self._expire()
        key = (entry.owner, entry.id)
        if key in self._logs:
            if not replace:
                raise ValueError(f"stream {entry.id!r} is already kept")
            self._forget(key)
        mine = self._owners.setdefault(entry.owner, {})
        if len(mine) >= self.bounds.per_key:
            oldest = next((i for i in mine if self._logs[(entry.owner, i)].entry.done), None)
            if oldest is None:
                self.refused += 1
                raise StreamsExceeded(self.bounds.per_key)
            self._forget((entry.owner, oldest))
        entry.size = ENTRY_OVERHEAD + len(entry.response)
        log = self._logs[key] = _Log(entry)
        mine[entry.id] = None
        self.bytes += entry.size
        self._grew(log, sum(log.add(record) for record in records))

    async def get(self, owner: int | None, stream_id: str) -> Entry | None:
        log = self._live(owner, stream_id)
        return None if log is None else copy_of(log.entry)

    async def follow(
        self, owner: int | None, stream_id: str, start: int
    ) -> AsyncGenerator[bytes, None]:
        log = self._live(owner, stream_id)
        if log is None:
            raise StreamNotFound()
        entry = log.entry
        if start < entry.first or entry.evicted:
            raise StreamGone()
        pos = start
        while not log.gone and pos >= entry.first:
            data, pos = log.read(pos)
            if data:
                yield data
            elif entry.done:
                return
            else:
                await log.wait()
        # Deleted, expired, or this reader fell behind what the bounds keep: the
        # stream ends here; reattaching says which (404 or 410).

    async def lookup(self, owner: int | None, ids: list[str]) -> list[Entry]:
        self._expire()
        mine = self._owners.get(owner, {})
        found: list[Entry] = []
        for wanted in ids:
            prefix = wanted + "::"
            for stream_id in mine:
                if stream_id == wanted or stream_id.startswith(prefix):
                    found.append(copy_of(self._logs[(owner, stream_id)].entry))
        return found

    async def request_cancel(self, owner: int | None, stream_id: str) -> Entry | None:
        log = self._live(owner, stream_id)
        if log is None:
            return None
        log.cancel = True
        return copy_of(log.entry)

    async def delete(self, owner: int | None, stream_id: str) -> Entry | None:
        log = self._live(owner, stream_id)
        if log is None:
            return None
        self._forget((owner, stream_id))
        return copy_of(log.entry)

    def writer(self, entry: Entry) -> MemoryWriter:
        log = self._logs.get((entry.owner, entry.id))
        if log is None or log.entry.gen != entry.gen:
            log = _Log(entry)
            log.gone = True  # opened and dropped again before its first byte
        return MemoryWriter(self, log)

    def totals(self) -> Retained:
        self._expire()
        running = 0
        by_kind: dict[str, int] = {}
        for log in self._logs.values():
            running += not log.entry.done
            by_kind[log.entry.kind] = by_kind.get(log.entry.kind, 0) + 1
        return Retained(
            responses=len(self._logs),
            running=running,
            bytes=self.bytes,
            evicted=self.evicted,
            trimmed=self.trimmed,
            refused=self.refused,
            by_kind=by_kind,
        )

    async def aclose(self) -> None:
        for key in list(self._logs):
            self._forget(key)

    async def sweep(self) -> None:
        """Forget what ended more than ``retain_secs`` ago (also done on every open)."""
        self._expire()

    # -- bounds ----------------------------------------------------------------------

    def _live(self, owner: int | None, stream_id: str) -> _Log | None:
        log = self._logs.get((owner, stream_id))
        if log is not None and log.entry.done and self._expired(log.entry):
            self._forget((owner, stream_id))
            return None
        return log

    def _expired(self, entry: Entry) -> bool:
        return entry.ended + self.bounds.retain_secs <= self.clock()

    def _expire(self) -> None:
        for ended in (self._ended, self._emptied):
            while ended:
                key = next(iter(ended))
                if not self._expired(self._logs[key].entry):
                    break
                self._forget(key)

    def _forget(self, key: Key) -> None:
        log = self._logs.pop(key, None)
        if log is None:
            return
        self._ended.pop(key, None)
        self._emptied.pop(key, None)
        mine = self._owners.get(key[0])
        if mine is not None:
            mine.pop(key[1], None)
            if not mine:
                del self._owners[key[0]]
        self.bytes -= log.entry.size
        log.gone = True
        log.records = []
        log.starts = []
        log.head = 0
        log.wake()

    def _grew(self, log: _Log, size: int) -> None:
        """``size`` more bytes are held for ``log``: keep it, and everything, bounded."""
        entry = log.entry
        entry.size += size
        self.bytes += size
        limit = self.bounds.max_bytes
        while entry.size > limit and log.held() > 1:
            freed = log.drop_head()
            entry.size -= freed
            self.bytes -= freed
            self.trimmed += 1
        if entry.size > limit and log.held() == 1:
            if log.bytewise:
                over = min(entry.size - limit, len(log.records[log.head]))
                freed = log.clip(len(log.records[log.head]) - over)
            else:
                freed = log.drop_head()
            entry.size -= freed
            self.bytes -= freed
            self.trimmed += 1
        self._fit()

    def _fit(self) -> None:
        total = self.bounds.total_bytes
        while self.bytes > total and self._ended:
            key, _ = self._ended.popitem(last=False)
            self._empty(self._logs[key])
            self._emptied[key] = None
        while self.bytes > total and self._emptied:
            self._forget(next(iter(self._emptied)))
        if self.bytes > total:
            for log in list(self._logs.values()):
                while self.bytes > total and log.held():
                    freed = log.drop_head()
                    log.entry.size -= freed
                    self.bytes -= freed
                    self.trimmed += 1
                if self.bytes <= total:
                    break

    def _empty(self, log: _Log) -> None:
        """Drop an ended response's records and object to stay within the total bound."""
        entry = log.entry
        freed = entry.size - ENTRY_OVERHEAD
        entry.first = entry.total
        entry.size = ENTRY_OVERHEAD
        entry.evicted = True
        entry.response = b""
        entry.unary = None
        log.records = []
        log.starts = []
        log.head = 0
        self.bytes -= freed
        self.evicted += 1
        log.wake()


class MemoryWriter:
    """:class:`~relay.core.streamlog.LogWriter` of a log kept in memory."""

    def __init__(self, store: MemoryStreams, log: _Log) -> None:
        self.store = store
        self.log = log

    def _verdict(self) -> Verdict:
        if self.log.gone:
            return "gone"
        return "cancel" if self.log.cancel else "ok"

    async def claim(self, lifetime: float) -> Verdict:
        if not self.log.gone and self.log.entry.state == "queued":
            self.log.entry.state = "running"
        return self._verdict()

    async def append(self, records: list[bytes], response: bytes | None = None) -> Verdict:
        log = self.log
        if log.gone or log.entry.done:
            return "gone"
        size = 0
        for record in records:
            size += log.add(record)
        if response is not None:
            size += len(response) - len(log.entry.response)
            log.entry.response = response
        self.store._grew(log, size)
        log.wake()
        return self._verdict()

    async def end(
        self,
        outcome: str,
        records: list[bytes],
        *,
        unary: Unary | None = None,
        response: bytes | None = None,
    ) -> None:
        log = self.log
        entry = log.entry
        if log.gone or entry.done:
            return
        size = 0
        for record in records:
            size += log.add(record)
        if response is not None:
            size += len(response) - len(entry.response)
            entry.response = response
        if unary is not None:
            if len(unary.body) > self.store.bounds.max_bytes:
                # Kept whole or not at all: a cut JSON document helps nobody.
                unary = Unary(unary.status, unary.headers, b"")
            entry.unary = unary
            size += len(unary.body)
        entry.state = "done"
        entry.outcome = outcome
        entry.ended = self.store.clock()
        self.store._ended[(entry.owner, entry.id)] = None
        self.store._grew(log, size)
        log.wake()
