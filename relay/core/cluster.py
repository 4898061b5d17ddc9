"""The dispatcher's side of cluster mode (SPEC §11): requests placed on workers of any
process by a :class:`relay.core.placement.Placement`, and requests other processes
placed on this process's workers.

:class:`ClusterSide` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from relay.core.config import RelayConfig
from relay.core.prediction import prompt_bytes
from relay.core.registry import Registry
from relay.core.state import Completion, Phase, RelayRequest, Worker
from relay.wire.errors import Flavor, RelayError, WorkerUnavailable

if TYPE_CHECKING:
    from relay.core.affinity import Prompt
    from relay.core.placement import Placement
    from relay.core.providers import ProviderState


class ClusterSide:
    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        placement: Placement | None
        remote_models: dict[str, frozenset[str]]
        remote_loaded: dict[str, frozenset[str]]
        shutting_down: bool
        active: int
        instance: str
        _seq: int

        def _finish(
            self,
            request: RelayRequest,
            result: Completion | RelayError | object,
            *,
            outcome: str | None = None,
            cancel_reason: str | None = None,
        ) -> None: ...

        def _assign(self, request: RelayRequest, worker: Worker, now: float) -> None: ...

        def _dispatch_queue(self, state: ProviderState) -> None: ...

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
        # (Reset on each placement: one placed elsewhere, then requeued and placed
        # here, is this process's to serve, and its resumable log's to write.)
        request.relay_role = "origin" if worker.remote else ""
        self._assign(request, worker, self.loop.time())
        return True

    @staticmethod
    def full(worker: Worker) -> bool:
        """Whether every slot of a local worker is taken by a request this process runs
        on it (the count the shared reservations must never fall below)."""
        return len(worker.in_flight) - worker.light >= worker.max_concurrent

    def set_remote_models(
        self,
        models: dict[str, frozenset[str]],
        loaded: dict[str, frozenset[str]] | None = None,
    ) -> None:
        """Cluster mode: what the workers of the other processes serve now (``loaded``:
        the part of it they have loaded, models on demand; None: unchanged). A model
        that left is remembered for MODEL_MEMORY_SECS, like a local worker's."""
        now = self.loop.time()
        for provider, before in self.remote_models.items():
            for model in before - models.get(provider, frozenset()):
                if not self.registry.serving(provider, model):
                    self.registry.remember(provider, model, now)
        self.remote_models = models
        if loaded is not None:
            self.remote_loaded = loaded

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
        service_class: str = "default",
        preemptions: int = 0,
        trace: object = None,
        prompt: Prompt | None = None,
    ) -> RelayRequest:
        """Admit a request another process placed on one of our workers (its slot is
        reserved under ``lease``). Raises :class:`WorkerUnavailable` when that worker can
        no longer take it; the other process then places the request again.

        Capacity is checked here too, whatever the shared reservations said: after Redis
        lost some of them, a worker could otherwise be handed more than it holds."""
        worker = self.registry.workers.get(worker_id)
        if worker is None or not worker.attached or worker.draining or self.shutting_down:
            raise WorkerUnavailable(spend=False)
        if self.full(worker):
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
        if model not in worker.model_set:
            # Models on demand: unloaded since the placing process chose it.
            raise WorkerUnavailable(spend=False)
        request.lease = lease
        request.trace = trace
        request.relay_role = "worker"
        request.service_class = service_class  # (for the request log written here)
        request.preemptions = preemptions
        request.prompt_bytes = prompt_bytes(prompt, body)  # (what its prediction here reads)
        self.active += 1
        self._assign(request, worker, now)
        return request
