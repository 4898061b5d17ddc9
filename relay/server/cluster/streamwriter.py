"""The writing end of a resumable response's log in Redis (cluster mode, SPEC §18).

:class:`RedisWriter` is what the pump of the process whose worker serves the response
holds (:class:`~relay.core.streamlog.LogWriter`): one script call per batch of records,
refused (``gone``) once another process writes the log or it was replaced, deleted or
ended. It counts what the log holds, for the bounds :class:`~relay.server.cluster.
streamstore.RedisStreams` keeps.

Redis out of reach (a failover under way, a master that stopped answering, a new master
that refuses writes until its replica is back) stops no response (SPEC §20): the writer
keeps the records it could not write, within the log's own bound (what the bound would
drop is not kept), and sends them with the next ones, trying again no sooner than a
backoff; an end it could not write is written by a task of the store's recovery
(:mod:`relay.server.cluster.streamrecovery`) as soon as Redis answers, until the log would
have expired. Records carry their ids, so one sent again after a lost reply is not added
twice.

A master that took over without the log's last records (replication is asynchronous)
says so (``short``): those records are not kept here once written, so the log cannot be
made whole. The writer ends it where the new master holds it, with the
:class:`~relay.wire.errors.StreamLost` error as a live client would see it, marks where
(``cut``: a reader may start there, not after: 410), and tells its pump ``lost``, which
stops the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Protocol

from relay.core.streamlog import PIECE_BYTES, RECORD_OVERHEAD, Bounds, Entry, Unary, Verdict
from relay.server.cluster.streamentry import unary_fields
from relay.server.cluster.streamrecovery import RETRY_MAX_SECS, RETRY_SECS, TROUBLE, Recovery

logger = logging.getLogger("relay.streams")


class Store(Protocol):
    """What a writer uses of :class:`~relay.server.cluster.streamstore.RedisStreams`."""

    bounds: Bounds
    instance: str
    running_ttl: float
    bytes: int
    trimmed: int
    redis: Any
    claim_script: Any
    append_script: Any
    end_script: Any
    #: Writes tried again, Redis trouble noted.
    recovery: Recovery

    def keys_of(self, owner: int | None, stream_id: str) -> tuple[str, str, str]: ...

    def count(self, key: tuple[int | None, str], gen: str, size: int, ended: float) -> None:
        """The log ``key`` (of ``gen``) holds ``size`` bytes; ``ended``: when it ended."""

    async def fit(self) -> None:
        """Keep every log written here within the total bound."""

    async def lose(self, owner: int | None, stream_id: str, gen: str) -> bool:
        """End the log (of ``gen``) where Redis holds it, as lost; True when it did."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisWriter:
    """:class:`~relay.core.streamlog.LogWriter` of a log in Redis."""

    def __init__(self, store: Store, entry: Entry) -> None:
        self.store = store
        self.entry = entry
        self.key = (entry.owner, entry.id)
        self.keys = list(store.keys_of(entry.owner, entry.id))[:2]
        self.bytewise = entry.kind == "replay"
        self.total = entry.total
        self.first = entry.first
        self.size = entry.size
        self.response_size = len(entry.response)
        #: (first unit, bytes) of each record appended and still held, oldest first.
        self.held: deque[tuple[int, int]] = deque()
        #: Units the log held when the records not yet written were made (as Redis said).
        self.confirmed = entry.total
        #: Records made and not yet written, (first unit, data), oldest first; what they
        #: change of the entry (the response object, b"": unchanged; the trim).
        self.pending: deque[tuple[int, bytes]] = deque()
        self.response = b""
        self.minid = ""
        self.claimed = False
        self.lifetime = 0.0
        #: Once ``gone`` or ``lost``, said to every later call.
        self.verdict: Verdict = "ok"
        loop = asyncio.get_running_loop()
        self.loop = loop
        #: Until when its log may be written (then it has expired anyway), loop time.
        self.expires = loop.time() + store.running_ttl + store.bounds.retain_secs
        self.retry_at = 0.0
        self.delay = RETRY_SECS

    # -- the LogWriter protocol ------------------------------------------------------

    async def claim(self, lifetime: float) -> Verdict:
        self.lifetime = lifetime
        self.expires = self.loop.time() + lifetime + self.store.bounds.retain_secs
        try:
            return await self._claim()
        except TROUBLE as exc:
            self._failed(exc)
            return "ok"  # claimed with the first write Redis takes

    async def append(self, records: list[bytes], response: bytes | None = None) -> Verdict:
        if self.verdict != "ok":
            return self.verdict
        self._hold(records, response)
        if self.loop.time() < self.retry_at:
            return "ok"  # Redis failed a moment ago: kept for the next try
        try:
            verdict = await self._write()
        except TROUBLE as exc:
            self._failed(exc)
            return "ok"
        self.delay = RETRY_SECS
        await self._fit()
        return verdict

    async def end(
        self,
        outcome: str,
        records: list[bytes],
        *,
        unary: Unary | None = None,
        response: bytes | None = None,
    ) -> None:
        if self.verdict != "ok":
            return  # refused, or ended as lost already
        self._hold(records, response)
        ended = time.time()
        fields: dict[str, str | bytes] = {
            "outcome": outcome,
            "ended": repr(ended),
            "total": str(self.total),
            "first": str(self.first),
        }
        if unary is not None:
            if len(unary.body) > self.store.bounds.max_bytes:
                unary = Unary(unary.status, unary.headers, b"")
            fields.update(unary_fields(unary))
            self.size += len(unary.body)
        fields["size"] = str(self.size)

        async def attempt() -> bool:
            return await self._end(fields, ended)

        if self.loop.time() >= self.retry_at and await attempt():
            return
        self.store.recovery.later(attempt, self.expires, f"the end of {self.entry.id[:100]}")

    # -- writing -------------------------------------------------------------------------

    async def _claim(self) -> Verdict:
        ttl = int((self.lifetime + self.store.bounds.retain_secs) * 1000) + 1
        args = [self.entry.gen, self.store.instance, ttl]
        verdict = _text(await self.store.claim_script(keys=self.keys, args=args))
        if verdict == "gone":
            self._refused("gone")
        else:
            self.claimed = True
        return verdict  # type: ignore[return-value]

    async def _write(self) -> Verdict:
        """Write what is held back (one script call; a claim first when it is due)."""
        said: Verdict = "ok"
        if not self.claimed:
            said = await self._claim()
            if said == "gone":
                return "gone"
        args = [
            self.entry.gen,
            self.store.instance,
            str(self.total),
            str(self.first),
            str(self.size),
            self.minid,
            self.response,
            str(self.confirmed),
            *self._pairs(),
        ]
        reply = _text(await self.store.append_script(keys=self.keys, args=args))
        if reply.startswith("short"):
            return await self._short()
        if reply == "gone":
            return self._refused("gone")
        self._written()
        self.store.count(self.key, self.entry.gen, self.size, 0.0)
        return "cancel" if reply == "cancel" else said

    async def _end(self, fields: dict[str, str | bytes], ended: float) -> bool:
        """One try at writing the end (and what is held back). False: Redis trouble."""
        if self.verdict != "ok":
            return True
        try:
            if not self.claimed and await self._claim() == "gone":
                return True
            if self.response:
                fields["response"] = self.response
            flat = [item for pair in fields.items() for item in pair]
            args = [
                self.entry.gen,
                self.store.instance,
                "",
                str(self.confirmed),
                int(self.store.bounds.retain_secs * 1000),
                f"{self.total}-2",
                len(fields),
                *flat,
                *self._pairs(),
            ]
            reply = _text(await self.store.end_script(keys=self.keys, args=args))
        except TROUBLE as exc:
            self._failed(exc)
            return False
        if reply.startswith("short"):
            await self._short()
            return True
        # ("gone": refused, or ended already by a try whose reply was lost.)
        self.store.count(self.key, self.entry.gen, self.size, ended)
        if reply != "ok":
            self._refused("gone")
            return True
        minid = self.minid
        self._written()
        try:
            if minid:
                await self.store.redis.xtrim(self.keys[1], minid=minid)
        except TROUBLE as exc:  # (its retention bounds it all the same)
            logger.info("trimming the log of %s failed: %s", self.entry.id[:100], exc)
        await self._fit()
        return True

    async def _short(self) -> Verdict:
        """Redis lacks records this writer had written (a master that failed over without
        them): end the log where Redis holds it, as lost, and stop."""
        self._refused("lost")
        logger.warning(
            "the log of %s lost its last records in a Redis failover; ended it there",
            self.entry.id[:100],
        )
        owner, stream_id, gen = self.entry.owner, self.entry.id, self.entry.gen

        async def attempt() -> bool:
            try:
                await self.store.lose(owner, stream_id, gen)
            except TROUBLE as exc:
                self._failed(exc)
                return False
            return True

        if not await attempt():
            what = f"the lost end of {stream_id[:100]}"
            self.store.recovery.later(attempt, self.expires, what)
        return "lost"

    # -- what is held back ---------------------------------------------------------------

    def _hold(self, records: list[bytes], response: bytes | None) -> None:
        for record in records:
            pieces = (
                [record[i : i + PIECE_BYTES] for i in range(0, len(record), PIECE_BYTES)]
                if self.bytewise and len(record) > PIECE_BYTES
                else [record]
            )
            for piece in pieces:
                self.pending.append((self.total, piece))
                self.held.append((self.total, len(piece) + RECORD_OVERHEAD))
                self.size += len(piece) + RECORD_OVERHEAD
                self.total += len(piece) if self.bytewise else 1
        if response is not None:
            self.size += len(response) - self.response_size
            self.response_size = len(response)
            self.response = response
        # Drop the oldest records past the bound (written ones by a trim to MINID; those
        # held back are not written at all): what is held back stays within the bound.
        while self.size > self.store.bounds.max_bytes and len(self.held) > 1:
            _, size = self.held.popleft()
            self.size -= size
            self.first = self.held[0][0]
            self.minid = f"{self.first}-0"
            self.store.trimmed += 1
        while self.pending and self.pending[0][0] < self.first:
            self.pending.popleft()

    def _pairs(self) -> list[bytes | str]:
        pairs: list[bytes | str] = []
        for first, data in self.pending:
            pairs += [f"{first}-1", data]
        return pairs

    def _written(self) -> None:
        self.pending.clear()
        self.confirmed = self.total
        self.response = b""
        self.minid = ""

    def _refused(self, verdict: Verdict) -> Verdict:
        self.verdict = verdict
        self.pending.clear()
        return verdict

    def _failed(self, exc: BaseException) -> None:
        self.store.recovery.trouble()
        if self.delay == RETRY_SECS:  # (once per outage, not once per try)
            logger.warning(
                "writing the log of %s failed (%s); kept to write when Redis answers",
                self.entry.id[:100],
                exc,
            )
        self.retry_at = self.loop.time() + self.delay
        self.delay = min(self.delay * 2, RETRY_MAX_SECS)

    async def _fit(self) -> None:
        if self.store.bytes <= self.store.bounds.total_bytes:
            return
        try:
            await self.store.fit()
        except TROUBLE as exc:  # the next write tries again
            logger.info("keeping the logs within their total bound failed: %s", exc)
