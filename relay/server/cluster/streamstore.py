"""Resumable responses kept in Redis, where every process of a cluster reads them.

:class:`RedisStreams` is the :class:`~relay.core.streamlog.StreamStore` of cluster mode.
Each response is three keys under ``<REDIS_PREFIX>:rs:<owner>:``:

- ``<id>:m``, a hash: the entry (kind, state, units written and first held, bytes held,
  the response object, a non-streamed answer, its writer, the process its client
  reached, whether someone asked to cancel it);
- ``<id>:s``, a stream: the log, one entry per record with id ``<first unit>-1`` and the
  record in field ``d``, then an end marker ``<units written>-2``. A reader finds where
  to start with one ``XREVRANGE`` (a byte offset falls inside the record before it),
  replays with ``XRANGE`` and follows with :class:`~relay.server.cluster.followers.Followers`;
- ``idx``, a sorted set of the owner's ids by creation time (the per-key bound, lookups).

Redis streams rather than a list: entries keep their ids (a byte offset or sequence
number finds its place in one call), ``XTRIM MINID`` drops a prefix in one call, and
``XREAD BLOCK`` lets one connection follow many logs. Every change is one script
(``lua/stream*.lua``), run through the lean client where it applies. Keys expire: a
running response's after its request's lifetime plus STREAM_RETAIN_SECS, an ended one's
STREAM_RETAIN_SECS after its end.

Only the writer writes (the process with the worker; scripts refuse anyone else:
:mod:`relay.server.cluster.streamwriter`), and it counts the bytes: it splits a byte log
into records of at most PIECE_BYTES, drops the oldest past STREAM_RETAIN_BYTES, and keeps
the logs it wrote within STREAM_RETAIN_TOTAL_BYTES (the records of those that ended first
go first). A log whose
writer (or, before any byte, the process its client reached) is gone — its process's key
``<REDIS_PREFIX>:instance:<id>`` expired — is ended by the next reader that notices, with
the error a live client would have seen (:meth:`RedisStreams.settle`), except just after
Redis trouble (:mod:`relay.server.cluster.streamrecovery`).

Every connection is built by the process's
:class:`~relay.server.cluster.redissource.RedisSource` (one URL, or the master found
through Sentinel: SPEC §20), every call bounded by REDIS_TIMEOUT_SECS (the blocking read
that follows logs by its block time plus that). Redis out of reach refuses new
resumable responses and reattaches (503) and ends the readers' streams (they reattach);
writers keep what Redis did not take. A new master that lacks a log's last records has
the log ended where it holds it, as lost (:meth:`RedisStreams.lose`): a reader may start
up to that point, and gets 410 past it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from relay.core.streamlog import (
    ENTRY_OVERHEAD,
    RECORD_OVERHEAD,
    Bounds,
    Entry,
    Retained,
)
from relay.server.cluster.followers import Followers, read_log
from relay.server.cluster.leanredis import Script
from relay.server.cluster.redissource import RedisSource, source_of
from relay.server.cluster.scripts import lua
from relay.server.cluster.streamentry import entry_of, holds, lost_ending, orphan_ending
from relay.server.cluster.streamrecovery import TROUBLE, Key, Recovery, Written
from relay.server.cluster.streamwriter import RedisWriter
from relay.wire.errors import (
    StreamGone,
    StreamNotFound,
    StreamsExceeded,
    StreamsUnavailable,
)

logger = logging.getLogger("relay.streams")

OPEN = lua("streamopen")
CLAIM = lua("streamclaim")
APPEND = lua("streamappend")
END = lua("streamend")
CANCEL = lua("streamcancel")
EVICT = lua("streamevict")
#: How long an owner's index outlives its last new response.
_INDEX_MARGIN_SECS = 3600.0


def _owner(owner: int | None) -> str:
    return "-" if owner is None else str(owner)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStreams:
    """:class:`~relay.core.streamlog.StreamStore` in Redis (cluster mode)."""

    def __init__(
        self,
        redis: str | RedisSource,
        prefix: str,
        instance: str,
        bounds: Bounds,
        *,
        running_ttl: float,
    ) -> None:
        """``redis``: where Redis is (the process's :class:`RedisSource`, or a URL);
        ``running_ttl``: how long a response may run (the longest request timeout), for
        the expiry of those not claimed yet."""
        self.bounds = bounds
        self.instance = instance
        self.prefix = f"{prefix}:rs:"
        self.instances = f"{prefix}:instance:"
        self.running_ttl = running_ttl
        source = source_of(redis)
        self.redis = source.client(f"modelrelay:{instance}:streams")
        self.lean = source.lean(f"modelrelay:{instance}:streamlog")
        fast: Any = (
            (lambda source: Script(self.lean, source))
            if self.lean
            else (self.redis.register_script)
        )
        self._open_lua = self.redis.register_script(OPEN)
        self.claim_script = fast(CLAIM)
        self.append_script = fast(APPEND)
        self.end_script = fast(END)
        self._cancel_lua = self.redis.register_script(CANCEL)
        self._evict_lua = self.redis.register_script(EVICT)
        self.followers = Followers(source, f"modelrelay:{instance}:follow", self.redis)
        #: The logs this process wrote and still counts, oldest first.
        self.written: OrderedDict[Key, Written] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.trimmed = 0
        self.refused = 0
        self.settled = 0
        #: Logs ended here as lost (a new master lacked their last records).
        self.lost = 0
        self.recovery = Recovery(self)
        source.on_switch(self.recovery.switched)

    def keys_of(self, owner: int | None, stream_id: str) -> tuple[str, str, str]:
        base = f"{self.prefix}{_owner(owner)}:"
        return base + stream_id + ":m", base + stream_id + ":s", base + "idx"

    # -- the StreamStore protocol ---------------------------------------------------

    async def _open(self, entry: Entry, replace: bool, records: Sequence[bytes]) -> None:
        meta, log, index = self.keys_of(entry.owner, entry.id)
        pairs: list[bytes | str] = []
        for record in records:
            pairs += [f"{entry.total}-1", record]
            entry.total += len(record) if entry.kind == "replay" else 1
            entry.size += len(record) + RECORD_OVERHEAD
        entry.size += len(entry.response)
        fields: dict[str, str | bytes] = {
            "gen": entry.gen,
            "kind": entry.kind,
            "flavor": entry.flavor,
            "created": repr(entry.created),
            "origin": self.instance,
            "state": "queued",
            "total": str(entry.total),
            "first": "0",
            "size": str(entry.size),
            "response": entry.response,
        }
        flat = [item for pair in fields.items() for item in pair]
        ttl = int((self.running_ttl + self.bounds.retain_secs) * 1000)
        args = [
            f"{self.prefix}{_owner(entry.owner)}:",
            entry.id,
            "1" if replace else "0",
            self.bounds.per_key,
            ttl,
            ttl + int(_INDEX_MARGIN_SECS * 1000),
            int(entry.created * 1000),
            len(fields),
            *flat,
            len(records),
            *pairs,
        ]
        result = _text(await self._open_lua(keys=[meta, log, index], args=args))
        if result == "full":
            self.refused += 1
            raise StreamsExceeded(self.bounds.per_key)
        if result != "ok":
            raise ValueError(f"stream {entry.id!r} is already kept")

    async def _get(self, owner: int | None, stream_id: str) -> Entry | None:
        meta, _, _ = self.keys_of(owner, stream_id)
        raw: dict[bytes, bytes] = await self.redis.hgetall(meta)  # type: ignore[assignment]
        if not raw:
            return None
        entry = entry_of(owner, stream_id, raw)
        if not entry.done and await self.settle(entry, raw):
            return await self._get(owner, stream_id)
        return entry

    async def _follow(
        self, owner: int | None, stream_id: str, start: int
    ) -> AsyncGenerator[bytes, None]:
        _, log, _ = self.keys_of(owner, stream_id)
        entry = await self._get(owner, stream_id)
        if entry is None:
            raise StreamNotFound()
        if not holds(entry, start):
            raise StreamGone()

        async def still_kept(pos: int) -> bool:
            found = await self._get(owner, stream_id)
            return found is not None and holds(found, pos)

        async for piece in read_log(
            self.redis, self.followers, log, entry.kind == "replay", start, still_kept
        ):
            yield piece

    async def _lookup(self, owner: int | None, ids: list[str]) -> list[Entry]:
        _, _, index = self.keys_of(owner, "")
        held = [_text(member) for member in await self.redis.zrange(index, 0, -1)]
        found: list[Entry] = []
        for wanted in ids:
            prefix = wanted + "::"
            for stream_id in held:
                if stream_id == wanted or stream_id.startswith(prefix):
                    entry = await self._get(owner, stream_id)
                    if entry is not None:
                        found.append(entry)
        return found

    # -- the StreamStore protocol: Redis trouble is StreamsUnavailable (503) -----------

    async def open(self, entry: Entry, *, replace: bool, records: Sequence[bytes] = ()) -> None:
        try:
            await self._open(entry, replace, records)
        except TROUBLE as exc:
            raise self._unavailable(exc) from None

    async def get(self, owner: int | None, stream_id: str) -> Entry | None:
        try:
            return await self._get(owner, stream_id)
        except TROUBLE as exc:
            raise self._unavailable(exc) from None

    async def follow(
        self, owner: int | None, stream_id: str, start: int
    ) -> AsyncGenerator[bytes, None]:
        pieces = self._follow(owner, stream_id, start)
        started = False
        try:
            async for piece in pieces:
                started = True
                yield piece
        except TROUBLE as exc:
            if not started:
                raise self._unavailable(exc) from None
            # The response already started: its stream ends here (reattaching resumes).
            self.recovery.trouble()
            logger.warning("following %s failed: %s", stream_id[:100], exc)
        finally:
            await pieces.aclose()

    async def lookup(self, owner: int | None, ids: list[str]) -> list[Entry]:
        try:
            return await self._lookup(owner, ids)
        except TROUBLE as exc:
            raise self._unavailable(exc) from None

    async def request_cancel(self, owner: int | None, stream_id: str) -> Entry | None:
        try:
            return await self._mark(owner, stream_id, delete=False)
        except TROUBLE as exc:
            raise self._unavailable(exc) from None

    async def delete(self, owner: int | None, stream_id: str) -> Entry | None:
        try:
            return await self._mark(owner, stream_id, delete=True)
        except TROUBLE as exc:
            raise self._unavailable(exc) from None

    async def _mark(self, owner: int | None, stream_id: str, *, delete: bool) -> Entry | None:
        keys = list(self.keys_of(owner, stream_id))
        reply = await self._cancel_lua(keys=keys, args=[stream_id, "1" if delete else "0"])
        if not reply:
            return None
        raw = {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}
        return entry_of(owner, stream_id, raw)

    def writer(self, entry: Entry) -> RedisWriter:
        return RedisWriter(self, entry)

    def totals(self) -> Retained:
        running = sum(1 for held in self.written.values() if not held.ended)
        return Retained(
            responses=len(self.written),
            running=running,
            bytes=self.bytes,
            evicted=self.evicted,
            trimmed=self.trimmed,
            refused=self.refused,
        )

    async def sweep(self) -> None:
        """Stop counting the logs this process wrote that have expired."""
        cutoff = time.time() - self.bounds.retain_secs
        for key, held in list(self.written.items()):
            if held.ended and held.ended <= cutoff:
                self.forget(key)

    async def aclose(self) -> None:
        await self.recovery.aclose()
        await self.followers.aclose()
        await self.redis.aclose()
        if self.lean is not None:
            await self.lean.aclose()

    # -- orphans and bounds -----------------------------------------------------------

    async def settle(self, entry: Entry, raw: dict[bytes, bytes]) -> bool:
        """End a log whose writer (or, before one, whose client's process) is gone, with
        the error its client would have seen live. True when it did."""
        responsible = _text(raw.get(b"writer") or raw.get(b"origin") or b"")
        if not responsible:
            return False
        if not self.recovery.calm:
            return False  # (its process may not have renewed its key on Redis yet)
        if await self.redis.exists(self.instances + responsible):
            return False
        records, fields = orphan_ending(entry)
        settled = await self._end_as(entry, records, fields)
        if settled:
            self.settled += 1
            logger.warning(
                "stream %s lost its writer (process %s is gone); ended it", entry.id, responsible
            )
        return settled

    async def lose(self, owner: int | None, stream_id: str, gen: str) -> bool:
        """End the log of ``owner``'s ``stream_id`` (of ``gen``, written here) where Redis
        holds it, with the StreamLost error and its cut there: Redis lacks records its
        writer had written (a master that failed over without them). True when it did;
        raises Redis trouble."""
        meta, _, _ = self.keys_of(owner, stream_id)
        raw: dict[bytes, bytes] = await self.redis.hgetall(meta)  # type: ignore[assignment]
        if not raw:
            return False  # the new master never had it: unknown, as after a flush
        held = entry_of(owner, stream_id, raw)
        writer = _text(raw.get(b"writer") or b"")
        if held.gen != gen or held.done or writer not in ("", self.instance):
            return False
        records, fields = lost_ending(held)
        if not await self._end_as(held, records, fields):
            return False
        self.lost += 1
        return True

    async def _end_as(
        self, entry: Entry, records: list[bytes], fields: dict[str, str | bytes]
    ) -> bool:
        """End ``entry``'s log with the relay's ``records`` and ``fields``, provided
        nothing was written to it since it was read."""
        meta, log, _ = self.keys_of(entry.owner, entry.id)
        pairs: list[bytes | str] = []
        total = entry.total
        for record in records:
            pairs += [f"{total}-1", record]
            total += len(record) if entry.kind == "replay" else 1
        fields["total"] = str(total)
        flat = [item for pair in fields.items() for item in pair]
        args = [
            entry.gen,
            "",
            str(entry.total),
            "",
            int(self.bounds.retain_secs * 1000),
            f"{total}-2",
            len(fields),
            *flat,
            *pairs,
        ]
        return _text(await self.end_script(keys=[meta, log], args=args)) == "ok"

    def _unavailable(self, exc: BaseException) -> StreamsUnavailable:
        self.recovery.trouble()
        logger.warning("the store of resumable responses failed: %s", exc)
        return StreamsUnavailable()

    def count(self, key: tuple[int | None, str], gen: str, size: int, ended: float) -> None:
        held = self.written.get(key)
        if held is None or held.gen != gen:
            if held is not None:
                self.forget(key)
            held = self.written[key] = Written(gen, 0)
        self.bytes += size - held.size
        held.size = size
        if ended:
            held.ended = ended

    def forget(self, key: Key) -> None:
        held = self.written.pop(key, None)
        if held is not None:
            self.bytes -= held.size

    async def fit(self) -> None:
        """Keep the logs written here within STREAM_RETAIN_TOTAL_BYTES: the records of
        those that ended first go first, then their entries (as in memory)."""
        for mode in ("records", "all"):
            for key, held in list(self.written.items()):
                if self.bytes <= self.bounds.total_bytes:
                    return
                if not held.ended or (mode == "records" and held.size <= ENTRY_OVERHEAD):
                    continue
                meta, log, index = self.keys_of(*key)
                args: list[Any] = [held.gen, ENTRY_OVERHEAD, mode, key[1]]
                result = await self._evict_lua(keys=[meta, log, index], args=args)
                if _text(result) == "ok" and mode == "records":
                    self.evicted += 1
                    self.count(key, held.gen, ENTRY_OVERHEAD, held.ended)
                else:
                    self.forget(key)
