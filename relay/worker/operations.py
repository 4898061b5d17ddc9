"""The loads and unloads the relay asks for (SPEC §19, ``model_load`` / ``model_unload``).

``worker.Worker`` holds one :class:`ModelOperations` beside its
:class:`~relay.worker.tracker.ModelTracker`; each connection's
:class:`relay.worker.announcer.ModelAnnouncer` asks it whether an operation may run
(:meth:`ModelOperations.refusal`) and runs each in a task of its own
(:meth:`ModelOperations.operate`).

Operations on one model run one at a time, in the order they came: a second one waits
for the first, then usually finds nothing left to do (a load after a load answers ok
at once). At most :data:`MAX_WAITING_OPS` may wait behind the running one, and at most
:data:`MAX_OPS_IN_FLIGHT` run at once on one connection; more are refused. An operation
for a model the backend does not have is refused at once and nothing is kept for it.
Every operation ends in exactly one ``model_result``, within ``--model-op-timeout-secs``:
a load once the backend reports the model ``loaded``, an unload once it is out of memory
(or asleep, where sleep is what frees it). Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from relay.wire.errors import describe
from relay.wire.protocol import (
    LOADED,
    LOADING,
    SLEEPING,
    ModelLoad,
    ModelResult,
    ModelUnload,
)
from relay.worker.backend import BackendNotReady
from relay.worker.config import Config
from relay.worker.modelhost import HostError
from relay.worker.tracker import ModelTracker

log = logging.getLogger("modelrelay.worker")

#: Operations that may wait behind the one running on the same model.
MAX_WAITING_OPS = 4
#: Operations one connection may have under way at once (over all models).
MAX_OPS_IN_FLIGHT = 64

ModelOp = ModelLoad | ModelUnload


class _Turns:
    """The operations on one model: one runs, the others wait for the lock."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class ModelOperations:
    """Loads and unloads through the tracker's backend, one at a time per model."""

    def __init__(self, tracker: ModelTracker, config: Config) -> None:
        self.tracker = tracker
        self.config = config
        #: Only for models the backend has, and only while an operation is under way.
        self._turns: dict[str, _Turns] = {}

    def refusal(self, op: ModelOp, in_flight: int) -> ModelResult | None:
        """The answer to ``op`` when it cannot run at all (None: it may run).

        Called by the session for each ``model_load`` / ``model_unload`` before it
        starts a task: nothing is kept for an op refused here.
        """
        kind = _kind(op)
        if not self.tracker.on_demand:
            problem = "this backend does not load or unload models on demand"
        elif op.model not in self.tracker.snapshot.models:
            problem = "the backend has no such model"
        elif in_flight >= MAX_OPS_IN_FLIGHT:
            problem = f"more than {MAX_OPS_IN_FLIGHT} model operations under way"
        else:
            return None
        log.warning("refused to %s model %s (op %s): %s", kind, op.model[:200], op.op_id, problem)
        state = self.tracker.state(op.model)
        return ModelResult(
            op_id=op.op_id,
            model=op.model,
            op=kind,
            ok=False,
            state=state,
            error=problem,
            duration_ms=0,
        )

    async def operate(self, op: ModelOp) -> ModelResult:
        """Run one load or unload to its end; the one ``model_result`` that answers it.

        Waits behind an operation on the same model already under way. Never raises
        but for cancellation (the connection ended).
        """
        kind, model = _kind(op), op.model
        started = time.monotonic()
        problem: str | None = None
        turns = self._turns.get(model)
        if turns is None:
            turns = self._turns[model] = _Turns()
        try:
            turns.users += 1
            if turns.users > MAX_WAITING_OPS + 1:
                problem = f"{MAX_WAITING_OPS} operations on this model are already waiting"
            else:
                timeout = self.config.model_op_timeout_secs
                try:
                    async with asyncio.timeout(timeout):
                        async with turns.lock:
                            if isinstance(op, ModelLoad):
                                await self._load(model)
                            else:
                                await self._unload(model)
                except TimeoutError:
                    problem = f"not done after {timeout:g}s (MODEL_OP_TIMEOUT_SECS)"
                except (HostError, BackendNotReady) as exc:
                    problem = str(exc)
                except Exception as exc:  # a bug must still answer the relay
                    log.exception("%s of model %s failed unexpectedly", kind, model)
                    problem = describe(exc)
        finally:
            turns.users -= 1
            if not turns.users and self._turns.get(model) is turns:
                del self._turns[model]
        elapsed = time.monotonic() - started
        state = self.tracker.state(model)
        if problem is None:
            log.info(
                "%s model %s in %.2fs (op %s; now %s)", _done(kind), model, elapsed, op.op_id, state
            )
        else:
            log.warning(
                "could not %s model %s after %.2fs (op %s; now %s): %s",
                kind,
                model,
                elapsed,
                op.op_id,
                state or "gone",
                problem,
            )
        return ModelResult(
            op_id=op.op_id,
            model=model,
            op=kind,
            ok=problem is None,
            state=state,
            error=None if problem is None else problem[:1000],
            duration_ms=round(elapsed * 1000),
        )

    async def _load(self, model: str) -> None:
        await self.tracker.refresh()
        state = self.tracker.backend_state(model)
        if state == LOADED:
            return
        self.tracker.loading(model, True)  # the relay hears "loading" at once
        try:
            if state != LOADING:
                await self.tracker.host.load(model)  # a sleeping model is woken
                await self.tracker.refresh()
            state = await self._settle(model, lambda s: s not in (LOADING, SLEEPING))
        finally:
            self.tracker.loading(model, False)
        if state != LOADED:
            why = self.tracker.problem(model)
            raise HostError(why or f"the backend did not load it (its state: {state or 'gone'})")

    async def _unload(self, model: str) -> None:
        await self.tracker.refresh()
        freed = self.tracker.host.freed_state(model)

        def done(state: str) -> bool:
            # A sleeping model still holds memory where sleep is not what frees it
            # (llama-server's router counts it against --models-max).
            return state == freed or state not in (LOADED, LOADING, SLEEPING)

        if done(self.tracker.backend_state(model)):
            return
        await self.tracker.host.unload(model)
        await self.tracker.refresh()
        await self._settle(model, done)

    async def _settle(self, model: str, done: Callable[[str], bool]) -> str:
        """Wait until the backend's state of ``model`` satisfies ``done``; that state.

        Woken by every read of the states (the event stream's, the poll's), and reads
        them itself every ``--model-poll-secs`` meanwhile.
        """
        while True:
            state = self.tracker.backend_state(model)
            if done(state):
                return state
            answered = self.tracker.answered
            try:
                async with asyncio.timeout(self.config.model_poll_secs):
                    await answered.wait()
            except TimeoutError:
                await self.tracker.refresh()


def _kind(op: ModelOp) -> Literal["load", "unload"]:
    return "load" if isinstance(op, ModelLoad) else "unload"


def _done(kind: str) -> str:
    return "loaded" if kind == "load" else "unloaded"
