"""The append-only log of a resumable response (SPEC §18), and what every store of them
offers.

A response the client asked to survive its connection — an OpenAI Responses request
with ``background: true``, or a stream with llama.cpp's ``X-Conversation-Id`` — is
written, as it arrives from its worker, to a log that outlives every client. Each client
connection is a reader of the log: it replays from where it asks and follows what is
written after. The process that holds the worker's socket is the one writer.

A log is a sequence of *records*, counted in *units*:

- ``replay`` (llama.cpp's protocol): records are the stream's bytes as first sent, and a
  unit is a byte, so a reader may start at any byte offset;
- ``background`` (Responses): each record is one event, numbered by the relay, and a
  unit is an event, so a reader starts after a ``sequence_number``.

Every log is bounded (:class:`Bounds`): past STREAM_RETAIN_BYTES a log drops its oldest
records, past STREAM_RETAIN_TOTAL_BYTES the store drops the records of the responses
that ended first, and one API key holds at most STREAM_RETAIN_PER_KEY of them; a reader
that needs what was dropped gets :class:`~relay.wire.errors.StreamGone` (410). A log is
kept STREAM_RETAIN_SECS after its response ended, then forgotten.

:class:`StreamStore` is what the edges use; :mod:`relay.core.streamstore` keeps logs in
this process's memory, :mod:`relay.server.cluster.streamstore` in Redis, where every
process of a cluster reads them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from relay.wire.errors import Flavor

Kind = Literal["background", "replay"]
#: ``queued``: no byte yet; ``running``: its worker is writing; ``done``: it ended.
State = Literal["queued", "running", "done"]
#: What a writer is told after each append: go on, stop the request (someone asked to
#: cancel it), stop writing (the log was replaced, deleted or expired), or stop the
#: request because its log cannot be kept whole (``lost``: a Redis that failed over
#: without the log's last records; the writer ended the log where its store holds it).
Verdict = Literal["ok", "cancel", "gone", "lost"]

#: What one retained response costs besides its records (its entry, its key's index),
#: and each record besides its bytes: counted in the bounds, so that many small
#: responses, or a stream of tiny chunks, cannot hold more memory than they say.
ENTRY_OVERHEAD = 1024
RECORD_OVERHEAD = 64
#: Pieces a reader is handed are joined up to this size (one send each).
PIECE_BYTES = 64 * 1024
#: The longest id a client may name (a conversation id, a response id).
MAX_ID_LEN = 256


@dataclass(frozen=True, slots=True)
class Bounds:
    """STREAM_RETAIN_*: how long an ended response is kept, how many bytes one keeps,
    how many all of this process's keep, how many responses one API key may hold."""

    retain_secs: float = 600.0
    max_bytes: int = 8 * 1024 * 1024
    total_bytes: int = 256 * 1024 * 1024
    per_key: int = 256


@dataclass(frozen=True, slots=True)
class Unary:
    """A response that ended before its first streamed byte: the backend's whole answer
    (an error status, or a backend that ignored ``stream``) or the relay's error, sent to
    a reader as a normal response."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True)
class Entry:
    """What is known of one retained response (a copy: readers never change it)."""

    owner: int | None
    id: str
    kind: Kind
    flavor: Flavor
    #: Wall-clock seconds when it was created, and when it ended (0 while it runs).
    created: float
    ended: float = 0.0
    state: State = "queued"
    #: Once done: ``completed``, ``failed``, ``incomplete`` or ``cancelled`` (background;
    #: the Responses statuses), ``ok``, ``error`` or ``cancelled`` (replay).
    outcome: str = ""
    #: The first unit still held, and the units written (the next one's number).
    first: int = 0
    total: int = 0
    #: Bytes held for it (records, its response object, overheads).
    size: int = ENTRY_OVERHEAD
    #: Its records were dropped to keep the store within its total bound.
    evicted: bool = False
    unary: Unary | None = None
    #: Background: the response object as it stands (queued, in progress, final).
    response: bytes = b""
    #: Which opening of this id it is (a replaced conversation's old writer is refused).
    gen: str = ""
    #: Units from here on were lost (a Redis that failed over without them) and the log
    #: was ended here: a reader may start at it, not after it. -1: nothing was lost.
    cut: int = -1

    @property
    def done(self) -> bool:
        return self.state == "done"

    def describe(self) -> dict[str, object]:
        """llama.cpp's ``/v1/streams/lookup`` item."""
        return {
            "conversation_id": self.id,
            "is_done": self.done,
            "total_bytes": self.total,
            "started_at": int(self.created),
            "completed_at": int(self.ended),
        }


@dataclass(slots=True)
class Retained:
    """A store's totals (``/admin/stats``, ``/metrics``)."""

    responses: int = 0
    running: int = 0
    bytes: int = 0
    #: Responses whose records were dropped to stay within the total bound, and
    #: records dropped to keep one response within its own.
    evicted: int = 0
    trimmed: int = 0
    refused: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class LogWriter(Protocol):
    """The writing end of one log, held by the request's pump in the process whose
    worker serves it. Every method may be called only in this order: :meth:`claim`
    once, then :meth:`append` any number of times, then :meth:`end` once."""

    async def claim(self, lifetime: float) -> Verdict:
        """Become the log's writer (its first bytes are about to be written; its request
        may run ``lifetime`` seconds more). ``gone``: another process writes it, or it
        was replaced or deleted meanwhile."""

    async def append(self, records: list[bytes], response: bytes | None = None) -> Verdict:
        """Add ``records`` (and, background, the response object as it now stands).
        A store out of reach is no error: the writer keeps what it could not write
        (within the log's bound) and writes it at a later call."""

    async def end(
        self,
        outcome: str,
        records: list[bytes],
        *,
        unary: Unary | None = None,
        response: bytes | None = None,
    ) -> None:
        """Add the last records and say how it ended; readers see its end. Idempotent.
        A store out of reach is no error: the end is written as soon as it answers."""


class StreamStore(Protocol):
    """Where resumable responses are kept: :mod:`relay.core.streamstore` (memory) or
    :mod:`relay.server.cluster.streamstore` (Redis). Ids are per owner (API key):
    another key's id is never seen, whatever it is."""

    bounds: Bounds

    async def open(self, entry: Entry, *, replace: bool, records: Sequence[bytes] = ()) -> None:
        """Keep a new response (queued), its log starting with ``records`` (the relay's
        own first event). ``replace``: an existing one of the same id is
        dropped first (llama.cpp: one conversation, one stream); raises
        :class:`~relay.wire.errors.StreamsExceeded` when the owner holds too many running
        ones (the oldest ended one makes room otherwise)."""

    async def get(self, owner: int | None, stream_id: str) -> Entry | None:
        """The entry (None: not kept for this owner)."""

    def follow(self, owner: int | None, stream_id: str, start: int) -> AsyncGenerator[bytes, None]:
        """The log from unit ``start`` (raises StreamGone when that was dropped, before
        anything is yielded), then what is written after, until its end."""

    async def lookup(self, owner: int | None, ids: list[str]) -> list[Entry]:
        """The owner's entries named by ``ids``, each as itself or as ``<id>::<anything>``."""

    async def request_cancel(self, owner: int | None, stream_id: str) -> Entry | None:
        """Mark it to be cancelled: its writer stops at its next append."""

    async def delete(self, owner: int | None, stream_id: str) -> Entry | None:
        """Forget it (a running one's writer stops at its next append)."""

    def writer(self, entry: Entry) -> LogWriter:
        """The writing end of the log ``entry`` was opened as."""

    def totals(self) -> Retained: ...

    async def sweep(self) -> None:
        """Forget what expired (called every few seconds by the keeper)."""

    async def aclose(self) -> None: ...
