"""A resumable response's entry in Redis (the hash ``<id>:m`` of
:mod:`relay.server.cluster.streamstore`): read into an :class:`~relay.core.streamlog.Entry`,
and what the relay writes when it ends a log itself — its writer's process gone
(:func:`orphan_ending`), or its last records lost with a master that failed over
(:func:`lost_ending`): the error a live client would have seen, where the log stands.
"""

from __future__ import annotations

import json
import time

import msgspec

from relay.core.background import event, with_status
from relay.core.streamlog import Entry, Unary
from relay.wire.errors import RelayError, StreamLost, WorkerLost, error_response
from relay.wire.sse import error_event

Ending = tuple[list[bytes], dict[str, str | bytes]]


def entry_of(owner: int | None, stream_id: str, raw: dict[bytes, bytes]) -> Entry:
    """The entry of ``owner``'s ``stream_id`` from its hash as read (HGETALL)."""

    def text(name: bytes, default: str = "") -> str:
        value = raw.get(name)
        return default if value is None else value.decode()

    def number(name: bytes) -> float:
        try:
            return float(text(name, "0") or 0)
        except ValueError:
            return 0.0

    unary = None
    if b"unary_status" in raw:
        try:
            headers = msgspec.json.decode(raw.get(b"unary_headers") or b"{}")
        except msgspec.DecodeError:
            headers = {}
        unary = Unary(int(number(b"unary_status")), headers, raw.get(b"unary_body") or b"")
    state = text(b"state", "queued")
    return Entry(
        owner=owner,
        id=stream_id,
        kind="background" if text(b"kind") == "background" else "replay",
        flavor=text(b"flavor", "openai"),  # type: ignore[arg-type]
        created=number(b"created"),
        ended=number(b"ended"),
        state=state if state in ("queued", "running", "done") else "queued",  # type: ignore[arg-type]
        outcome=text(b"outcome"),
        first=int(number(b"first")),
        total=int(number(b"total")),
        size=int(number(b"size")),
        evicted=raw.get(b"evicted") == b"1",
        unary=unary,
        response=raw.get(b"response") or b"",
        gen=text(b"gen"),
        cut=int(number(b"cut")) if b"cut" in raw else -1,
    )


def holds(entry: Entry, start: int) -> bool:
    """Whether a reader may read ``entry``'s log from unit ``start`` on: not before what
    its bounds dropped, not after where a failover cut it."""
    return entry.first <= start and not entry.evicted and not 0 <= entry.cut < start


def unary_fields(unary: Unary) -> dict[str, str | bytes]:
    return {
        "unary_status": str(unary.status),
        "unary_headers": json.dumps(unary.headers),
        "unary_body": unary.body,
    }


def relay_ending(entry: Entry, error: RelayError) -> Ending:
    """The last records and fields of a log the relay ends with ``error`` where it
    stands: the error as the event of the log's kind, or as the whole answer when the log
    holds no byte."""
    records: list[bytes] = []
    fields: dict[str, str | bytes] = {"outcome": "failed", "ended": repr(time.time())}
    if entry.kind == "background":
        records.append(
            event("error", entry.total, code=error.code, message=error.message, param=None)
        )
        fields["response"] = with_status(
            entry.response, "failed", {"code": error.code, "message": error.message}
        )
    elif entry.total > 0:
        fields["outcome"] = "error"
        records.append(error_event(error, entry.flavor))
    else:
        fields["outcome"] = "error"
        status, headers, body = error_response(error, entry.flavor)
        fields.update(unary_fields(Unary(status, _named(headers), body)))
    return records, fields


def orphan_ending(entry: Entry) -> Ending:
    """The ending of a log whose writer is gone (:class:`~relay.wire.errors.WorkerLost`)."""
    return relay_ending(entry, WorkerLost())


def lost_ending(entry: Entry) -> Ending:
    """The ending of a log whose last records a failover lost
    (:class:`~relay.wire.errors.StreamLost`), cut where it stands."""
    records, fields = relay_ending(entry, StreamLost())
    fields["cut"] = str(entry.total)
    return records, fields


def _named(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
