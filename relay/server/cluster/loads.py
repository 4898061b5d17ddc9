"""Models on demand across processes (SPEC §19): one load per model, cluster-wide.

:class:`ClusterLoads` is a base of :class:`relay.server.cluster.placement.RedisPlacement`.
Each process announces its workers' loaded models (the ones routed to them) apart from
those they hold without having them loaded, with their model slots and the model each
could unload (:mod:`relay.server.cluster.convergence`). When requests wait for a model
loaded nowhere, the process they wait at asks the cluster
(:data:`relay.server.cluster.scripts.WANT`): one atomic script picks the worker of any
process (a free model slot first, else one whose idle model nothing waits for), takes
the model's lock and records the load for that worker's process, which starts it
(:meth:`relay.core.residency.Residency.cluster_load`) on the notice on its channel or,
if that was lost, at its next tick. The lock lasts until the worker reports back or
MODEL_LOAD_TIMEOUT_SECS passes; a worker whose load failed is passed over for as long;
when every live worker holding the model failed, the waiting requests get 503.

A second copy for a model whose queue keeps waiting is asked the same way (free model
slots only), and a model that sat idle is unloaded only once the shared queue holds
nothing for it.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from relay.core.relay import Relay
from relay.core.state import Worker
from relay.server.cluster.convergence import now_ms
from relay.server.cluster.state import ClusterState

logger = logging.getLogger("relay.cluster")


class ClusterLoads:
    if TYPE_CHECKING:  # provided by the placement
        relay: Relay
        state: ClusterState
        instance: str

        @property
        def active(self) -> bool: ...

        def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    def _init_loads(self) -> None:
        #: (provider, model, scale-out) asked of the cluster and not answered yet.
        self._wanting: set[tuple[str, str, bool]] = set()
        #: (worker, model) whose idle unload waits for the shared queue's word.
        self._idle_checks: set[tuple[str, str]] = set()

    @property
    def _lock_ms(self) -> int:
        return max(1, int(self.relay.config.model_load_timeout * 1000))

    # -- the Placement protocol ------------------------------------------------------

    def want_model(self, provider: str, model: str, *, scale: bool = False) -> None:
        key = (provider, model, scale)
        if not self.active or key in self._wanting:
            return
        self._wanting.add(key)
        self._spawn(self._want(key))

    def load_done(self, provider: str, model: str, worker_id: str, ok: bool) -> None:
        self._spawn(self.state.load_done(provider, model, worker_id, ok, self._lock_ms))

    def unload_if_unwanted(self, worker: Worker, model: str) -> None:
        key = (worker.id, model)
        if not self.active or key in self._idle_checks:
            return
        self._idle_checks.add(key)
        self._spawn(self._unload_if_unwanted(worker.id, worker.provider, model))

    # -- the work behind it ----------------------------------------------------------

    async def _want(self, key: tuple[str, str, bool]) -> None:
        provider, model, scale = key
        try:
            verdict, worker_id, owner = await self.state.want(
                provider, model, self._lock_ms, now_ms(), scale=scale
            )
        finally:
            self._wanting.discard(key)
        if verdict == "sent":
            logger.info(
                "cluster: %s of %s goes to worker %s (process %s)",
                "a second copy" if scale else "the load",
                model,
                worker_id,
                owner,
            )
            if owner == self.instance:
                await self._take_ops()
        elif verdict == "failed":
            logger.warning("cluster: every worker holding %s failed to load it", model)
            self.relay.fail_model_waiters(provider, model)

    async def _take_ops(self) -> None:
        """Start the loads the cluster chose this process's workers for."""
        for provider, model, worker_id, victim, _scale in await self.state.take_ops(self.instance):
            if not self.relay.cluster_load(worker_id, provider, model, victim):
                logger.info(
                    "cluster: worker %s cannot load %s now; the cluster chooses again",
                    worker_id,
                    model,
                )
                await self.state.load_done(provider, model, worker_id, None, self._lock_ms)

    async def _unload_if_unwanted(self, worker_id: str, provider: str, model: str) -> None:
        try:
            waiting = await self.state.queued(provider, model)
        finally:
            self._idle_checks.discard((worker_id, model))
        if waiting == 0:
            self.relay.unload_idle(worker_id, model)

    async def _loads_tick(self) -> None:
        """Every tick: loads recorded for this process whose notice was lost, and a load
        asked again for each model what waits here still waits for."""
        await self._take_ops()
        asked: set[tuple[str, str]] = set()
        for request in self.relay.waiting_requests():
            key = (request.provider, request.model)
            if request.awaits_load and key not in asked:
                asked.add(key)
                if not self.relay.registry.loaded(*key):
                    self.want_model(*key)
