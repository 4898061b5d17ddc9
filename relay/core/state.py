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

Streamed bytes count as *pending* from the moment they are pushed until the edge
reports them written to the client (:meth:`relay.core.dispatch.Dispatcher.delivered`):
that is what the relay buffers for a client, and what flow control bounds.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, Protocol

from relay.core.stats import RequestRecord
from relay.wire.errors import Flavor, RelayError

if TYPE_CHECKING:
    from asyncio import Future, TimerHandle

    from relay.core.affinity import Affinity
    from relay.core.limits import Ticket
    from relay.core.speed import Speed
    from relay.wire.protocol import ServerMessage, TokenCounts


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
        "affinity",
        "ahead",
        "assigned_at",
        "awaits_load",
        "body",
        "buffer",
        "cached_guess",
        "cluster_seq",
        "created",
        "created_wall",
        "deadline",
        "deadline_ms",
        "delivered",
        "detached",
        "endpoint_path",
        "enqueued_at",
        "finished_at",
        "first_byte_at",
        "first_token_by",
        "flavor",
        "headers",
        "hedge",
        "id",
        "is_streaming",
        "key_id",
        "lease",
        "light",
        "model",
        "outcome",
        "paused",
        "pending",
        "phase",
        "predicted",
        "preemptions",
        "prefill_end",
        "prefill_secs",
        "prompt_bytes",
        "provider",
        "queue_deadline",
        "queue_wait",
        "rank",
        "relay_role",
        "requeues",
        "resume",
        "resume_key",
        "seq",
        "service_class",
        "start_by",
        "status",
        "streamed_bytes",
        "ticket",
        "timer",
        "token_counts",
        "trace",
        "translation",
        "why",
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
        #: Its priority class (SPEC §15): "priority", "default" or "flex" (a batch line).
        self.service_class = "default"
        #: The API key's admission (SPEC §13): closed when the request ends; its
        #: weight is the request's share in the fair queue. None without keys.
        self.ticket: Ticket | None = None
        self.created_wall = created_wall
        self.created = now
        self.deadline = deadline
        self.queue_deadline = deadline
        self.enqueued_at: float | None = None
        #: When it was last sent to a worker (loop time).
        self.assigned_at = 0.0
        self.queue_wait = 0.0
        self.first_byte_at: float | None = None
        self.finished_at: float | None = None
        self.phase = Phase.QUEUED
        self.worker: Worker | None = None
        self.requeues = 0
        #: True once any byte of the response was handed to the client side; from
        #: then on the request can never be requeued (it would duplicate output).
        self.delivered = False
        #: True once its client left after the stream's last event reached it: kept in
        #: flight for its completion (:meth:`relay.core.relay.Relay.detach`).
        self.detached = False
        self.streamed_bytes = 0
        #: Streamed bytes pushed to the edge and not yet written to the client.
        self.pending = 0
        #: True while the worker was asked to stop reading this response.
        self.paused = False
        self.buffer: list[str] = []
        self.timer: TimerHandle | None = None
        self.status: int | None = None
        self.outcome: str | None = None
        self.token_counts: TokenCounts | None = None
        #: What a kind of worker that cannot take the raw body made of it, computed
        #: once on its first look (see :attr:`Worker.refuses`); ``None`` until then.
        self.translation: object = None
        #: It generates nothing (token counting): it runs beside the generation slots.
        self.light = False
        self.worker_id: str | None = None
        self.worker_name: str | None = None
        #: Cluster mode: the capacity reservation this request holds (released when
        #: it leaves its worker), and its part in a request two processes share:
        #: "origin" where its client is, "worker" where its worker is, "" otherwise.
        self.lease: str | None = None
        self.relay_role = ""
        #: Its priority class (SPEC §15) and rank (0 highest; one less than the class's
        #: after waiting past the aging bound), and how often it lost its slot to a
        #: request of a higher class before its first byte.
        self.service_class = "default"
        self.rank = 1
        self.preemptions = 0
        #: Cluster mode: the request's place in the cluster-wide arrival order (0 until
        #: the shared queue gave it one); kept when it is placed again after a requeue.
        self.cluster_seq = 0
        #: Its trace while tracing is on (see :mod:`relay.core.tracer`), else None; and
        #: why the next worker is chosen, when it is not the usual selection
        #: (a preemption), for that trace.
        self.trace: object = None
        self.why = ""
        #: Cache-aware routing (SPEC §14): its key and prompt blocks; None: not routed by them.
        self.affinity: Affinity | None = None
        #: Models on demand (SPEC §19): it waited in the queue for its model to be
        #: loaded (its queue deadline is then MODEL_LOAD_TIMEOUT_SECS's).
        self.awaits_load = False
        #: Resumable responses (SPEC §18): "background" or "replay" when its response
        #: outlives its client (its log is written as it runs), else "".
        self.resume = ""
        #: Cluster mode: "<gen> <owner> <id>" of its log, for the worker's process.
        self.resume_key = ""
        #: Speed-aware routing (SPEC §21): the bytes of its prompt's fields (what its
        #: tokens are estimated from; 0: unknown), and, since it was last sent to a
        #: worker, what was predicted there: its time to first token and the prefill
        #: ahead of it there (seconds), the prompt tokens predicted cached there, and
        #: when and for how long its own prefill (loop time, 0 once it started
        #: answering or left). See :mod:`relay.core.prediction`.
        self.prompt_bytes = 0
        self.predicted = 0.0
        self.ahead = 0.0
        self.cached_guess = 0.0
        self.prefill_end = 0.0
        self.prefill_secs = 0.0
        #: Its first-token deadline (SPEC §21, :mod:`relay.core.deadlines`): as stated
        #: (ms, 0: none), as loop time (0.0: none), and the last moment it may leave the
        #: queue to meet it (0.0: not bounded by it).
        self.deadline_ms = 0
        self.first_token_by = 0.0
        self.start_by = 0.0
        #: Its second attempt while it is hedged (:mod:`relay.core.hedging`), else None.
        self.hedge: Hedge | None = None
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
            cached_tokens=counts.cached_tokens if counts else None,
            tokens_estimated=bool(counts and counts.estimated),
            requeues=self.requeues,
            created_at=self.created_wall,
            cancel_reason=cancel_reason,
            relay_role=self.relay_role,
            service_class=self.service_class,
            preemptions=self.preemptions,
            resume=self.resume,
        )

    def __repr__(self) -> str:
        return f"<RelayRequest {self.id} {self.model} {self.phase.name}>"


#: A hedge's life (:mod:`relay.core.hedging`): its timer runs (``ARMED``), the second
#: attempt is out (``RACING``), it is settled or was never needed (``SETTLED``).
ARMED: Final = 1
RACING: Final = 2
SETTLED: Final = 3


class Hedge:
    """A request's second attempt while it is hedged (SPEC §21, :mod:`relay.core.hedging`):
    its timer, then its worker, when it was sent and what was predicted there."""

    __slots__ = (
        "ahead",
        "cached",
        "due",
        "end",
        "predicted",
        "secs",
        "sent_at",
        "state",
        "timer",
        "worker",
    )

    def __init__(self) -> None:
        self.state = ARMED
        self.timer: TimerHandle | None = None
        #: Seconds after its dispatch the request is due a hedge (its predicted p95).
        self.due = 0.0
        #: The second attempt's worker while it races; its dispatch and prediction.
        self.worker: Worker | None = None
        self.sent_at = 0.0
        self.predicted = 0.0
        self.end = 0.0
        self.secs = 0.0
        self.cached = 0.0
        self.ahead = 0.0


@dataclass(slots=True)
class ModelOp:
    """One ``model_load`` / ``model_unload`` sent to a worker and not answered yet."""

    op_id: str
    kind: Literal["load", "unload"]
    model: str
    started: float
    #: Why: ``demand`` (a request waits), ``scale_out``, ``evict`` (room for ``then``),
    #: ``idle``.
    reason: str
    #: An eviction's purpose: the model to load once this unload succeeded.
    then: str | None = None
    #: A load whose model was reported loaded before its answer came (counted then).
    counted: bool = False
    #: Cluster mode: a load the cluster chose this worker for (its end is reported).
    cluster: bool = False


@dataclass(slots=True)
class ModelCounts:
    """One worker's loads and unloads of one model (``/admin/workers``, ``/metrics``)."""

    loads: int = 0
    load_failures: int = 0
    unloads: int = 0
    load_secs: float = 0.0
    last_load_secs: float | None = None
    #: Requests that waited for a load and were then served here.
    waited: int = 0


class WorkerLink(Protocol):
    """The transport the core uses to reach one worker; never blocks the caller."""

    def send(self, message: ServerMessage) -> None:
        """Queue one message; messages are delivered in call order.

        The link owns the encoding: the WebSocket consumer writes it as a JSON text
        frame, other kinds of worker translate it to what they speak."""

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
    #: The load of its last pong (shown to operators; see :attr:`extra_load`).
    reported_load: int = 0
    #: Requests the worker still runs that the server no longer counts (it cancelled
    #: them and the worker has not stopped yet), as its last pong or models_update
    #: showed them. Never more than what the worker said beyond ``in_flight``.
    extra_load: int = 0
    peer: str = ""
    protocol_version: str | None = None
    #: Protocol extensions the worker announced (``register.features``).
    features: frozenset[str] = frozenset()
    #: Its provider's ``eviction`` when it was admitted (see
    #: :class:`~relay.core.config.ProviderPolicy`); None: not tracked.
    eviction: int | None = None
    #: The id of its own credential when it joined with a token (SPEC §22); None when
    #: it connected with its provider's shared secret. Rotating that secret never
    #: closes a worker with its own credential: it is revoked alone.
    identity: int | None = None
    draining: bool = False
    #: Why the worker withdrew its models: its backend cannot be reached (it said so in
    #: ``register`` or ``models_update``); None while its backend answers.
    backend_error: str | None = None
    requests_served: int = 0
    in_flight: dict[str, RelayRequest] = field(default_factory=dict)
    #: How many of ``in_flight`` generate nothing (:attr:`RelayRequest.light`): they
    #: take no generation slot (see :meth:`take`).
    light: int = 0
    attached: bool = True
    model_set: frozenset[str] = frozenset()
    #: Cluster mode: a stand-in for a worker connected to another server process
    #: (``owner``), reached through it; never in the registry.
    remote: bool = False
    owner: str = ""
    #: Why this worker cannot take a given request for one of its models (``None``:
    #: it can). Unset for workers that speak the wire protocol, which take any request
    #: for their models; a legacy node refuses what its task format cannot express.
    #: Selection and the queue skip a worker for the requests it refuses, so it must
    #: be cheap and give the same answer every time for the same request.
    refuses: Callable[[RelayRequest], str | None] | None = None
    #: Models on demand (SPEC §19, the ``model_states`` extension): each acked model's
    #: state on its backend (``loaded``, ``loading``, ``loadable``, ``sleeping``); None
    #: for a worker without the extension, whose every acked model counts as loaded.
    #: Requests are routed to it only for the models it has loaded (``model_set``).
    states: dict[str, str] | None = None
    #: How many models its backend holds at once (None: no known bound).
    model_capacity: int | None = None
    #: model -> loop time it last took or finished a request (the least recently used
    #: model is the one unloaded to make room).
    used: dict[str, float] = field(default_factory=dict)
    #: The model operations sent to it and not answered yet, by op id.
    ops: dict[str, ModelOp] = field(default_factory=dict)
    #: model -> its loads, unloads and load times (shown per worker and model).
    model_counts: dict[str, ModelCounts] = field(default_factory=dict)
    #: Speed-aware routing (SPEC §21): model -> its learned speed here
    #: (:mod:`relay.core.rates`), and the loop time its backend is predicted to be
    #: through the prompts it was sent (:mod:`relay.core.prediction`).
    speed: dict[str, Speed] = field(default_factory=dict)
    busy_until: float = 0.0

    @property
    def load(self) -> int:
        """Busy slots: what the server knows is in flight, plus what only the worker knows.

        A completion or cancel frees its slot at once (``in_flight`` shrinks); a pong
        can add load the server does not know about but never hold a freed slot.
        Requests that generate nothing take no slot.
        """
        return len(self.in_flight) - self.light + self.extra_load

    def take(self, request_id: str) -> RelayRequest | None:
        """Remove a request from ``in_flight`` (finished, failed, cancelled, lost)."""
        request = self.in_flight.pop(request_id, None)
        if request is not None and request.light:
            self.light -= 1
        return request

    def report_load(self, current_load: int) -> None:
        """Take the worker's own count of running requests (pong, register, models_update).

        The frames are ordered on the socket: everything the worker finished before
        counting has already been processed here, so whatever it counts beyond
        ``in_flight`` is work the server stopped tracking.
        """
        self.reported_load = current_load
        self.extra_load = max(0, current_load - len(self.in_flight))

    @property
    def has_capacity(self) -> bool:
        return not self.draining and self.load < self.max_concurrent
