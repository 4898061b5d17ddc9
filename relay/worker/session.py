"""One WebSocket connection to the relay, from ``register`` to close (SPEC §7).

``worker.Worker`` creates a :class:`Session` for each connection its reconnect loop
opens and awaits :meth:`Session.run` until the connection ends. The session is typed
against :class:`Owner`, the little it needs from the worker, so it never imports
``worker.py``. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from relay.wire import logrecord
from relay.wire.errors import ProtocolError
from relay.wire.protocol import (
    BACKEND_HEALTH,
    BACKEND_UNREACHABLE,
    FEATURES,
    FLOW_CONTROL,
    METRICS,
    MODEL_STATES,
    PROTOCOL_VERSION,
    WORKER_DRAINING,
    Cancel,
    Error,
    GracefulShutdown,
    MetricsRejected,
    ModelLoad,
    ModelsRefresh,
    ModelsUpdate,
    ModelUnload,
    Pause,
    Ping,
    Pong,
    Register,
    RegisterAck,
    Request,
    Resume,
    WorkerMessage,
    decode_server_message,
)
from relay.worker import sampler
from relay.worker.announcer import ModelAnnouncer
from relay.worker.backend import Backend, BackendUnreached, Valve
from relay.worker.config import Config
from relay.worker.operations import ModelOperations
from relay.worker.outbox import Outbox, encode
from relay.worker.tracing import CallTracer
from relay.worker.tracker import ModelTracker
from relay.worker.usage import format_counts

# The worker's one logger, whichever module writes: operators filter on it (docs/WORKER.md).
log = logging.getLogger("modelrelay.worker")

#: Server pings that may go missing in a row before a silent connection counts as dead.
SILENT_PINGS = 3
#: A silence limit derived from the server's ping period is never shorter than this:
#: a short network hiccup must not cost a reconnect (and requeued requests).
MIN_SILENCE_SECS = 5.0
#: Nor longer than this, whatever ping period a server announces.
MAX_SILENCE_SECS = 24 * 3600.0
#: Close code and reason a worker gives up a silent connection with.
SILENCE_CLOSE = (1001, "no message from the server")


def silence_limit(configured: float, ping_interval: float | None) -> float | None:
    """Seconds without any frame from the server after which the worker reconnects.

    Called when ``register_ack`` arrives. ``None`` (wait forever, as with servers that
    predate the extension) when the ack announces no usable ping period; otherwise
    ``configured`` (``--server-silence-secs``) when set, else :data:`SILENT_PINGS` ping
    periods, bounded by :data:`MIN_SILENCE_SECS` and :data:`MAX_SILENCE_SECS`.
    """
    if ping_interval is None or not math.isfinite(ping_interval) or ping_interval <= 0:
        return None
    if configured > 0:
        return configured
    return min(max(SILENT_PINGS * ping_interval, MIN_SILENCE_SECS), MAX_SILENCE_SECS)


class Owner(Protocol):
    """What a session needs from the worker that owns it (``worker.Worker``)."""

    #: Set once the worker stops taking work; a relay ``graceful_shutdown`` sets it too.
    draining: bool
    #: Why the backend cannot be reached (models withdrawn meanwhile); None: it answers.
    backend_error: str | None

    @property
    def config(self) -> Config: ...

    @property
    def max_concurrent(self) -> int: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def tracker(self) -> ModelTracker:
        """The backend's models on demand (a plain backend's tracker reports none)."""
        ...

    @property
    def operations(self) -> ModelOperations:
        """Loads and unloads on the relay's word (``model_states``)."""
        ...

    @property
    def tracing(self) -> CallTracer:
        """Traces of backend calls (SPEC §17); a null one while tracing is off."""
        ...

    def advertised(self) -> list[str]:
        """The models to register with: none while draining."""
        ...

    async def refresh_models(self, session: Session, *, always: bool) -> None:
        """Re-read the backend's models and send ``models_update`` through ``session``."""
        ...

    def backend_unreachable(self, problem: str) -> None:
        """The backend refused a connection: withdraw the models until it answers."""
        ...


class Session:
    """One WebSocket connection to the relay: register, serve frames, clean up.

    Owns every task it starts (one per request plus helpers); all are cancelled and
    awaited when the connection ends, which closes their backend connections.
    """

    def __init__(self, worker: Owner, ws: ClientConnection) -> None:
        self.worker = worker
        self.ws = ws
        self.requests: dict[str, asyncio.Task[None]] = {}
        #: Flow control of each request in ``requests`` (``pause`` / ``resume``).
        self.valves: dict[str, Valve] = {}
        self.children: set[asyncio.Task[Any]] = set()
        self.registered_at: float | None = None
        self.draining = False
        #: The extensions the server accepted in ``register_ack``.
        self.accepted: frozenset[str] = frozenset()
        #: Event-loop time of the last frame received from the server.
        self.last_heard = asyncio.get_running_loop().time()
        self._watchdog: asyncio.Task[None] | None = None
        #: This connection's side of the ``metrics`` extension.
        self.metrics = sampler.Federating()
        #: Every frame to the relay goes through it, in order.
        self.outbox = Outbox(ws, self.spawn)
        #: This connection's side of the ``model_states`` extension.
        self.models = ModelAnnouncer(worker, self.send, self.outbox.post, self.spawn)

    @property
    def load(self) -> int:
        return len(self.requests)

    async def send(self, message: WorkerMessage) -> None:
        await self.outbox.send(encode(message))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.children.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self.children.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        # A send racing the connection's end is expected; anything else is a bug to see.
        if exc is not None and not isinstance(exc, ConnectionClosed):
            log.error("task %s failed", task.get_name(), exc_info=exc)

    async def run(self) -> None:
        worker = self.worker
        try:
            models = worker.advertised()
            states, capacity = self.models.register_fields(models)
            await self.send(
                Register(
                    worker_name=worker.config.worker_name,
                    models=models,
                    max_concurrent=worker.max_concurrent,
                    protocol_version=PROTOCOL_VERSION,
                    current_load=0,
                    features=self.features(),
                    backend_error=worker.backend_error,
                    model_states=states,
                    model_capacity=capacity,
                )
            )
            loop = asyncio.get_running_loop()
            while True:
                raw = await self.ws.recv()
                self.last_heard = loop.time()
                await self.on_frame(raw)
        except ConnectionClosed:
            pass
        finally:
            children = list(self.children)
            for task in children:
                task.cancel()
            if children:
                await asyncio.wait(children)

    def features(self) -> list[str]:
        """The extensions to announce: all but ``metrics`` when that is turned off, and
        ``model_states`` only for a backend that loads models on demand."""
        off = {METRICS} if self.worker.config.backend_metrics_url is None else set()
        if not self.worker.tracker.on_demand:
            off.add(MODEL_STATES)
        return [f for f in FEATURES if f not in off]

    async def on_frame(self, raw: str | bytes) -> None:
        """Handle one frame quickly; anything slow runs in a task of its own."""
        try:
            message = decode_server_message(raw)
        except ProtocolError as exc:
            log.warning("ignoring a frame the worker cannot parse: %s", exc.message[:300])
            return
        match message:
            case Request():
                await self.on_request(message)
            case Cancel():
                self.on_cancel(message)
            case Pause() | Resume():
                self.on_flow(message)
            case Ping():
                pong = Pong(current_load=self.load, timestamp_unix_ms=message.timestamp_unix_ms)
                await self.send(pong)
            case RegisterAck():
                self.on_ack(message)
            case MetricsRejected():
                self.metrics.rejected(message)
            case ModelsRefresh():
                self.spawn(self.worker.refresh_models(self, always=True))
            case ModelLoad() | ModelUnload():
                self.models.on_op(message)
            case GracefulShutdown():
                log.info(
                    "graceful shutdown requested by the proxy (%s): finishing %d in-flight "
                    "request(s), then exiting",
                    message.reason or "no reason given",
                    self.load,
                )
                self.worker.draining = True
                self.drain(announce=False)

    def on_ack(self, ack: RegisterAck) -> None:
        self.registered_at = asyncio.get_running_loop().time()
        log.info(
            "registered as worker %s with models: %s",
            ack.worker_id,
            ", ".join(ack.models) or "(none)",
        )
        for warning in ack.warnings:
            log.warning("proxy warning on register: %s", warning)
        self.accepted = frozenset(ack.features) & frozenset(FEATURES)
        log.debug("proxy accepted features: %s", ", ".join(sorted(self.accepted)) or "(none)")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        interval = ack.heartbeat_interval_secs
        configured = self.worker.config.server_silence_secs
        limit = silence_limit(configured, interval)
        if limit is not None and interval is not None:
            if 0 < configured <= interval:
                log.warning(
                    "SERVER_SILENCE_SECS (%gs) is not longer than the proxy's ping period "
                    "(%gs): the connection will be dropped between two pings",
                    configured,
                    interval,
                )
            log.debug(
                "the proxy pings every %gs; reconnecting after %gs of silence", interval, limit
            )
            self._watchdog = self.spawn(
                self._watch_for_silence(limit, interval), name="silence watchdog"
            )
        on_demand = self.worker.tracker.on_demand
        if self.worker.config.models is None and not on_demand and not self.draining:
            self.spawn(self._refresh_periodically(), name="model refresh")
        if on_demand and MODEL_STATES in self.accepted:
            self.spawn(self.models.report(lambda: self.draining), name="model states")
        if METRICS in self.accepted:
            self.spawn(
                self.metrics.run(self.worker.config, self.send, lambda: self.load), name="metrics"
            )

    async def on_request(self, request: Request) -> None:
        rid = request.request_id
        if self.worker.draining:
            # The server sent it before it learned of the drain (our empty models_update
            # or its own graceful_shutdown); this code makes it requeue the request for
            # another worker instead of failing the client.
            log.info(
                "refusing request %s: the worker is shutting down", rid, extra={"request_id": rid}
            )
            await self.send(
                Error(request_id=rid, code=WORKER_DRAINING, message="worker is shutting down")
            )
            return
        if rid in self.requests:
            log.warning("ignoring a second request with id %s", rid, extra={"request_id": rid})
            return
        valve = Valve()
        task = self.spawn(self.serve(request, valve), name=f"request {rid}")
        self.requests[rid] = task
        self.valves[rid] = valve

        def forget(done: asyncio.Task[Any]) -> None:
            if self.requests.get(rid) is done:
                del self.requests[rid]
            if self.valves.get(rid) is valve:
                del self.valves[rid]

        task.add_done_callback(forget)

    def on_cancel(self, cancel: Cancel) -> None:
        tag = {"request_id": cancel.request_id}
        # Popped at once: the relay freed the slot, so pongs must not count it.
        task = self.requests.pop(cancel.request_id, None)
        if task is None:
            log.debug("cancel for %s: not in flight here", cancel.request_id, extra=tag)
            return
        self.valves.pop(cancel.request_id, None)
        # Any reason aborts: newer servers send reasons this worker does not know.
        log.info("cancelled request %s (%s)", cancel.request_id, cancel.reason, extra=tag)
        task.cancel()

    def on_flow(self, message: Pause | Resume) -> None:
        """``pause`` / ``resume``: stop or restart reading that one backend response."""
        rid, pause = message.request_id, isinstance(message, Pause)
        tag = {"request_id": rid}
        verb = "pause" if pause else "resume"
        if FLOW_CONTROL not in self.accepted:
            log.debug("%s for %s ignored: flow control was not agreed", verb, rid, extra=tag)
            return
        valve = self.valves.get(rid)
        if valve is None:  # finished or cancelled meanwhile: nothing to hold back
            log.debug("%s for %s ignored: not in flight here", verb, rid, extra=tag)
            return
        if pause:
            valve.pause()
        else:
            valve.resume()
        log.debug("%sd request %s", verb, rid, extra=tag)

    def drain(self, *, announce: bool) -> None:
        """Stop taking work; close the connection once in-flight requests finished."""
        if self.draining:
            return
        self.draining = True
        if announce:
            self.spawn(self.send(ModelsUpdate(models=[], current_load=self.load)))
        self.spawn(self._close_when_idle(), name="drain")

    async def _close_when_idle(self) -> None:
        pending = list(self.requests.values())
        if pending:
            await asyncio.wait(pending)
        log.info("graceful shutdown: no requests in flight; closing the connection")
        await self.ws.close(1000, "worker drained")

    async def _watch_for_silence(self, limit: float, interval: float) -> None:
        """Close the connection once the server sent nothing for ``limit`` seconds.

        The server pings every ``interval``; when even those stop, its application is
        gone although its WebSocket library may still answer WebSocket pings, so the
        worker would otherwise wait forever. Closing ends :meth:`run`, which aborts the
        requests in flight; the worker's loop then reconnects with backoff.
        """
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self.last_heard
        while quiet < limit:  # a timer pushed back by every frame, not a poll
            await asyncio.sleep(limit - quiet)
            quiet = loop.time() - self.last_heard
        log.warning(
            "no message from the proxy for %.1fs although it pings every %gs: the "
            "connection looks dead; closing it to reconnect",
            quiet,
            interval,
        )
        try:
            # A peer that stopped reading can block even the close frame: bounded.
            async with asyncio.timeout(self.ws.close_timeout):
                await self.ws.close(*SILENCE_CLOSE)
        except TimeoutError:
            self.ws.transport.abort()

    async def _refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.worker.config.model_refresh_secs)
            if not self.worker.draining:
                await self.worker.refresh_models(self, always=False)

    async def serve(self, request: Request, valve: Valve) -> None:
        """Forward one request to the backend and report its outcome to the relay."""
        started = time.monotonic()
        logrecord.request_id.set(request.request_id)  # this task's lines name it
        log.info(
            "forwarding request %s: %s model=%s stream=%s",
            request.request_id,
            request.endpoint_path,
            request.model,
            request.is_streaming,
        )
        backend = self.worker.backend
        tracing = self.worker.tracing
        span = tracing.start(request)
        complete = None
        try:
            complete = await backend.exchange(request, self.outbox, valve)
            frame = encode(complete)
            if len(frame) > self.worker.config.max_message_bytes:
                complete = backend.failure(request, "the backend's response is too large to relay")
                frame = encode(complete)
            await self.outbox.send(frame)
            log.debug(
                "completed request %s: status %d in %.3fs, tokens %s",
                request.request_id,
                complete.status_code,
                time.monotonic() - started,
                format_counts(complete.token_counts),
            )
        except BackendUnreached as exc:
            await self._hand_back(request, exc)
        except asyncio.CancelledError:
            log.debug("request %s aborted; backend connection closed", request.request_id)
            raise
        except ConnectionClosed:
            pass  # the session is ending; the relay handles this request's fate
        finally:
            tracing.end(span, complete)

    async def _hand_back(self, request: Request, exc: BackendUnreached) -> None:
        """The backend never took ``request``: give it back for the relay to requeue.

        A refused connection also withdraws this worker's models first (posted before
        the hand-back, so the relay does not send the request here again). A relay
        that did not accept ``backend_health`` gets the 502 it always got.
        """
        if exc.refused:
            self.worker.backend_unreachable(exc.problem)
        if BACKEND_HEALTH not in self.accepted:
            await self.outbox.send(encode(self.worker.backend.failure(request, exc.problem)))
            return
        log.info("handing request %s back to the relay to requeue", request.request_id)
        error = Error(
            request_id=request.request_id,
            code=BACKEND_UNREACHABLE,
            message=f"the backend did not take the request: {exc.problem}"[:1000],
        )
        await self.send(error)
