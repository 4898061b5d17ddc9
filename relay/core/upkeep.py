"""Models on demand (SPEC §19): the periodic pass that keeps residency true.

:class:`ModelUpkeep` is a base of :class:`relay.core.dispatch.Dispatcher`, beside
:class:`relay.core.residency.Residency`, whose decisions it re-runs: once per tick while
a worker reports states (or requests wait for a load), it forgets operations a worker
never answered within MODEL_LOAD_TIMEOUT_SECS, loads a second copy of a loaded model
whose queue kept waiting past MODEL_SCALE_OUT_WAIT_SECS (on a free model slot only),
unloads what sat idle MODEL_IDLE_UNLOAD_SECS, and reconciles (a load for what waits).
Also the read-only views of residency the edges show.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Literal

from relay.core.config import RelayConfig
from relay.core.modelplan import Episode, busy_with, counts, idle_model, load_target
from relay.core.registry import Registry
from relay.core.state import Worker
from relay.core.stats import RelayStats
from relay.wire.protocol import LOADABLE, LOADED, LOADING, SLEEPING

if TYPE_CHECKING:
    from relay.core.placement import Placement
    from relay.core.providers import ProviderState
    from relay.core.state import ModelOp

logger = logging.getLogger("relay")

#: The longest pause between two passes while a worker reports states.
MAX_TICK_SECS = 1.0


class ModelUpkeep:
    if TYPE_CHECKING:  # provided by the dispatcher and Residency
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        placement: Placement | None
        stats: RelayStats
        _episodes: dict[tuple[str, str], Episode]
        _residency_task: asyncio.Task[None] | None

        @property
        def clustered(self) -> bool: ...

        def _reconcile(self) -> None: ...

        def _loaded_anywhere(self, provider: str, model: str) -> bool: ...

        def _queued_models(self, provider: str) -> set[str]: ...

        def _load_ended(self, worker: Worker, op: ModelOp, *, ok: bool) -> None: ...

        def _send_op(
            self,
            worker: Worker,
            kind: Literal["load", "unload"],
            model: str,
            reason: str,
            *,
            then: str | None = None,
            cluster: bool = False,
        ) -> None: ...

    def _has_states(self) -> bool:
        return any(w.states is not None for w in self.registry.workers.values())

    def _awaiting_loads(self) -> bool:
        """Requests wait here for a load (cluster mode: maybe on another process's worker)."""
        return any(r.awaits_load for s in self.providers.values() for r in s.queue)

    def _ensure_residency(self) -> None:
        if self._residency_task is None or self._residency_task.done():
            self._residency_task = self.loop.create_task(self._residency_loop())

    def _tick_secs(self) -> float:
        config = self.config
        bounds = [MAX_TICK_SECS, config.model_load_timeout / 4]
        if config.model_scale_out_wait > 0:
            bounds.append(config.model_scale_out_wait / 2)
        if config.model_idle_unload > 0:
            bounds.append(config.model_idle_unload / 2)
        return max(min(bounds), 0.02)

    async def _residency_loop(self) -> None:
        """Once per tick while any worker reports states: forget operations that got no
        answer, scale out, unload idle models, and reconcile."""
        while self._has_states() or self._episodes or self._awaiting_loads():
            await asyncio.sleep(self._tick_secs())
            try:
                self._residency_tick(self.loop.time())
            except Exception:  # keep ticking for everyone else
                logger.exception("models on demand: tick failed")

    def _residency_tick(self, now: float) -> None:
        timeout = self.config.model_load_timeout
        for worker in list(self.registry.workers.values()):
            for op_id, op in list(worker.ops.items()):
                if now - op.started >= timeout:
                    del worker.ops[op_id]
                    logger.warning(
                        "worker %s did not answer %s of %s within %gs",
                        worker.name,
                        op.kind,
                        op.model,
                        timeout,
                    )
                    if op.kind == "load" and not op.counted:
                        counts(worker, op.model).load_failures += 1
                        self.stats.model_load_failures += 1
                    if op.kind == "load" or op.then is not None:
                        self._load_ended(worker, op, ok=op.counted)
        if self.config.model_scale_out_wait > 0:
            self._scale_out(now)
        if self.config.model_idle_unload > 0:
            self._unload_idle(now)
        self._reconcile()

    def _scale_out(self, now: float) -> None:
        """A loaded model whose oldest waiting request waited past the bound gets one
        more copy on a worker with a free model slot (never by unloading another)."""
        bound = self.config.model_scale_out_wait
        for name, state in self.providers.items():
            oldest: dict[str, float] = {}
            for request in state.queue:
                since = request.enqueued_at
                if since is not None and since < oldest.get(request.model, now):
                    oldest[request.model] = since
            for model, since in oldest.items():
                if now - since < bound or not self._loaded_anywhere(name, model):
                    continue
                if self.clustered:
                    assert self.placement is not None
                    self.placement.want_model(name, model, scale=True)
                    continue
                if (name, model) in self._episodes:
                    continue
                holders = self.registry.holders(name, model)
                if any(busy_with(w, model) for w in holders):
                    continue  # a copy is on its way
                target = load_target(holders, model, set(), self._queued_models(name))
                if target is not None and target[1] is None:
                    self._send_op(target[0], "load", model, "scale_out")

    def _unload_idle(self, now: float) -> None:
        bound = self.config.model_idle_unload
        for worker in list(self.registry.workers.values()):
            if worker.states is None or worker.draining:
                continue
            while True:
                model = idle_model(worker, self._queued_models(worker.provider))
                if model is None or now - worker.used.get(model, now) < bound:
                    break
                if self.clustered:
                    # Requests for it may wait at another process: the cluster says.
                    assert self.placement is not None
                    self.placement.unload_if_unwanted(worker, model)
                    break
                self._send_op(worker, "unload", model, "idle")

    # -- views

    def loading(self) -> list[tuple[str, str]]:
        """(provider, model) of each model requests wait for a load of."""
        return sorted(self._episodes)

    def model_state_view(self) -> dict[str, str]:
        """model -> its best state on this process's workers (loaded, then loading,
        asleep, loadable): what ``/v1/models`` shows; models of workers without the
        extension count as loaded."""
        rank = {LOADED: 0, LOADING: 1, SLEEPING: 2, LOADABLE: 3}
        out: dict[str, str] = {}
        for worker in self.registry.workers.values():
            states = worker.states
            for model in worker.models:
                state = LOADED if states is None else states.get(model, LOADABLE)
                if state not in rank:
                    state = LOADABLE
                best = out.get(model)
                if best is None or rank[state] < rank[best]:
                    out[model] = state
        return out
