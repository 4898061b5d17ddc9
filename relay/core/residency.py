"""Models on demand (SPEC §19): which model is loaded on which worker, decided here.

A worker whose backend holds more models on disk than in memory (llama-server's
router, llama-swap, Ollama, vLLM asleep or with LoRA adapters) announces the
``model_states`` extension: each acked model's state and how many models its backend
holds at once. The registry routes it only the models it has loaded; this module
decides the rest, one process's workers at a time (cluster mode places loads through
:mod:`relay.server.cluster` with the same rules):

- A request queued for a model no worker has loaded causes exactly one load (single
  flight per provider and model): on a worker holding it with a free model slot (one
  where it sleeps first: waking is faster), else on one whose least recently used
  loaded model has nothing in flight or queued, which is unloaded first. The request
  waits in its queue for up to MODEL_LOAD_TIMEOUT_SECS (then 504); a failed load is
  tried once on each other worker holding the model, then the waiting requests get 503.
- A model with requests in flight or queued is never unloaded by the relay.
- A model loaded somewhere whose queue keeps waiting past MODEL_SCALE_OUT_WAIT_SECS
  gets a second copy on a worker with a free model slot; a model idle for
  MODEL_IDLE_UNLOAD_SECS is unloaded (the worker puts it to sleep where its backend
  sleeps).
- A backend that changes a state by itself (another client loaded a model, an operator
  unloaded one, it evicted one) is simply followed: its ``model_states`` frame is the
  truth, and what waits for a model it dropped gets it loaded again.

Where a load goes and what makes room are plain functions of the workers' states
(:mod:`relay.core.modelplan`). Decisions converge rather than rely on every notice:
:meth:`Residency._reconcile` runs on every state change, answer and freed slot, and
once per tick of :mod:`relay.core.upkeep` (which also scales out, unloads idle models
and forgets operations never answered within MODEL_LOAD_TIMEOUT_SECS). Operations are
bounded: at most one per worker and model at a time.

:class:`Residency` is a base of :class:`relay.core.dispatch.Dispatcher`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from relay.core.config import RelayConfig
from relay.core.modelplan import (
    Episode,
    busy_with,
    counts,
    idle_model,
    load_target,
    resident,
    sanitize_states,
)
from relay.core.registry import Registry
from relay.core.state import Completion, ModelOp, Phase, RelayRequest, Worker
from relay.core.stats import RelayStats
from relay.wire import protocol
from relay.wire.errors import ModelLoadFailed, RelayError
from relay.wire.protocol import LOADED, LOADING

if TYPE_CHECKING:
    from relay.core.placement import Placement
    from relay.core.providers import ProviderState

logger = logging.getLogger("relay")

_op_ids = itertools.count(1)


class Residency:
    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        placement: Placement | None
        stats: RelayStats
        remote_models: dict[str, frozenset[str]]
        remote_loaded: dict[str, frozenset[str]]

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

        def _offer(self, worker: Worker) -> None: ...

        def _arm(self, request: RelayRequest, when: float) -> None: ...

        def _ensure_residency(self) -> None: ...

        def _has_states(self) -> bool: ...

    #: (provider, model) -> the load its waiting requests are waiting for.
    _episodes: dict[tuple[str, str], Episode]
    _residency_task: asyncio.Task[None] | None

    def _init_residency(self) -> None:
        self._episodes = {}
        self._residency_task = None

    # ------------------------------------------------------------ from the workers

    def take_states(
        self,
        worker: Worker,
        states: Iterable[protocol.ModelState],
        model_capacity: int | None,
        max_concurrent: int | None = None,
    ) -> None:
        """A worker's ``register`` or ``model_states``: every acked model's state now.

        Called before the worker is in the registry (at register) or after (a change).
        Whatever a state change makes possible happens before this returns: queued
        requests go to a model that is loaded now, a load whose model arrived ends.
        """
        now = self.loop.time()
        new = sanitize_states(worker, states)
        if model_capacity is not None:
            worker.model_capacity = model_capacity
        if max_concurrent is not None:
            worker.max_concurrent = min(max_concurrent, self.config.max_concurrent_cap)
        old = worker.states or {}
        for model, state in new.items():
            if state == LOADED and old.get(model) != LOADED:
                worker.used.setdefault(model, now)  # idle time counts from the load
        for model in [m for m in worker.used if new.get(m) != LOADED]:
            del worker.used[model]
        if self.registry.workers.get(worker.id) is worker:
            self.registry.set_states(worker, new, now)
        else:
            worker.states = new  # not routed yet: the registry indexes it when added
            return
        for model, state in new.items():
            if state == LOADED and old.get(model) != LOADED:
                self._arrived(worker, model, now)
        self._offer(worker)
        self._reconcile()
        self._ensure_residency()

    def on_model_result(self, worker: Worker, message: protocol.ModelResult) -> None:
        """The answer to one of our ``model_load`` / ``model_unload``."""
        op = worker.ops.get(message.op_id)
        if op is None or op.model != message.model or op.kind != message.op:
            logger.info(
                "worker %s: answer to an unknown model operation %s dropped",
                worker.name,
                message.op_id[:64],
            )
            return
        now = self.loop.time()
        took = now - op.started
        record = counts(worker, op.model)
        states = worker.states
        if (
            message.ok
            and message.state
            and states is not None
            and (states.get(op.model) != message.state)
        ):
            # (The operation is still pending meanwhile: nothing decided here repeats it.)
            self.take_states(worker, self._listed({**states, op.model: message.state}), None)
        worker.ops.pop(message.op_id, None)
        if op.kind == "load":
            if message.ok:
                logger.info(
                    "worker %s loaded %s in %.2fs (%s)", worker.name, op.model, took, op.reason
                )
                if not op.counted:
                    self._count_load(worker, op, now)
                self._episodes.pop((worker.provider, op.model), None)
                self._load_ended(worker, op, ok=True)
            else:
                record.load_failures += 1
                self.stats.model_load_failures += 1
                logger.warning(
                    "worker %s could not load %s: %s",
                    worker.name,
                    op.model,
                    (message.error or "no reason given")[:300],
                )
                episode = self._episodes.get((worker.provider, op.model))
                if episode is not None and episode.worker_id == worker.id:
                    episode.worker_id = None
                    episode.tried.add(worker.id)
                self._load_ended(worker, op, ok=False)
        else:
            if message.ok:
                record.unloads += 1
                self.stats.model_unloads += 1
                logger.info(
                    "worker %s unloaded %s in %.2fs (%s)", worker.name, op.model, took, op.reason
                )
                if op.then is not None:
                    self._send_op(worker, "load", op.then, "demand", cluster=op.cluster)
                    return
            else:
                logger.warning(
                    "worker %s could not unload %s: %s",
                    worker.name,
                    op.model,
                    (message.error or "no reason given")[:300],
                )
                if op.then is not None:
                    episode = self._episodes.get((worker.provider, op.then))
                    if episode is not None and episode.worker_id == worker.id:
                        episode.worker_id = None
                        episode.tried.add(worker.id)
                    self._load_ended(worker, op, ok=False)
        self._reconcile()

    def _forget_worker_models(self, worker: Worker) -> None:
        """``worker`` left: a load it was doing is someone else's to do now."""
        for op in worker.ops.values():
            if op.kind == "load" or op.then is not None:
                self._load_ended(worker, op, ok=False)
        worker.ops.clear()
        touched = False
        for episode in self._episodes.values():
            if episode.worker_id == worker.id:
                episode.worker_id = None
                touched = True
        if touched:
            self._reconcile()

    # ------------------------------------------------------------ from the requests

    def _await_model(self, state: ProviderState, request: RelayRequest) -> None:
        """``request`` was just queued: if its model is loaded nowhere but a worker
        here holds it, it waits for a load (one for all of them) within
        MODEL_LOAD_TIMEOUT_SECS rather than QUEUE_TIMEOUT_SECS."""
        provider = state.policy.name
        if self._loaded_anywhere(provider, request.model) or not self._held_anywhere(
            provider, request.model
        ):
            return
        self._reconcile_model(provider, request.model, self.loop.time())

    def _loaded_anywhere(self, provider: str, model: str) -> bool:
        """A worker here, or (cluster mode) of another process, has ``model`` loaded."""
        return self.registry.loaded(provider, model) or (
            self.placement is not None and model in self.remote_loaded.get(provider, ())
        )

    def _held_anywhere(self, provider: str, model: str) -> bool:
        """A worker here, or (cluster mode) of another process, serves ``model``,
        loaded there or not."""
        return self.registry.serving(provider, model) or (
            self.placement is not None and model in self.remote_models.get(provider, ())
        )

    def _wait_for_load(self, request: RelayRequest) -> None:
        if request.awaits_load or request.phase is not Phase.QUEUED:
            return
        request.awaits_load = True
        self.stats.model_load_waits += 1
        self._ensure_residency()
        started = request.enqueued_at if request.enqueued_at is not None else self.loop.time()
        deadline = min(started + self.config.model_load_timeout, request.deadline)
        if request.start_by:  # (no load is waited for past a first-token deadline)
            deadline = min(deadline, request.start_by)
        if deadline > request.queue_deadline:
            request.queue_deadline = deadline
            self._arm(request, deadline)

    def _took(self, worker: Worker, request: RelayRequest, now: float) -> None:
        """``worker`` (which reports states) takes ``request``: its model was used now."""
        worker.used[request.model] = now
        if request.awaits_load:
            counts(worker, request.model).waited += 1

    def _used(self, worker: Worker, model: str, now: float) -> None:
        """``worker`` finished a request for ``model`` (least recently used)."""
        if worker.states is not None:
            worker.used[model] = now

    # ------------------------------------------------------------ the decisions

    def _reconcile(self) -> None:
        """Every model that requests wait for and no worker has loaded gets a load."""
        if not self._episodes and not self._has_states() and not self.clustered:
            return
        now = self.loop.time()
        for name, state in self.providers.items():
            if not state.queue:
                continue
            for model in {r.model for r in state.queue}:
                if not self._loaded_anywhere(name, model) and self._held_anywhere(name, model):
                    self._reconcile_model(name, model, now)
        for key in [k for k in self._episodes if self.registry.loaded(*k)]:
            del self._episodes[key]

    def _reconcile_model(self, provider: str, model: str, now: float) -> None:
        """One load for ``model``'s waiting requests, unless one is on its way; they
        wait for it within MODEL_LOAD_TIMEOUT_SECS. In cluster mode the cluster chooses
        where, once for every process (:meth:`Placement.want_model`)."""
        if self._loaded_anywhere(provider, model):
            self._episodes.pop((provider, model), None)
            return
        state = self.providers.get(provider)
        if state is not None:
            for request in state.queue:
                if request.model == model:
                    self._wait_for_load(request)
        if self.clustered:
            assert self.placement is not None
            self.placement.want_model(provider, model)
            return
        episode = self._episodes.setdefault((provider, model), Episode())
        if episode.worker_id is not None:
            worker = self.registry.workers.get(episode.worker_id)
            if worker is not None and busy_with(worker, model):
                return
            episode.worker_id = None  # its worker left, or its operation timed out
        for worker in self.registry.holders(provider, model):
            if (worker.states or {}).get(model) == LOADING and worker.id not in episode.tried:
                episode.worker_id = worker.id  # its backend loads it already
                return
        target = load_target(
            self.registry.holders(provider, model),
            model,
            episode.tried,
            self._queued_models(provider),
        )
        if target is not None:
            worker, victim = target
            episode.worker_id = worker.id
            if victim is None:
                self._send_op(worker, "load", model, "demand")
            else:
                self._send_op(worker, "unload", victim, "evict", then=model)
            return
        untried = [w for w in self.registry.holders(provider, model) if w.id not in episode.tried]
        if not untried:
            self._fail_waiting(provider, model)

    def _queued_models(self, provider: str) -> set[str]:
        """The models requests wait for in ``provider``'s queue here."""
        state = self.providers.get(provider)
        if state is None or not state.queue:
            return set()
        return {r.model for r in state.queue}

    def _send_op(
        self,
        worker: Worker,
        kind: Literal["load", "unload"],
        model: str,
        reason: str,
        *,
        then: str | None = None,
        cluster: bool = False,
    ) -> None:
        op_id = f"m-{next(_op_ids):x}"
        worker.ops[op_id] = ModelOp(
            op_id, kind, model, self.loop.time(), reason, then, cluster=cluster
        )
        message: protocol.ModelLoad | protocol.ModelUnload
        if kind == "load":
            message = protocol.ModelLoad(model=model, op_id=op_id)
        else:
            message = protocol.ModelUnload(model=model, op_id=op_id)
        logger.info(
            "%s %s on worker %s (%s%s)",
            "loading" if kind == "load" else "unloading",
            model,
            worker.name,
            reason,
            f", to load {then}" if then else "",
        )
        worker.link.send(message)
        self._ensure_residency()

    def _arrived(self, worker: Worker, model: str, now: float) -> None:
        """``model`` is loaded on ``worker`` now: a load of ours is counted (its answer
        may still come) and what waited for it is no longer waiting for a load."""
        for op in worker.ops.values():
            if op.kind == "load" and op.model == model and not op.counted:
                self._count_load(worker, op, now)
        self._episodes.pop((worker.provider, model), None)

    def _count_load(self, worker: Worker, op: ModelOp, now: float) -> None:
        op.counted = True
        record = counts(worker, op.model)
        record.loads += 1
        record.load_secs += now - op.started
        record.last_load_secs = now - op.started
        self.stats.model_loads += 1

    def _load_ended(self, worker: Worker, op: ModelOp, *, ok: bool) -> None:
        """A load the cluster chose ``worker`` for ended (or the unload before it failed):
        the cluster's lock on it goes, so the next choice can be made."""
        if op.cluster and self.placement is not None:
            self.placement.load_done(worker.provider, op.then or op.model, worker.id, ok)

    def cluster_load(self, worker_id: str, provider: str, model: str, victim: str) -> bool:
        """Cluster mode: the cluster chose ``worker_id`` (connected here) to load
        ``model``, unloading ``victim`` first when it is not empty. False when it cannot
        (gone, draining, the victim busy by now): the caller reports that back."""
        worker = self.registry.workers.get(worker_id)
        if worker is None or worker.draining or worker.provider != provider:
            return False
        if model not in worker.models or busy_with(worker, model):
            return False
        if victim:
            if victim != self.idle_model(worker):
                return False  # used again meanwhile: the cluster chooses again
            self._send_op(worker, "unload", victim, "evict", then=model, cluster=True)
        else:
            self._send_op(worker, "load", model, "demand", cluster=True)
        return True

    def unload_idle(self, worker_id: str, model: str) -> None:
        """Cluster mode: nothing waits for ``model`` anywhere; unload it from the local
        worker ``worker_id`` if it is still that worker's idle model past the bound."""
        worker = self.registry.workers.get(worker_id)
        if worker is None or worker.draining or self.idle_model(worker) != model:
            return
        if (
            self.loop.time() - worker.used.get(model, self.loop.time())
            < self.config.model_idle_unload
        ):
            return
        self._send_op(worker, "unload", model, "idle")

    def fail_model_waiters(self, provider: str, model: str) -> None:
        """Every worker holding ``model`` failed to load it lately (cluster mode: the
        cluster said so): what waits here for it fails with 503."""
        self._fail_waiting(provider, model)

    def resident_count(self, worker: Worker) -> int:
        """How many of ``worker``'s models are loaded or loading (its model slots used)."""
        return resident(worker)

    def idle_model(self, worker: Worker) -> str | None:
        """The model ``worker`` could unload to make room, nothing running or waiting
        for it here (:func:`relay.core.modelplan.idle_model`)."""
        return idle_model(worker, self._queued_models(worker.provider))

    def _fail_waiting(self, provider: str, model: str) -> None:
        """Every worker holding ``model`` failed to load it: what waits for it fails."""
        self._episodes.pop((provider, model), None)
        state = self.providers.get(provider)
        if state is None:
            return
        for request in [r for r in state.queue if r.model == model and r.awaits_load]:
            state.queue.remove(request)
            self._finish(request, ModelLoadFailed(model))

    @staticmethod
    def _listed(states: dict[str, str]) -> list[protocol.ModelState]:
        return [protocol.ModelState(model=m, state=s) for m, s in states.items()]
