"""What the dispatcher does when a worker goes away or a slot frees: requeue, feed the
queue, close drained workers, shut down.

:class:`Capacity` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from relay.core.affinity import Router
from relay.core.config import RelayConfig
from relay.core.rates import Rates
from relay.core.registry import Registry
from relay.core.state import Completion, RelayRequest, Worker
from relay.core.stats import RelayStats
from relay.wire.errors import (
    ProviderDisabled,
    ProviderGone,
    RelayError,
    RequestTimeout,
    RequeueExhausted,
    ShuttingDown,
    WorkerLost,
    WorkerUnavailable,
)

if TYPE_CHECKING:
    from relay.core.placement import Placement
    from relay.core.providers import ProviderState

logger = logging.getLogger("relay")


class Capacity:
    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        placement: Placement | None
        stats: RelayStats
        router: Router
        rates: Rates
        shutting_down: bool
        active: int
        _idle: asyncio.Event
        _heartbeat_task: asyncio.Task[None] | None
        _residency_task: asyncio.Task[None] | None
        _drain_timers: dict[str, asyncio.TimerHandle]

        @property
        def clustered(self) -> bool: ...

        def _finish(
            self,
            request: RelayRequest,
            result: Completion | RelayError | object,
            *,
            outcome: str | None = None,
            cancel_reason: str | None = None,
        ) -> None: ...

        def _assign(self, request: RelayRequest, worker: Worker, now: float) -> None: ...

        def _select(self, provider: str, model: str, request: RelayRequest) -> Worker | None: ...

        def _enqueue(self, state: ProviderState, request: RelayRequest, now: float) -> None: ...

        def _forget_worker_models(self, worker: Worker) -> None: ...

        def _reconcile(self) -> None: ...

        def _await_model(self, state: ProviderState, request: RelayRequest) -> None: ...

        def _attempt_failed(self, request: RelayRequest, worker: Worker) -> bool: ...

    def detach_worker(self, worker: Worker, reason: str) -> None:
        """The worker is gone: requeue what can be, fail the rest. Idempotent."""
        if not worker.attached:
            return
        self.registry.remove(worker, self.loop.time())
        self.router.forget_worker(worker.id)
        self.rates.forget(worker)
        if worker.states is not None:
            self._forget_worker_models(worker)
        if self.placement is not None:
            self.placement.worker_gone(worker)
        timer = self._drain_timers.pop(worker.id, None)
        if timer is not None:
            timer.cancel()
        logger.info("worker disconnected: %s (%s): %s", worker.name, worker.id, reason)
        orphans = sorted(worker.in_flight.values(), key=lambda r: r.seq)
        worker.in_flight.clear()
        worker.light = 0
        touched: set[str] = set()
        for request in orphans:
            if request.hedge is not None and self._attempt_failed(request, worker):
                continue  # its other attempt goes on
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
            logger.warning(
                "requeue exhausted: %s after %d attempts",
                request.id,
                request.requeues,
                extra={"request_id": request.id},
            )
            self._finish(request, RequeueExhausted())
        elif now >= request.deadline:
            self._finish(request, RequestTimeout())
        else:
            if spend:
                request.requeues += 1
                self.stats.requeues += 1
            request.buffer.clear()
            request.streamed_bytes = 0
            logger.info(
                "request requeued: %s (requeue %d)",
                request.id,
                request.requeues,
                extra={"request_id": request.id},
            )
            request.lease = None
            self._enqueue(state, request, now)
            if self.clustered:
                assert self.placement is not None
                self.placement.place(request)
                return False  # placed by the placement, not by a local dispatch
            self._await_model(state, request)
            return True
        return False

    def close_worker(self, worker: Worker, code: int, reason: str) -> None:
        """Close a worker's socket and handle it as gone, right now."""
        if not worker.attached:
            return
        worker.link.close(code, reason)
        self.detach_worker(worker, reason)

    # ------------------------------------------------------------------ capacity

    def _freed(self, worker: Worker, lease: str | None = None, *, light: bool = False) -> None:
        """A slot on ``worker`` may have opened (the request holding ``lease`` just left
        it): close the worker if drained, else feed it — from the shared queue in
        cluster mode. ``light``: the request that left took no generation slot."""
        if worker.remote or not worker.attached:
            return  # a stand-in's slots are the owning process's to free
        if light:
            if worker.draining and not worker.in_flight:
                self.close_worker(worker, 1000, "worker drained")
            return
        if self.placement is not None:
            # Releases the lease (or, while the cluster cannot be reached, remembers to);
            # no new work for a draining worker.
            self.placement.freed(worker, lease)
        if worker.draining:
            if not worker.in_flight:
                self.close_worker(worker, 1000, "worker drained")
            return
        if not self.clustered:
            self._feed(worker)
            if worker.states is not None:
                self._reconcile()  # an idle model may make room for a waiting one

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
            worker = self._select(state.policy.name, request.model, request)
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
        tasks = [self._heartbeat_task, self._residency_task]
        self._heartbeat_task = self._residency_task = None
        for task in tasks:
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for timer in self._drain_timers.values():
            timer.cancel()
        self._drain_timers.clear()
