"""The request side of the relay core: admission, routing, the wait queue, deadlines,
cancellation and what happens to requests when their worker goes away.

:class:`Dispatcher` is the base of :class:`relay.core.relay.Relay` (one per server
process), which adds the frames that come from workers. Every method is synchronous and runs on the
event loop, so each decision (pick a worker and reserve its slot, dequeue and
assign, free a slot and hand it on) is atomic with respect to every other: there is
no ``await`` between looking and acting.

Request lifecycle::

    submit ─► QUEUED ──(capacity appears)──► ASSIGNED ──► DONE
                │  ▲                             │
                │  └──── worker lost, nothing ◄──┘
                │        delivered yet (requeue)
                └──► DONE (queue timeout, cancel, provider disabled/deleted)

Every request has exactly one timer armed: its queue deadline while queued, its
lifetime deadline while assigned. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from relay.core.affinity import Prompt, Router
from relay.core.capacity import Capacity
from relay.core.classes import DEFAULT, PRIORITY, RANK
from relay.core.cluster import ClusterSide
from relay.core.config import RelayConfig
from relay.core.deadlines import Deadlines
from relay.core.hedging import Hedging
from relay.core.limits import Ticket
from relay.core.placement import Placement
from relay.core.prediction import Predictor, prompt_bytes
from relay.core.preemption import Preemption
from relay.core.providers import ProviderState, ProviderTable
from relay.core.rates import Rates
from relay.core.registry import Registry
from relay.core.residency import Residency
from relay.core.routes import NON_GENERATING
from relay.core.state import CANCELLED, Completion, Phase, RelayRequest, Worker
from relay.core.stats import RelayStats, RequestRecord
from relay.core.tracer import NullTracer, RequestTracer
from relay.core.upkeep import ModelUpkeep
from relay.wire import protocol
from relay.wire.errors import (
    Flavor,
    ModelLoadTimeout,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    RelayError,
    RequestTimeout,
    ShuttingDown,
    SlowClient,
)
from relay.wire.protocol import CancelReason

logger = logging.getLogger("relay")

Observer = Callable[[RequestRecord], None]


class Dispatcher(
    ProviderTable,
    ClusterSide,
    Capacity,
    Preemption,
    Residency,
    ModelUpkeep,
    Deadlines,
    Hedging,
):
    def __init__(self, config: RelayConfig, *, instance: str | None = None) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.instance = instance or secrets.token_hex(2)
        self.registry = Registry(model_memory=config.model_memory)
        self.providers: dict[str, ProviderState] = {}
        self.stats = RelayStats()
        #: Cache-aware routing (SPEC §14); chooses only while its policy is cache_aware.
        self.router = Router(config.affinity)
        #: Speed-aware routing (SPEC §21): learned speeds, and the predictions made of
        #: them (for every request: they choose under ROUTING_POLICY=predicted and for
        #: requests with a deadline, and are shown against what was measured).
        self.rates = Rates(config.speed)
        self.predictor = Predictor(self.rates, self.router)
        self._hedging_on = config.hedging.max_share > 0.0
        self.observers: list[Observer] = [self.stats.observe]
        self.started_wall = time.time()
        self.shutting_down = False
        self.active = 0
        #: Streamed bytes pushed to the edges and not yet written to their clients.
        self.buffered = 0
        self._seq = 0
        self._idle = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._drain_timers: dict[str, asyncio.TimerHandle] = {}
        #: model -> the provider that declared it exclusive (the first by name, if two do).
        self.reserved: dict[str, str] = {}
        #: Cluster mode (SPEC §11): where requests are placed; None in a single process.
        self.placement: Placement | None = None
        #: Told of each request's dispatch and end; a NullTracer while tracing is off.
        self.tracer: RequestTracer = NullTracer()
        #: Cluster mode: provider -> models served by workers of other processes, and
        #: the part of them some worker has loaded (models on demand, SPEC §19).
        self.remote_models: dict[str, frozenset[str]] = {}
        self.remote_loaded: dict[str, frozenset[str]] = {}
        self.evicted: dict[str, int] = {}
        self._init_residency()
        self._init_deadlines()
        self._init_hedging()

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        *,
        model: str,
        endpoint_path: str,
        flavor: Flavor,
        is_streaming: bool,
        body: str,
        headers: dict[str, str],
        key_id: int | None = None,
        ticket: Ticket | None = None,
        service_class: str = DEFAULT,
        trace: object = None,
        prompt: Prompt | None = None,
        session: str | None = None,
        deadline_ms: int | None = None,
    ) -> RelayRequest:
        """Admit a client request: assign it now, queue it, or raise a RelayError.

        ``service_class`` is its priority class (SPEC §15), already clamped to what its
        key may ask for: a higher class goes first, and a request above ``flex`` that
        finds no free slot may take one from a ``flex`` request (:mod:`relay.core.preemption`).

        ``ticket`` is the API key's admission (:meth:`relay.core.limits.Limiter.admit`):
        the request owns it once this returns and closes it when it ends; when this
        raises, the caller still owns it. ``service_class`` is the request's priority
        class (SPEC §15), kept on the request. ``trace`` is its trace state when the
        edge traces it (:mod:`relay.core.tracer`).

        ``prompt`` is what cache-aware routing reads of the body (SPEC §14), decoded
        by the edge with the model, and ``session`` its session header's value.

        ``deadline_ms`` is the time to first token the client can accept (SPEC §21):
        when no worker is predicted to meet it this raises
        :class:`~relay.wire.errors.DeadlineUnmeetable` (:mod:`relay.core.deadlines`).
        """
        request_id = f"r-{self.instance}-{self._seq + 1:x}"
        try:
            if self.shutting_down:
                raise ShuttingDown()
            self._check_frame(request_id, model, endpoint_path, is_streaming, body, headers)
            candidates = self._candidates(model)
        except RelayError as exc:
            self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
            raise
        now = self.loop.time()
        self._seq += 1
        primary, primary_target = candidates[0]
        request = RelayRequest(
            id=request_id,
            seq=self._seq,
            provider=primary.policy.name,
            model=model,
            endpoint_path=endpoint_path,
            flavor=flavor,
            is_streaming=is_streaming,
            body=body,
            headers=headers,
            key_id=key_id,
            created_wall=time.time(),
            now=now,
            deadline=now + primary.policy.request_timeout,
        )
        request.ticket = ticket
        request.trace = trace
        request.service_class = service_class
        request.rank = RANK[service_class]
        request.prompt_bytes = prompt_bytes(prompt, body)
        if deadline_ms:
            request.deadline_ms = deadline_ms
            request.first_token_by = now + deadline_ms / 1000
        if self.router.enabled:
            affinity = request.affinity = self.router.affinity(prompt, model, session, key_id)
            if affinity is not None:
                if self.placement is not None:
                    affinity.anchor()  # what the cluster places it by, computed once
                affinity.sent()  # the body's bytes are not held a moment longer
        if endpoint_path in NON_GENERATING:
            request.light = True
            try:
                if self._place_light(request, candidates, now):
                    return request
            except RelayError as exc:
                self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
                raise
        if self.clustered:
            # Any worker of the cluster: the placement reserves one or queues the
            # request in the shared queue; meanwhile it waits here, deadlines armed.
            self._aim(request, primary, primary_target)
            if request.first_token_by:
                try:
                    self._check_cluster(primary, request, now)
                except RelayError as exc:
                    self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
                    raise
            self.active += 1
            self._enqueue(primary, request, now)
            self._await_model(primary, request)  # before its entry is placed: its deadline
            assert self.placement is not None
            self.placement.place(request)
            return request
        for state, target in candidates:
            worker = self._select(state.policy.name, target, request)
            if worker is not None:
                self._aim(request, state, target)  # (its model is the backend's name now)
                if request.first_token_by:
                    try:
                        self._check_now(request, worker, now)
                    except RelayError as exc:
                        self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
                        raise
                self.active += 1
                self._assign(request, worker, now)
                return request
        try:
            primary, primary_target = self._waiting_room(candidates, request)
        except RelayError as exc:
            self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
            raise
        # The bound is per class: a flood of bulk work never gets people refused.
        if len(primary.queue.classes[request.rank]) >= primary.policy.max_queue_len:
            logger.warning("queue full: provider=%s model=%s", primary.policy.name, model)
            full = QueueFull()
            self.record_rejection(full, model, endpoint_path, is_streaming, key_id)
            raise full
        self._aim(request, primary, primary_target)
        if request.first_token_by:
            try:
                self._check_queued(primary, request, now)
            except RelayError as exc:
                self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
                raise
        self.active += 1
        self._enqueue(primary, request, now)
        self._preempt_for(primary, request)
        self._await_model(primary, request)  # models on demand: loaded nowhere yet?
        return request

    def _select(self, provider: str, model: str, request: RelayRequest) -> Worker | None:
        """The worker for ``request`` now: the one predicted to answer first within the
        bounded-load guard (SPEC §21: ROUTING_POLICY=predicted, or it has a deadline),
        else the one holding its prefix within the guard (§14), else the least loaded
        (§6); None: none free."""
        if self.router.predicts or request.first_token_by:
            eligible = self.registry.eligible(provider, model, request)
            return self.predictor.choose(request, eligible, self.loop.time(), model)
        if request.affinity is not None:
            worker = self.router.choose(request, self.registry.eligible(provider, model, request))
            if worker is not None:
                return worker
        return self.registry.select(provider, model, request)

    def _place_light(
        self,
        request: RelayRequest,
        candidates: list[tuple[ProviderState, str]],
        now: float,
    ) -> bool:
        """Send a request that generates nothing straight to a worker serving its model.

        It takes no generation slot: of the workers connected here, the one running the
        fewest such requests below NON_GENERATING_PER_WORKER gets it. False when no
        worker here serves the model (it then waits for one like any request; in
        cluster mode the placement finds one anywhere, in a generation slot); raises
        QueueFull when every one that does is at that cap.
        """
        cap = self.config.non_generating_per_worker
        serving = False
        for state, target in candidates:
            best: Worker | None = None
            for worker in self.registry.serving_workers(state.policy.name, target):
                if worker.draining:
                    continue
                if worker.refuses is not None and worker.refuses(request) is not None:
                    continue
                serving = True
                if worker.light < cap and (best is None or worker.light < best.light):
                    best = worker
            if best is not None:
                self._aim(request, state, target)
                self.active += 1
                self._assign(request, best, now)
                return True
        if serving:
            logger.warning("no room for a non-generating request: model=%s", request.model)
            raise QueueFull()
        return False

    def _check_frame(
        self,
        request_id: str,
        model: str,
        endpoint_path: str,
        is_streaming: bool,
        body: str,
        headers: dict[str, str],
    ) -> None:
        frame = protocol.Request(
            request_id=request_id,
            model=model,
            endpoint_path=endpoint_path,
            is_streaming=is_streaming,
            body=body,
            headers=headers,
        )
        if not protocol.frame_fits(frame, self.config.max_message_bytes):
            # A worker could never receive it: refuse it here rather than have the
            # send fail on every worker it is tried on.
            raise PayloadTooLarge("Request is too large to relay to a worker")

    def cancel(self, request: RelayRequest, reason: CancelReason = "client_disconnect") -> None:
        """End ``request`` because its client left (or the edge gave up on it).

        Queued: removed, no worker ever hears of it. In flight: one ``cancel`` is sent
        and the worker's slot is free again before this returns.
        """
        if request.phase is Phase.DONE:
            return
        if request.phase is Phase.QUEUED:
            state = self.providers.get(request.provider)
            if state is not None:
                state.queue.remove(request)
        else:
            self._abandon(request, reason)
        self._finish(request, CANCELLED, outcome="cancelled", cancel_reason=reason)

    def delivered(self, request: RelayRequest, size: int) -> None:
        """The edge wrote ``size`` streamed bytes of ``request`` to its client.

        Frees that much of the buffer budget; a request paused for its slow client
        is resumed once it drained to half its bound (and the total is under its own).
        """
        size = min(size, request.pending)
        request.pending -= size
        self.buffered -= size
        if (
            request.paused
            and request.pending <= self.config.stream_buffer_bytes // 2
            and self.buffered <= self.config.stream_buffer_total_bytes
        ):
            request.paused = False
            worker = request.worker
            if worker is not None and worker.attached:
                worker.link.send(protocol.Resume(request_id=request.id))

    def stalled(self, request: RelayRequest) -> None:
        """The edge cut off a client that read nothing for STALL_TIMEOUT_SECS."""
        if request.phase is Phase.DONE:
            return
        self._abandon(request, "slow_client")
        self._finish(request, SlowClient())

    def release(self, request: RelayRequest) -> None:
        """The edge is done with ``request``: whatever it did not write is no longer held."""
        self.buffered -= request.pending
        request.pending = 0

    def _enqueue(self, state: ProviderState, request: RelayRequest, now: float) -> None:
        request.phase = Phase.QUEUED
        request.worker = None
        request.enqueued_at = now
        request.queue_deadline = min(now + state.policy.queue_timeout, request.deadline)
        if request.first_token_by:
            # It leaves at the last moment it could still start in time (SPEC §21).
            request.start_by = self._start_by(request, now)
            if request.start_by < request.queue_deadline:
                request.queue_deadline = request.start_by
        state.queue.push(request)
        self._arm(request, request.queue_deadline)

    def _assign(self, request: RelayRequest, worker: Worker, now: float) -> None:
        headers = self.tracer.dispatched(request, worker, now)
        if request.enqueued_at is not None:
            request.queue_wait += now - request.enqueued_at
            request.enqueued_at = None
        request.phase = Phase.ASSIGNED
        request.assigned_at = now
        request.worker = worker
        request.worker_id = worker.id
        request.worker_name = worker.name
        worker.in_flight[request.id] = request
        if not request.light and not worker.remote:
            self.predictor.assigned(request, worker, now)  # (before the router's note)
            if self._hedging_on and request.service_class == PRIORITY:
                self._arm_hedge(request, worker, now)
        if request.affinity is not None:
            self.router.assigned(request, worker)
        if worker.states is not None:
            self._took(worker, request, now)
        if request.light:
            if request.lease is None:
                worker.light += 1
            else:  # the cluster's placement reserved it a slot: it holds one like any
                request.light = False
        worker.link.send(
            protocol.Request(
                request_id=request.id,
                model=request.model,
                endpoint_path=request.endpoint_path,
                is_streaming=request.is_streaming,
                body=request.body,
                headers=headers,
            )
        )
        logger.debug(
            "request dispatched: %s -> %s (%s)",
            request.id,
            worker.name,
            worker.id,
            extra={"request_id": request.id},
        )
        self._arm(request, request.deadline)

    def _abandon(self, request: RelayRequest, reason: CancelReason) -> None:
        """Take an assigned request away from its worker and tell the worker."""
        worker = request.worker
        if worker is None:
            return
        worker.take(request.id)
        request.worker = None
        self.predictor.dropped(request, worker, self.loop.time())
        if request.hedge is not None:
            self._abandon_hedge(request, reason)
        if worker.attached:
            if (
                reason not in protocol.BASE_CANCEL_REASONS
                and protocol.FLOW_CONTROL not in worker.features
            ):
                reason = "client_disconnect"  # the nearest reason every worker knows
            worker.link.send(protocol.Cancel(request_id=request.id, reason=reason))
            self.stats.cancels[reason] += 1
            self._freed(worker, request.lease, light=request.light)

    def _arm(self, request: RelayRequest, when: float) -> None:
        if request.timer is not None:
            request.timer.cancel()
        request.timer = self.loop.call_at(when, self._expire, request)

    def _expire(self, request: RelayRequest) -> None:
        request.timer = None
        if request.phase is Phase.QUEUED:
            state = self.providers.get(request.provider)
            if state is not None:
                state.queue.remove(request)
            if request.start_by and request.queue_deadline == request.start_by:
                logger.info(
                    "deadline: %s left the queue (its first token could no longer come in "
                    "time) model=%s",
                    request.id,
                    request.model,
                    extra={"request_id": request.id},
                )
                self._finish(request, self._deadline_error(request, state))
            elif request.queue_deadline < request.deadline:
                logger.info(
                    "queue timeout: %s model=%s",
                    request.id,
                    request.model,
                    extra={"request_id": request.id},
                )
                if request.awaits_load and not self.registry.loaded(
                    request.provider, request.model
                ):
                    self._finish(request, ModelLoadTimeout(request.model))
                else:
                    self._finish(request, QueueTimeout())
            else:
                self._finish(request, RequestTimeout())
        elif request.phase is Phase.ASSIGNED:
            logger.info(
                "request timeout: %s on %s",
                request.id,
                request.worker_name,
                extra={"request_id": request.id},
            )
            self._abandon(request, "timeout")
            self._finish(request, RequestTimeout())

    def _finish(
        self,
        request: RelayRequest,
        result: Completion | RelayError | object,
        *,
        outcome: str | None = None,
        cancel_reason: str | None = None,
    ) -> None:
        if request.phase is Phase.DONE:
            return
        if request.phase is Phase.QUEUED and self.placement is not None:
            self.placement.withdraw(request)
        request.phase = Phase.DONE
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        if request.hedge is not None and request.hedge.timer is not None:
            request.hedge.timer.cancel()
            request.hedge.timer = None
        now = self.loop.time()
        request.finished_at = now
        if request.enqueued_at is not None:
            request.queue_wait += now - request.enqueued_at
            request.enqueued_at = None
        if isinstance(result, Completion):
            request.status = result.status
            request.outcome = outcome or ("ok" if result.status < 400 else "upstream_error")
            if request.first_byte_at is None:
                request.first_byte_at = now
                if request.first_token_by:
                    self._first_token(request, now)
        elif isinstance(result, RelayError):
            request.status = result.status
            request.outcome = outcome or result.outcome
        else:
            request.status = 499
            request.outcome = outcome or "cancelled"
        request.body = ""
        request.buffer = []
        request.push(result)  # type: ignore[arg-type]
        if request.ticket is not None:
            request.ticket.close(request.token_counts)  # the key's slot, its tokens
        self.active -= 1
        if self.shutting_down and self.active <= 0:
            self._idle.set()
        self.tracer.finished(request)
        self._record(request, cancel_reason)

    def _record(self, request: RelayRequest, cancel_reason: str | None) -> None:
        self._notify(request.record(cancel_reason))

    def record_rejection(
        self, exc: RelayError, model: str, endpoint: str, streamed: bool, key_id: int | None
    ) -> None:
        """Count a request refused before admission (bad input, auth, 404, 429, 503)."""
        self._notify(
            RequestRecord.rejected(
                status=exc.status,
                outcome=exc.outcome,
                model=model,
                endpoint=endpoint,
                streamed=streamed,
                key_id=key_id,
            )
        )

    def _notify(self, record: RequestRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer must never break the request path
                logger.exception("request observer failed")
