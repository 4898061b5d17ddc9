"""The writing end of a resumable response's log in Redis (cluster mode, SPEC §18).

:class:`RedisWriter` is what the pump of the process whose worker serves the response
holds (:class:`~relay.core.streamlog.LogWriter`): one script call per batch of records,
refused (``gone``) once another process writes the log or it was replaced, deleted or
ended. It counts what the log holds, for the bounds :class:`~relay.server.cluster.
streamstore.RedisStreams` keeps.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any, Protocol

from relay.core.background import event, with_status
from relay.core.streamlog import PIECE_BYTES, RECORD_OVERHEAD, Bounds, Entry, Unary, Verdict
from relay.wire.errors import WorkerLost, error_response
from relay.wire.sse import error_event


class Store(Protocol):
    """What a writer uses of :class:`~relay.server.cluster.streamstore.RedisStreams`."""

    bounds: Bounds
    instance: str
    bytes: int
    trimmed: int
    redis: Any
    claim_script: Any
    append_script: Any
    end_script: Any

    def keys_of(self, owner: int | None, stream_id: str) -> tuple[str, str, str]: ...

    def count(self, key: tuple[int | None, str], gen: str, size: int, ended: float) -> None:
        """The log ``key`` (of ``gen``) holds ``size`` bytes; ``ended``: when it ended."""

    async def fit(self) -> None:
        """Keep every log written here within the total bound."""


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

    async def claim(self, lifetime: float) -> Verdict:
        ttl = int((lifetime + self.store.bounds.retain_secs) * 1000) + 1
        args = [self.entry.gen, self.store.instance, ttl]
        return _text(await self.store.claim_script(keys=self.keys, args=args))  # type: ignore[return-value]

    def _records(self, records: list[bytes]) -> list[bytes | str]:
        pairs: list[bytes | str] = []
        for record in records:
            pieces = (
                [record[i : i + PIECE_BYTES] for i in range(0, len(record), PIECE_BYTES)]
                if self.bytewise and len(record) > PIECE_BYTES
                else [record]
            )
            for piece in pieces:
                pairs += [f"{self.total}-1", piece]
                self.held.append((self.total, len(piece) + RECORD_OVERHEAD))
                self.size += len(piece) + RECORD_OVERHEAD
                self.total += len(piece) if self.bytewise else 1
        return pairs

    def _response(self, response: bytes | None) -> bytes:
        if response is None:
            return b""
        self.size += len(response) - self.response_size
        self.response_size = len(response)
        return response

    def _trim(self) -> str:
        """Drop the oldest records past the bound; the MINID to trim to ('' : none)."""
        minid = ""
        while self.size > self.store.bounds.max_bytes and len(self.held) > 1:
            _, size = self.held.popleft()
            self.size -= size
            self.first = self.held[0][0]
            minid = f"{self.first}-0"
            self.store.trimmed += 1
        return minid

    async def append(self, records: list[bytes], response: bytes | None = None) -> Verdict:
        pairs = self._records(records)
        changed = self._response(response)
        minid = self._trim()
        args = [
            self.entry.gen,
            self.store.instance,
            str(self.total),
            str(self.first),
            str(self.size),
            minid,
            changed,
            *pairs,
        ]
        verdict = _text(await self.store.append_script(keys=self.keys, args=args))
        self.store.count(self.key, self.entry.gen, self.size, 0.0)
        if self.store.bytes > self.store.bounds.total_bytes:
            await self.store.fit()
        return verdict  # type: ignore[return-value]

    async def end(
        self,
        outcome: str,
        records: list[bytes],
        *,
        unary: Unary | None = None,
        response: bytes | None = None,
    ) -> None:
        pairs = self._records(records)
        changed = self._response(response)
        minid = self._trim()
        ended = time.time()
        fields: dict[str, str | bytes] = {
            "outcome": outcome,
            "ended": repr(ended),
            "total": str(self.total),
            "first": str(self.first),
        }
        if changed:
            fields["response"] = changed
        if unary is not None:
            if len(unary.body) > self.store.bounds.max_bytes:
                unary = Unary(unary.status, unary.headers, b"")
            fields.update(unary_fields(unary))
            self.size += len(unary.body)
        fields["size"] = str(self.size)
        flat = [item for pair in fields.items() for item in pair]
        args = [
            self.entry.gen,
            self.store.instance,
            "",
            int(self.store.bounds.retain_secs * 1000),
            f"{self.total}-2",
            len(fields),
            *flat,
            *pairs,
        ]
        await self.store.end_script(keys=self.keys, args=args)
        if minid:
            await self.store.redis.xtrim(self.keys[1], minid=minid)
        self.store.count(self.key, self.entry.gen, self.size, ended)
        if self.store.bytes > self.store.bounds.total_bytes:
            await self.store.fit()


def unary_fields(unary: Unary) -> dict[str, str | bytes]:
    return {
        "unary_status": str(unary.status),
        "unary_headers": json.dumps(unary.headers),
        "unary_body": unary.body,
    }


def orphan_ending(entry: Entry) -> tuple[list[bytes], dict[str, str | bytes]]:
    """The last records and fields of a log whose writer is gone: the error a live
    client would have seen (:class:`~relay.wire.errors.WorkerLost`), as the event of the
    log's kind, or as the whole answer when no byte was written."""
    records: list[bytes] = []
    fields: dict[str, str | bytes] = {"outcome": "failed", "ended": repr(time.time())}
    lost = WorkerLost()
    if entry.kind == "background":
        records.append(
            event("error", entry.total, code=lost.code, message=lost.message, param=None)
        )
        fields["response"] = with_status(
            entry.response, "failed", {"code": lost.code, "message": lost.message}
        )
    elif entry.total > 0:
        fields["outcome"] = "error"
        records.append(error_event(lost, entry.flavor))
    else:
        fields["outcome"] = "error"
        status, headers, body = error_response(lost, entry.flavor)
        fields.update(unary_fields(Unary(status, _named(headers), body)))
    return records, fields


def _named(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
