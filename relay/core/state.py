"""The two live records of the core, which point at each other: a :class:`RelayRequest`
(one client request as it travels through the relay, with its mailbox) and a
:class:`Worker` (one connected worker, with the requests in flight on it).

The HTTP edge owns the client side of a :class:`RelayRequest`: it awaits
:meth:`RelayRequest.next_events` and writes what arrives. The dispatcher owns the
other side and is the only writer. Events are:

- ``bytes``: a streaming chunk, already SSE-framed by the backend;
- :class:`Completion`: the final status, headers and body;
- a :class:`~relay.wire.errors.RelayError`: the request failed;
- :data:`CANCELLED`: the client went away; nothing more will be written.

Exactly one terminal event (anything but ``bytes``) is ever pushed.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from relay.core.stats import RequestRecord
from relay.wire.errors import Flavor, RelayError

if TYPE_CHECKING:
    from asyncio import Future, TimerHandle

    from relay.wire.protocol import TokenCounts


class Phase(enum.IntEnum):
    QUEUED = 1
    ASSIGNED = 2
    DONE = 3


@dataclass(frozen=True, slots=True)
class Completion:
    status: int
    headers: dict[str, str]
    body: bytes


class _Cancelled:
    __slots__ = ()

    def __repr__(self) -> str:
        return "CANCELLED"


CANCELLED: Final = _Cancelled()

Event = bytes | Completion | RelayError | _Cancelled


class RelayRequest:
    __slots__ = (
        "_events",
        "_waiter",
        "body",
        "buffer",
        "created",
        "created_wall",
        "deadline",
        "delivered",
        "endpoint_path",
        "enqueued_at",
        "finished_at",
        "first_byte_at",
        "flavor",
        "headers",
        "id",
        "is_streaming",
        "key_id",
        "model",
        "outcome",
        "phase",
        "provider",
        "queue_deadline",
        "queue_wait",
        "requeues",
        "seq",
        "status",
        "streamed_bytes",
        "timer",
        "token_counts",
        "worker",
        "worker_id",
        "worker_name",
    )

    def __init__(
        self,
        *,
        id: str,
        seq: int,
        provider: str,
        model: str,
        endpoint_path: str,
        flavor: Flavor,
        is_streaming: bool,
        body: str,
        headers: dict[str, str],
        key_id: int | None,
        created_wall: float,
        now: float,
        deadline: float,
    ) -> None:
        self.id = id
        self.seq = seq
        self.provider = provider
        self.model = model
        self.endpoint_path = endpoint_path
        self.flavor: Flavor = flavor
        self.is_streaming = is_streaming
        self.body = body
        self.headers = headers
        self.key_id = key_id
        self.created_wall = created_wall
        self.created = now
        self.deadline = deadline
        self.queue_deadline = deadline
        self.enqueued_at: float | None = None
        self.queue_wait = 0.0
        self.first_byte_at: float | None = None
        self.finished_at: float | None = None
        self.phase = Phase.QUEUED
        self.worker: Worker | None = None
        self.requeues = 0
        #: True once any byte of the response was handed to the client side; from
        #: then on the request can never be requeued (it would duplicate output).
        self.delivered = False
        self.streamed_bytes = 0
        self.buffer: list[str] = []
        self.timer: TimerHandle | None = None
        self.status: int | None = None
        self.outcome: str | None = None
        self.token_counts: TokenCounts | None = None
        self.worker_id: str | None = None
        self.worker_name: str | None = None
        self._events: list[Event] = []
        self._waiter: Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def push(self, event: Event) -> None:
        """Called by the dispatcher only."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_events(self) -> list[Event]:
        """Wait for at least one event and return everything that has arrived.

        Returning the whole backlog lets the HTTP edge write chunks that arrived
        together in one send, without ever delaying a chunk to wait for more.
        """
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = self._events
        self._events = []
        return events

    def record(self, cancel_reason: str | None = None) -> RequestRecord:
        """The bookkeeping record of this (finished) request."""
        counts = self.token_counts
        finished = self.finished_at or self.created
        return RequestRecord(
            request_id=self.id,
            key_id=self.key_id,
            provider=self.provider,
            model=self.model,
            endpoint=self.endpoint_path,
            worker_id=self.worker_id,
            worker_name=self.worker_name,
            status=self.status or 0,
            outcome=self.outcome or "error",
            streamed=self.is_streaming,
            queue_wait=self.queue_wait,
            ttfb=None if self.first_byte_at is None else self.first_byte_at - self.created,
            duration=finished - self.created,
            prompt_tokens=counts.prompt_tokens if counts else None,
            completion_tokens=counts.completion_tokens if counts else None,
            requeues=self.requeues,
            created_at=self.created_wall,
            cancel_reason=cancel_reason,
        )

    def __repr__(self) -> str:
        return f"<RelayRequest {self.id} {self.model} {self.phase.name}>"


class WorkerLink(Protocol):
    """The transport the core uses to reach one worker; never blocks the caller."""

    def send(self, text: str) -> None:
        """Queue one text frame; frames are delivered in call order."""

    def close(self, code: int, reason: str) -> None:
        """Close the socket after every frame queued before it."""


@dataclass(eq=False, slots=True)
class Worker:
    id: str
    provider: str
    name: str
    models: tuple[str, ...]
    max_concurrent: int
    link: WorkerLink
    connected_at: float
    last_pong: float
    reported_load: int = 0
    peer: str = ""
    protocol_version: str | None = None
    draining: bool = False
    requests_served: int = 0
    in_flight: dict[str, RelayRequest] = field(default_factory=dict)
    attached: bool = True
    model_set: frozenset[str] = frozenset()

    @property
    def load(self) -> int:
        """``max(reported_load, in_flight)``: neither a stale pong nor a burst of new
        assignments can oversubscribe the worker."""
        return max(self.reported_load, len(self.in_flight))

    @property
    def has_capacity(self) -> bool:
        return not self.draining and self.load < self.max_concurrent
