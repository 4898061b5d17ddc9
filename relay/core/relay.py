"""The relay: the dispatcher plus everything that comes from workers.

:class:`Relay` is what the server edges hold (one per server process). It adds to
:class:`relay.core.dispatch.Dispatcher` the worker side: registration, the frames a
worker sends (chunks, completions, errors, pongs, model updates), drain, model
refresh and the heartbeat. Like the rest of the core, every method is synchronous
and runs on the event loop, so each decision is atomic.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable

from relay.core.dispatch import Dispatcher
from relay.core.registry import next_worker_id, routable, sanitize_models
from relay.core.state import Completion, Phase, RelayRequest, Worker, WorkerLink
from relay.wire import protocol
from relay.wire.errors import SlowClient, StreamTooLarge, WorkerFailed

logger = logging.getLogger("relay")

#: The longest drain deadline the core accepts (the admin API refuses longer ones).
MAX_DRAIN_SECS = 86_400.0


class Relay(Dispatcher):
    def attach_worker(
        self,
        *,
        provider: str,
        name: str,
        models: list[str],
        max_concurrent: int,
        current_load: int,
        link: WorkerLink,
        peer: str = "",
        protocol_version: str | None = None,
        features: Iterable[str] = (),
        refuses: Callable[[RelayRequest], str | None] | None = None,
        model_states: list[protocol.ModelState] | None = None,
        model_capacity: int | None = None,
    ) -> tuple[Worker, list[str]]:
        """Register a worker and start routing to it; returns it and the warnings of its
        ``register_ack`` (:meth:`admit_worker` and :meth:`start_worker` in one step)."""
        worker, ack = self.admit_worker(
            provider=provider,
            name=name,
            models=models,
            max_concurrent=max_concurrent,
            current_load=current_load,
            link=link,
            peer=peer,
            protocol_version=protocol_version,
            features=features,
            refuses=refuses,
            model_states=model_states,
            model_capacity=model_capacity,
        )
        self.start_worker(worker, ack)
        return worker, list(ack.warnings)

    def admit_worker(
        self,
        *,
        provider: str,
        name: str,
        models: list[str],
        max_concurrent: int,
        current_load: int,
        link: WorkerLink,
        peer: str = "",
        protocol_version: str | None = None,
        features: Iterable[str] = (),
        refuses: Callable[[RelayRequest], str | None] | None = None,
        model_states: list[protocol.ModelState] | None = None,
        model_capacity: int | None = None,
    ) -> tuple[Worker, protocol.RegisterAck]:
        """The worker a ``register`` describes, and the ``register_ack`` it is owed.

        ``model_states`` and ``model_capacity``: its models' states (models on demand,
        SPEC §19), taken when it announced the ``model_states`` extension.

        Nothing is routed to it and nothing is sent yet: in cluster mode the edge first
        makes the worker known to every process (so no process answers 404 for a model
        it was acked for), then calls :meth:`start_worker`.
        """
        state = self.providers.get(provider)
        cap = state.policy.max_models_per_worker if state else self.config.max_models_per_worker
        accepted, warnings = self._acceptable(provider, models, cap)
        clean_name = name.strip()[: self.config.max_worker_name_len] or "worker"
        if clean_name != name:
            warnings.append("worker name was trimmed or shortened")
        concurrency = min(max_concurrent, self.config.max_concurrent_cap)
        if concurrency != max_concurrent:
            warnings.append(f"max_concurrent capped at {concurrency}")
        now = self.loop.time()
        worker = Worker(
            id=next_worker_id(self.instance),
            provider=provider,
            name=clean_name,
            models=tuple(accepted),
            max_concurrent=concurrency,
            link=link,
            connected_at=now,
            last_pong=now,
            peer=peer,
            protocol_version=protocol_version,
            features=frozenset(features) & frozenset(protocol.FEATURES),
            refuses=refuses,
        )
        worker.report_load(current_load)
        if model_states is not None and protocol.MODEL_STATES in worker.features:
            self.take_states(worker, model_states, model_capacity)
        worker.model_set = routable(worker)
        ack = protocol.RegisterAck(
            worker_id=worker.id,
            models=list(worker.models),
            protocol_version=protocol.PROTOCOL_VERSION,
            warnings=warnings,
            heartbeat_interval_secs=self.config.heartbeat_interval,
            features=sorted(worker.features),
        )
        return worker, ack

    def start_worker(self, worker: Worker, ack: protocol.RegisterAck) -> None:
        """Send the worker its ``register_ack`` and start routing to it; queued work is
        offered to it before this returns (after the ack, on the same ordered link)."""
        worker.last_pong = self.loop.time()
        worker.link.send(ack)
        self.registry.add(worker)
        logger.info(
            "worker registered: %s (%s) provider=%s models=%s max_concurrent=%d",
            worker.name,
            worker.id,
            worker.provider,
            ",".join(worker.models),
            worker.max_concurrent,
        )
        self._ensure_heartbeat()
        self._offer(worker)
        if worker.states is not None:
            self._ensure_residency()
            self._reconcile()  # what waits for a model it holds gets it loaded

    def _acceptable(
        self, provider: str, models: list[str], cap: int
    ) -> tuple[list[str], list[str]]:
        """A worker's advertised models as acked: sanitized, minus those another
        provider declared exclusive; with the warnings for ``register_ack``."""
        accepted, warnings = sanitize_models(
            models, cap=cap, max_len=self.config.max_model_name_len
        )
        taken = self.reserved_for_others(provider, accepted)
        if taken:
            accepted = [m for m in accepted if m not in taken]
            shown = ", ".join(repr(m) for m in taken[:10])
            warnings.append(f"not acked, reserved for another provider: {shown}")
        return accepted, warnings

    def on_chunk(self, worker: Worker, request_id: str, chunk: str) -> None:
        request = worker.in_flight.get(request_id)
        if request is None:
            self._stray(worker, "response_chunk", request_id)
            return
        self._take_chunk(worker, request, chunk.encode(), chunk)

    def _take_chunk(
        self, worker: Worker, request: RelayRequest, data: bytes, text: str | None
    ) -> None:
        if request.detached:
            return  # its client left after the last event: these bytes reach nobody
        if request.hedge is not None:
            self._race(request, worker)  # the first frame of either attempt wins
        size = len(data)
        request.streamed_bytes += size
        if request.streamed_bytes > self.config.max_stream_bytes:
            logger.warning(
                "stream ceiling reached: %s on %s",
                request.id,
                worker.name,
                extra={"request_id": request.id},
            )
            self._abandon(request, "stream_limit")
            self._finish(request, StreamTooLarge())
            return
        if not request.is_streaming:
            # Kept until the completion: as large as one message may be, no larger.
            if request.streamed_bytes > self.config.max_message_bytes:
                logger.warning(
                    "non-streaming response too large: %s on %s",
                    request.id,
                    worker.name,
                    extra={"request_id": request.id},
                )
                self._abandon(request, "stream_limit")
                self._finish(request, WorkerFailed("The response is too large to relay"))
                return
            request.buffer.append(data.decode(errors="replace") if text is None else text)
            return
        if not request.delivered:
            request.delivered = True
            now = request.first_byte_at = self.loop.time()
            self.predictor.started(request, worker, now)
            if request.first_token_by:
                self._first_token(request, now)
        request.pending += size
        self.buffered += size
        request.push(data)
        if request.pending > self.config.stream_buffer_bytes or (
            self.buffered > self.config.stream_buffer_total_bytes
        ):
            self._hold_back(request, worker)

    def _hold_back(self, request: RelayRequest, worker: Worker) -> None:
        """More is buffered for ``request``'s client than allowed: pause its source or cut it.

        A worker that speaks flow control is asked to stop reading that backend
        response (the bytes already on their way still arrive); past twice the
        per-request bound, or for any other worker, the stream is ended with the
        error event and the worker gets ``cancel``. Nothing here waits: the other
        requests on the same socket carry on.
        """
        limit = self.config.stream_buffer_bytes
        if protocol.FLOW_CONTROL in worker.features and request.pending <= 2 * limit:
            if not request.paused:
                request.paused = True
                self.stats.pauses += 1
                worker.link.send(protocol.Pause(request_id=request.id))
            return
        logger.warning(
            "slow client: %s has %d bytes buffered (%d in all); ending its stream",
            request.id,
            request.pending,
            self.buffered,
        )
        self._abandon(request, "slow_client")
        self._finish(request, SlowClient())

    def on_complete(self, worker: Worker, message: protocol.ResponseComplete) -> None:
        request = worker.take(message.request_id)
        if request is None:
            self._stray(worker, "response_complete", message.request_id)
            return
        if request.hedge is not None:
            self._race(request, worker)
        request.worker = None
        worker.requests_served += 1
        now = self.loop.time()
        self._used(worker, request.model, now)
        self.predictor.dropped(request, worker, now)  # (a whole answer's prefill is long done)
        if not 200 <= message.status_code <= 599:
            # 1xx would let a worker write a second response onto the client's
            # connection (response splitting); only final statuses are relayed.
            logger.warning(
                "worker %s sent invalid status %r for %s",
                worker.name,
                message.status_code,
                request.id,
            )
            self._finish(request, WorkerFailed("The worker returned an invalid response"))
        else:
            body = message.body or ""
            if request.buffer:
                body = "".join(request.buffer) + body
            request.token_counts = message.token_counts
            if not worker.remote:
                self.rates.observe(request, worker, message.token_counts, now, message.status_code)
            self.router.completed(request, worker, message.token_counts)
            self._finish(request, Completion(message.status_code, message.headers, body.encode()))
        self._freed(worker, request.lease, light=request.light)

    def on_worker_error(self, worker: Worker, message: protocol.Error) -> None:
        if message.request_id is None:
            logger.warning("worker %s reported: %s", worker.name, message.message[:500])
            return
        request = worker.take(message.request_id)
        if request is None:
            self._stray(worker, "error", message.request_id)
            return
        if request.hedge is not None and self._attempt_failed(request, worker):
            self._freed(worker, light=request.light)  # the other attempt goes on
            return
        request.worker = None
        self.predictor.dropped(request, worker, self.loop.time())
        lease = request.lease  # requeueing takes the request's reservation away
        handed_back = message.code == protocol.BACKEND_UNREACHABLE
        if handed_back and protocol.BACKEND_HEALTH in worker.features:
            # Its backend never received it (SPEC §6: nothing reached the client):
            # back to the front of the queue, one requeue spent. The worker withdrew
            # its models first when its backend is down, so it is not picked again.
            logger.info(
                "worker %s: backend did not take %s (%s); requeueing",
                worker.name,
                request.id,
                message.message[:200],
            )
            if self._requeue(request):
                self._dispatch_provider(request.provider)
        elif message.code == protocol.WORKER_DRAINING:
            # Sent to a worker that was already shutting down: it never started, so
            # it goes back to the front of the queue at no cost to its requeue budget.
            logger.info(
                "worker %s is shutting down; %s goes back to the queue",
                worker.name,
                request.id,
                extra={"request_id": request.id},
            )
            worker.draining = True
            if self.placement is not None:
                self.placement.worker_changed(worker)
            if self._requeue(request, spend=False):
                self._dispatch_provider(request.provider)
        else:
            logger.warning(
                "worker %s failed %s: %s",
                worker.name,
                request.id,
                message.message[:500],
                extra={"request_id": request.id},
            )
            self._finish(request, WorkerFailed())
        self._freed(worker, lease, light=request.light)

    def on_pong(self, worker: Worker, current_load: int) -> None:
        worker.last_pong = self.loop.time()
        before = worker.load
        worker.report_load(current_load)
        if worker.load < before and not self.clustered:
            # (In cluster mode capacity is what the shared reservations say.)
            self._feed(worker)

    def on_models_update(
        self,
        worker: Worker,
        models: list[str],
        current_load: int | None,
        backend_error: str | None = None,
    ) -> list[str]:
        """The worker's new model list; ``backend_error`` says why it withdrew them."""
        if backend_error != worker.backend_error:
            if backend_error is None:
                logger.info("worker %s: its backend answers again", worker.name)
            else:
                logger.warning(
                    "worker %s: its backend cannot be reached (%s)", worker.name, backend_error
                )
            worker.backend_error = backend_error
        state = self.providers.get(worker.provider)
        cap = state.policy.max_models_per_worker if state else self.config.max_models_per_worker
        accepted, warnings = self._acceptable(worker.provider, models, cap)
        self.registry.set_models(worker, accepted, self.loop.time())
        if current_load is not None:
            worker.report_load(current_load)
        logger.info("worker %s models updated: %s", worker.name, ",".join(accepted) or "(none)")
        self._offer(worker)
        return warnings

    def on_model_states(self, worker: Worker, message: protocol.ModelStates) -> None:
        """Every model's state now (``model_states``, models on demand, SPEC §19)."""
        if protocol.MODEL_STATES not in worker.features:
            return
        self.take_states(worker, message.states, message.model_capacity, message.max_concurrent)

    def _offer(self, worker: Worker) -> None:
        """A worker arrived or changed: let it take queued work (here, or anywhere)."""
        if self.placement is not None:
            self.placement.worker_changed(worker)
        if not self.clustered:
            self._feed(worker)

    # -------------------------------------------------- from another server process

    def on_remote_bytes(self, worker: Worker, request_id: str, data: bytes) -> None:
        """Streamed bytes of a request another process serves (``worker`` stands in
        for its worker): the same path as a chunk from a worker connected here."""
        request = worker.in_flight.get(request_id)
        if request is not None:
            self._take_chunk(worker, request, data, None)

    def on_remote_complete(self, worker: Worker, request_id: str, completion: Completion) -> None:
        """The other process's whole answer (the status and headers it sent the relay,
        and the body of a response that was not streamed)."""
        request = worker.take(request_id)
        if request is None:
            return
        request.worker = None
        self._finish(request, completion)

    def on_remote_lost(self, worker: Worker, request_id: str, *, spend: bool) -> None:
        """The other process could not serve the request (its worker was gone, or the
        process itself): put it back in the queue while nothing reached the client."""
        request = worker.take(request_id)
        if request is None:
            return
        request.worker = None
        logger.info(
            "%s lost on %s: placing it again",
            request.id,
            worker.name,
            extra={"request_id": request.id},
        )
        self._requeue(request, spend=spend)

    def _stray(self, worker: Worker, kind: str, request_id: str) -> None:
        self.stats.dropped_frames += 1
        logger.info(
            "dropped %s for %s from %s: not in flight there",
            kind,
            request_id,
            worker.name,
            extra={"request_id": request_id},
        )

    # ------------------------------------------------------------------ clients

    def detach(self, request: RelayRequest) -> None:
        """The client of a stream left after the stream's last event reached it (the edge
        saw it go by, :class:`relay.wire.sse.StreamEnd`): it cancelled nothing.

        The backend generates nothing more, and the worker's completion, with the usage,
        is on its way: the request stays in flight, its worker not told, until that
        completion ends it as usual (``ok``, its tokens charged). If the completion has
        not come within ``stream_end_grace`` seconds, the request is cancelled as a client
        disconnect; its deadline stands if it comes first. Idempotent; an ended request
        is left alone, and one not in flight is cancelled.
        """
        if request.phase is not Phase.ASSIGNED:
            self.cancel(request, "client_disconnect")
            return
        if request.detached:
            return
        request.detached = True
        self.stats.left_after_end += 1
        grace_ends = self.loop.time() + self.config.stream_end_grace
        if grace_ends < request.deadline:
            if request.timer is not None:
                request.timer.cancel()
            request.timer = self.loop.call_at(grace_ends, self._detached_too_long, request)

    def _detached_too_long(self, request: RelayRequest) -> None:
        request.timer = None
        logger.info(
            "no completion for %s within %gs of its client leaving after the end; cancelling it",
            request.id,
            self.config.stream_end_grace,
            extra={"request_id": request.id},
        )
        self.cancel(request, "client_disconnect")

    # ------------------------------------------------------------------ operations

    def drain_worker(
        self, worker_id: str, *, timeout: float | None = None, reason: str = "maintenance"
    ) -> bool:
        """Stop routing to a worker, let its requests finish, close it when idle.

        At the deadline it is closed anyway and what is left is requeued.
        """
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            return False
        if worker.draining:
            return True
        if timeout is None or not math.isfinite(timeout):
            timeout = self.config.drain_timeout
        timeout = min(max(timeout, 0.0), MAX_DRAIN_SECS)  # the edges validate; never raise here
        worker.draining = True
        if self.placement is not None:
            self.placement.worker_changed(worker)  # no more reservations on it
        logger.info("graceful shutdown: draining %s (%s): %s", worker.name, worker.id, reason)
        worker.link.send(
            protocol.GracefulShutdown(reason=reason, drain_timeout_secs=math.ceil(timeout))
        )
        if not worker.in_flight:
            self.close_worker(worker, 1000, "worker drained")
        else:
            self._drain_timers[worker.id] = self.loop.call_later(
                timeout, self.close_worker, worker, 1000, "drain timeout"
            )
        return True

    def refresh_models(self, worker_id: str, reason: str = "operator") -> bool:
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            return False
        worker.link.send(protocol.ModelsRefresh(reason=reason))
        return True

    def _ensure_heartbeat(self) -> None:
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = self.loop.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval
        timeout = self.config.heartbeat_timeout
        tick = min(interval, timeout) / 2
        last_ping = self.loop.time()
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            try:
                for worker in list(self.registry.workers.values()):
                    if now - worker.last_pong > timeout:
                        logger.warning(
                            "worker heartbeat timed out: %s (%s)", worker.name, worker.id
                        )
                        self.close_worker(worker, 1001, "worker heartbeat timed out")
                if now - last_ping >= interval:
                    last_ping = now
                    ping = protocol.Ping(timestamp_unix_ms=int(time.time() * 1000))
                    for worker in self.registry.workers.values():
                        worker.link.send(ping)
            except Exception:  # keep beating for everyone else
                logger.exception("heartbeat tick failed")
