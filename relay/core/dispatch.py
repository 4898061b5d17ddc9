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
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from relay.core.config import ProviderPolicy, RelayConfig
from relay.core.limits import Ticket
from relay.core.placement import Placement
from relay.core.queue import ProviderQueue
from relay.core.registry import Registry
from relay.core.state import CANCELLED, Completion, Phase, RelayRequest, Worker
from relay.core.stats import RelayStats, RequestRecord
from relay.wire import protocol
from relay.wire.errors import (
    BadRequest,
    Flavor,
    ModelNotFound,
    PayloadTooLarge,
    ProviderDisabled,
    ProviderGone,
    QueueFull,
    QueueTimeout,
    RelayError,
    RequestTimeout,
    RequeueExhausted,
    ShuttingDown,
    SlowClient,
    WorkerLost,
    WorkerUnavailable,
)
from relay.wire.protocol import CancelReason

logger = logging.getLogger("relay")

_json_decode = msgspec.json.Decoder(dict[str, Any]).decode
_json_encode = msgspec.json.Encoder().encode


def rewrite_model(body: str, model: str) -> str:
    """``body`` (a JSON object) with its ``model`` replaced, everything else kept."""
    document = _json_decode(body)
    document["model"] = model
    return _json_encode(document).decode()


Observer = Callable[[RequestRecord], None]


class ProviderState:
    __slots__ = ("policy", "queue", "touched")

    def __init__(self, policy: ProviderPolicy, touched: float) -> None:
        self.policy = policy
        self.queue = ProviderQueue()
        self.touched = touched


class Dispatcher:
    def __init__(self, config: RelayConfig, *, instance: str | None = None) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.instance = instance or secrets.token_hex(2)
        self.registry = Registry(model_memory=config.model_memory)
        self.providers: dict[str, ProviderState] = {}
        self.stats = RelayStats()
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
        #: Cluster mode: provider -> models served by workers of other processes.
        self.remote_models: dict[str, frozenset[str]] = {}

    # ------------------------------------------------------------------ providers

    def set_provider(self, policy: ProviderPolicy) -> None:
        """Create or update a provider; disabling fails its queue and closes its workers."""
        state = self.providers.get(policy.name)
        previous = state.policy.exclusive_models if state is not None else frozenset()
        if state is None:
            self.providers[policy.name] = ProviderState(policy, self.loop.time())
        else:
            state.policy = policy
            state.touched = self.loop.time()
        if policy.exclusive_models != previous:
            self._reserve_models()
        if not policy.enabled:
            self._evict_provider(policy.name, ProviderDisabled, "provider disabled")

    def reserved_for_others(self, provider: str, models: Iterable[str]) -> list[str]:
        """Which of ``models`` another provider declared exclusive."""
        reserved = self.reserved
        return [m for m in models if reserved.get(m, provider) != provider]

    def _reserve_models(self) -> None:
        """Rebuild the exclusive-model table and take newly reserved models away from
        other providers' workers (they are no longer routed there)."""
        reserved: dict[str, str] = {}
        for name in sorted(self.providers):
            for model in self.providers[name].policy.exclusive_models:
                reserved.setdefault(model, name)
        self.reserved = reserved
        now = self.loop.time()
        for worker in list(self.registry.workers.values()):
            taken = self.reserved_for_others(worker.provider, worker.models)
            if taken:
                logger.warning(
                    "worker %r (%s) no longer serves %s: reserved for another provider",
                    worker.name,
                    worker.id,
                    ", ".join(taken),
                )
                keep = [m for m in worker.models if m not in taken]
                self.registry.set_models(worker, keep, now)

    def sync_providers(self, policies: Iterable[ProviderPolicy], *, as_of: float) -> None:
        """Replace the provider set with a snapshot read at loop time ``as_of``.

        Providers touched after the snapshot was taken (a worker authenticated
        against a row created meanwhile) are kept: the snapshot is older than them.
        """
        seen = set()
        for policy in policies:
            seen.add(policy.name)
            current = self.providers.get(policy.name)
            if current is None or current.policy != policy:
                self.set_provider(policy)
        for name in [n for n, s in self.providers.items() if n not in seen and s.touched < as_of]:
            self.remove_provider(name)

    def remove_provider(self, name: str) -> None:
        """The provider was deleted: its queued and in-flight requests fail at once with the
        generic provider error, and its workers are closed."""
        state = self.providers.pop(name, None)
        self._evict_provider(name, ProviderGone, "provider deleted", state)
        self.registry.forget_provider(name)
        if state is not None and state.policy.exclusive_models:
            self._reserve_models()

    def _evict_provider(
        self,
        name: str,
        error: type[RelayError],
        reason: str,
        state: ProviderState | None = None,
    ) -> None:
        """Fail the provider's queue and close its workers; their requests in flight fail
        too (``_requeue`` finds the provider gone or disabled), never wait in a queue."""
        state = state or self.providers.get(name)
        if state is not None:
            for request in state.queue.drain():
                self._finish(request, error())
        for worker in self.registry.of_provider(name):
            self.close_worker(worker, 1008, reason)

    def resolve(self, provider: ProviderState, model: str) -> str:
        """The backend model id ``model`` names at ``provider``: its own alias, else the
        server-wide alias, else the name itself."""
        return provider.policy.aliases.get(model) or self.config.aliases.get(model) or model

    def _candidates(self, model: str) -> list[tuple[ProviderState, str]]:
        """Enabled providers that can serve ``model`` (with the model id it names there,
        after aliases), best first; raises when none.

        Preference: a connected worker advertises it, then the provider declares it,
        then a worker advertised it within ``model_memory``. A model one provider
        declared exclusive is routed to that provider only.
        """
        now = self.loop.time()
        ranked: list[tuple[int, str, ProviderState, str]] = []
        disabled = False
        for name, state in self.providers.items():
            target = self.resolve(state, model)
            owner = self.reserved.get(target)
            if owner is not None and name != owner:
                continue
            if self.registry.serving(name, target) or target in self.remote_models.get(name, ()):
                rank = 0
            elif target in state.policy.declared_models or owner == name:
                rank = 1
            elif self.registry.remembers(name, target, now):
                rank = 2
            else:
                continue
            if not state.policy.enabled:
                disabled = True
                continue
            ranked.append((rank, name, state, target))
        if not ranked:
            if disabled:
                raise ProviderDisabled()
            raise ModelNotFound(model)
        ranked.sort(key=lambda item: (item[0], item[1]))
        return [(state, target) for _, _, state, target in ranked]

    def routable_models(self) -> dict[str, set[str]]:
        """Models a request could be routed for now, aliases included: model -> providers."""
        out: dict[str, set[str]] = {}
        reserved = self.reserved
        for name, state in self.providers.items():
            if not state.policy.enabled:
                continue
            for model in state.policy.declared_models | state.policy.exclusive_models:
                if reserved.get(model, name) == name:
                    out.setdefault(model, set()).add(name)
        served = self.registry.models()
        for name, models in self.remote_models.items():
            for model in models:
                served.setdefault(model, set()).add(name)
        for model, names in served.items():
            for name in names:
                live = self.providers.get(name)
                if live is not None and live.policy.enabled:
                    out.setdefault(model, set()).add(name)
        for name, state in self.providers.items():
            aliases = {**self.config.aliases, **state.policy.aliases}
            for alias, target in aliases.items():
                if name in out.get(target, ()):
                    out.setdefault(alias, set()).add(name)
        return out

    def queue_depth(self, provider: str | None = None) -> int:
        if provider is not None:
            state = self.providers.get(provider)
            return len(state.queue) if state else 0
        return sum(len(s.queue) for s in self.providers.values())

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
    ) -> RelayRequest:
        """Admit a client request: assign it now, queue it, or raise a RelayError.

        ``ticket`` is the API key's admission (:meth:`relay.core.limits.Limiter.admit`):
        the request owns it once this returns and closes it when it ends; when this
        raises, the caller still owns it.
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
        if self.clustered:
            # Any worker of the cluster: the placement reserves one or queues the
            # request in the shared queue; meanwhile it waits here, deadlines armed.
            self._aim(request, primary, primary_target)
            self.active += 1
            self._enqueue(primary, request, now)
            assert self.placement is not None
            self.placement.place(request)
            return request
        for state, target in candidates:
            worker = self.registry.select(state.policy.name, target, request)
            if worker is not None:
                self._aim(request, state, target)
                self.active += 1
                self._assign(request, worker, now)
                return request
        try:
            primary, primary_target = self._waiting_room(candidates, request)
        except RelayError as exc:
            self.record_rejection(exc, model, endpoint_path, is_streaming, key_id)
            raise
        if len(primary.queue) >= primary.policy.max_queue_len:
            logger.warning("queue full: provider=%s model=%s", primary.policy.name, model)
            full = QueueFull()
            self.record_rejection(full, model, endpoint_path, is_streaming, key_id)
            raise full
        self._aim(request, primary, primary_target)
        self.active += 1
        self._enqueue(primary, request, now)
        return request

    @property
    def clustered(self) -> bool:
        """True while requests are placed across the cluster (see :mod:`relay.core.placement`)."""
        return self.placement is not None and self.placement.active

    def assign_to(self, request: RelayRequest, worker: Worker) -> bool:
        """Give a waiting request the slot the placement reserved for it on ``worker``
        (a local worker, or a stand-in for one on another process). False when the
        request is no longer waiting (it ended meanwhile): the caller releases the slot.
        """
        if request.phase is not Phase.QUEUED:
            return False
        state = self.providers.get(request.provider)
        if state is not None:
            state.queue.remove(request)
        if worker.remote:
            request.relay_role = "origin"
        self._assign(request, worker, self.loop.time())
        return True

    def set_remote_models(self, models: dict[str, frozenset[str]]) -> None:
        """Cluster mode: what the workers of the other processes serve now. A model that
        left is remembered for MODEL_MEMORY_SECS, like a local worker's."""
        now = self.loop.time()
        for provider, before in self.remote_models.items():
            for model in before - models.get(provider, frozenset()):
                if not self.registry.serving(provider, model):
                    self.registry.remember(provider, model, now)
        self.remote_models = models

    def waiting_requests(self) -> list[RelayRequest]:
        """Every request waiting in this process's queues, oldest first per provider."""
        return [request for state in self.providers.values() for request in state.queue]

    def dispatch_waiting(self) -> None:
        """Place what waits here on this process's workers (the cluster is unreachable)."""
        if not self.clustered:
            for state in self.providers.values():
                self._dispatch_queue(state)

    def fail_waiting(self, request: RelayRequest, error: RelayError) -> None:
        """End a waiting request the placement could not queue (the shared queue is full)."""
        if request.phase is not Phase.QUEUED:
            return
        state = self.providers.get(request.provider)
        if state is not None:
            state.queue.remove(request)
        self._finish(request, error)

    def submit_pinned(
        self,
        *,
        worker_id: str,
        lease: str,
        model: str,
        endpoint_path: str,
        flavor: Flavor,
        is_streaming: bool,
        body: str,
        headers: dict[str, str],
        key_id: int | None,
        lifetime: float,
    ) -> RelayRequest:
        """Admit a request another process placed on one of our workers (its slot is
        reserved under ``lease``). Raises :class:`WorkerUnavailable` when that worker can
        no longer take it; the other process then places the request again."""
        worker = self.registry.workers.get(worker_id)
        if worker is None or not worker.attached or worker.draining or self.shutting_down:
            raise WorkerUnavailable(spend=False)
        now = self.loop.time()
        self._seq += 1
        request = RelayRequest(
            id=f"r-{self.instance}-{self._seq:x}",
            seq=self._seq,
            provider=worker.provider,
            model=model,
            endpoint_path=endpoint_path,
            flavor=flavor,
            is_streaming=is_streaming,
            body=body,
            headers=headers,
            key_id=key_id,
            created_wall=time.time(),
            now=now,
            deadline=now + lifetime,
        )
        if worker.refuses is not None and worker.refuses(request) is not None:
            raise WorkerUnavailable(spend=False)  # (the placing process checks this first)
        request.lease = lease
        request.relay_role = "worker"
        self.active += 1
        self._assign(request, worker, now)
        return request

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

    def _aim(self, request: RelayRequest, state: ProviderState, target: str) -> None:
        """Route ``request`` to ``state``'s provider as model ``target``.

        When an alias applied, the body the worker gets names the backend's model;
        otherwise the client's raw body goes through untouched.
        """
        request.provider = state.policy.name
        if target != request.model:
            request.model = target
            request.body = rewrite_model(request.body, target)

    def _waiting_room(
        self, candidates: list[tuple[ProviderState, str]], request: RelayRequest
    ) -> tuple[ProviderState, str]:
        """The provider whose queue ``request`` waits in when no worker is free now.

        The best-ranked provider that has a connected worker willing to take it, or
        none connected at all (one may come back). When every connected worker of
        every candidate refuses it (a model served only by legacy nodes, a request
        they cannot express), waiting would only end in a timeout: refused now, 400.
        """
        refusal: str | None = None
        for state, target in candidates:
            workers = self.registry.serving_workers(state.policy.name, target)
            if not workers:
                return state, target
            for worker in workers:
                why = worker.refuses(request) if worker.refuses is not None else None
                if why is None:
                    return state, target
                refusal = refusal or why
        raise BadRequest(refusal or "No worker here can take this request")

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
        state.queue.push(request)
        self._arm(request, request.queue_deadline)

    def _assign(self, request: RelayRequest, worker: Worker, now: float) -> None:
        if request.enqueued_at is not None:
            request.queue_wait += now - request.enqueued_at
            request.enqueued_at = None
        request.phase = Phase.ASSIGNED
        request.worker = worker
        request.worker_id = worker.id
        request.worker_name = worker.name
        worker.in_flight[request.id] = request
        worker.link.send(
            protocol.Request(
                request_id=request.id,
                model=request.model,
                endpoint_path=request.endpoint_path,
                is_streaming=request.is_streaming,
                body=request.body,
                headers=request.headers,
            )
        )
        logger.debug("request dispatched: %s -> %s (%s)", request.id, worker.name, worker.id)
        self._arm(request, request.deadline)

    def _abandon(self, request: RelayRequest, reason: CancelReason) -> None:
        """Take an assigned request away from its worker and tell the worker."""
        worker = request.worker
        if worker is None:
            return
        worker.in_flight.pop(request.id, None)
        request.worker = None
        if worker.attached:
            if reason not in protocol.BASE_CANCEL_REASONS and not worker.features:
                reason = "client_disconnect"  # the nearest reason every worker knows
            worker.link.send(protocol.Cancel(request_id=request.id, reason=reason))
            self.stats.cancels[reason] += 1
            self._freed(worker, request.lease)

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
            if request.queue_deadline < request.deadline:
                logger.info("queue timeout: %s model=%s", request.id, request.model)
                self._finish(request, QueueTimeout())
            else:
                self._finish(request, RequestTimeout())
        elif request.phase is Phase.ASSIGNED:
            logger.info("request timeout: %s on %s", request.id, request.worker_name)
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

    # ------------------------------------------------------------------ worker loss

    def detach_worker(self, worker: Worker, reason: str) -> None:
        """The worker is gone: requeue what can be, fail the rest. Idempotent."""
        if not worker.attached:
            return
        self.registry.remove(worker, self.loop.time())
        if self.placement is not None:
            self.placement.worker_gone(worker)
        timer = self._drain_timers.pop(worker.id, None)
        if timer is not None:
            timer.cancel()
        logger.info("worker disconnected: %s (%s): %s", worker.name, worker.id, reason)
        orphans = sorted(worker.in_flight.values(), key=lambda r: r.seq)
        worker.in_flight.clear()
        touched: set[str] = set()
        for request in orphans:
            request.worker = None
            if self._requeue(request):
                touched.add(request.provider)
        for name in touched:
            self._dispatch_provider(name)

    def _requeue(self, request: RelayRequest, *, spend: bool = True) -> bool:
        """Put a request that lost its worker back at the front of its queue, or fail it.

        ``spend=False`` when the worker refused it unstarted (it was shutting down):
        that attempt does not count against MAX_REQUEUE_COUNT.
        """
        now = self.loop.time()
        state = self.providers.get(request.provider)
        if request.relay_role == "worker":
            # Placed here by another process: that process owns the request and puts
            # it back in the queue (or ends its stream) when told.
            self._finish(request, WorkerLost() if request.delivered else WorkerUnavailable(spend))
        elif request.delivered:
            # Bytes already reached the client: replaying would duplicate output.
            self._finish(request, WorkerLost())
        elif state is None:
            self._finish(request, ProviderGone())
        elif not state.policy.enabled:
            self._finish(request, ProviderDisabled())
        elif self.shutting_down:
            self._finish(request, ShuttingDown())
        elif spend and request.requeues >= self.config.max_requeue_count:
            logger.warning("requeue exhausted: %s after %d attempts", request.id, request.requeues)
            self._finish(request, RequeueExhausted())
        elif now >= request.deadline:
            self._finish(request, RequestTimeout())
        else:
            if spend:
                request.requeues += 1
                self.stats.requeues += 1
            request.buffer.clear()
            request.streamed_bytes = 0
            logger.info("request requeued: %s (requeue %d)", request.id, request.requeues)
            request.lease = None
            self._enqueue(state, request, now)
            if self.clustered:
                assert self.placement is not None
                self.placement.place(request)
                return False  # placed by the placement, not by a local dispatch
            return True
        return False

    def close_worker(self, worker: Worker, code: int, reason: str) -> None:
        """Close a worker's socket and handle it as gone, right now."""
        if not worker.attached:
            return
        worker.link.close(code, reason)
        self.detach_worker(worker, reason)

    # ------------------------------------------------------------------ capacity

    def _freed(self, worker: Worker, lease: str | None = None) -> None:
        """A slot on ``worker`` may have opened (the request holding ``lease`` just left
        it): close the worker if drained, else feed it — from the shared queue in
        cluster mode."""
        if worker.remote or not worker.attached:
            return  # a stand-in's slots are the owning process's to free
        placement = self.placement if self.clustered else None
        if placement is not None:
            placement.freed(worker, lease)  # releases the lease; no new work if draining
        if worker.draining:
            if not worker.in_flight:
                self.close_worker(worker, 1000, "worker drained")
            return
        if placement is None:
            self._feed(worker)

    def _feed(self, worker: Worker) -> None:
        """Hand queued requests to ``worker`` while it has room, in the queue's order
        (requeued first, then keys by turn, the oldest compatible within a key)."""
        state = self.providers.get(worker.provider)
        if state is None or not state.queue:
            return
        now = self.loop.time()
        while worker.has_capacity:
            request = state.queue.pop_for(worker.model_set, worker.refuses)
            if request is None:
                return
            self._assign(request, worker, now)

    def _dispatch_provider(self, name: str) -> None:
        state = self.providers.get(name)
        if state is not None:
            self._dispatch_queue(state)

    def _dispatch_queue(self, state: ProviderState) -> None:
        """Place queued requests on any worker with room (after requeues)."""
        now = self.loop.time()
        for request in state.queue:
            worker = self.registry.select(state.policy.name, request.model, request)
            if worker is not None:
                state.queue.remove(request)
                self._assign(request, worker, now)

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop admitting, let in-flight and queued work finish, then close workers 1012."""
        self.shutting_down = True
        grace = self.config.shutdown_grace if grace is None else grace
        if self.active > 0:
            self._idle.clear()
            try:
                async with asyncio.timeout(grace):
                    await self._idle.wait()
            except TimeoutError:
                logger.warning("shutdown grace over with %d request(s) unfinished", self.active)
        for state in self.providers.values():
            for request in state.queue.drain():
                self._finish(request, ShuttingDown())
        for worker in list(self.registry.workers.values()):
            self.close_worker(worker, 1012, "server restarting")
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the core's own tasks and timers (tests, shutdown)."""
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for timer in self._drain_timers.values():
            timer.cancel()
        self._drain_timers.clear()
