"""One connection's side of the ``model_states`` extension (SPEC §19).

Each :class:`relay.worker.session.Session` holds one :class:`ModelAnnouncer`: it gives
the states for ``register``, sends the whole list again whenever it changed (once the
relay accepted the extension), and runs each ``model_load`` / ``model_unload`` in a task
of its own, answered by exactly one ``model_result``. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from relay.wire.protocol import (
    ModelLoad,
    ModelState,
    ModelStates,
    ModelUnload,
    WorkerMessage,
)
from relay.worker.operations import ModelOperations
from relay.worker.outbox import encode
from relay.worker.tracker import ModelTracker

log = logging.getLogger("modelrelay.worker")

#: The least time between two ``model_states`` frames: a burst of changes goes out as
#: one frame with the whole list (never more than a few a second).
MODEL_STATES_INTERVAL_SECS = 0.25


class Announcing(Protocol):
    """What the announcer needs from the worker (``worker.Worker``)."""

    draining: bool
    backend_error: str | None

    @property
    def max_concurrent(self) -> int: ...

    @property
    def tracker(self) -> ModelTracker: ...

    @property
    def operations(self) -> ModelOperations: ...


class ModelAnnouncer:
    """States and operations on one connection; the session starts its tasks."""

    def __init__(
        self,
        worker: Announcing,
        send: Callable[[WorkerMessage], Coroutine[Any, Any, None]],
        post: Callable[[bytes], None],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ) -> None:
        self.worker = worker
        self._send = send
        self._post = post
        self._spawn = spawn
        #: ``model_load`` / ``model_unload`` under way.
        self.ops: set[asyncio.Task[Any]] = set()
        #: The tracker's version and the ``max_concurrent`` the relay last heard.
        self._told = 0
        self._concurrency_told = 0

    def register_fields(self, models: list[str]) -> tuple[list[ModelState] | None, int | None]:
        """``model_states`` and ``model_capacity`` for ``register`` (``models``: what it
        advertises). None for a plain backend, which registers as before the extension."""
        tracker = self.worker.tracker
        self._told, self._concurrency_told = tracker.version, self.worker.max_concurrent
        if not tracker.on_demand:
            return None, None
        return (tracker.states() if models else []), tracker.snapshot.capacity

    def on_op(self, op: ModelLoad | ModelUnload) -> None:
        """Run ``op`` in a task of its own (answered at once when it cannot run)."""
        refusal = self.worker.operations.refusal(op, len(self.ops))
        if refusal is not None:
            self._post(encode(refusal))
            return
        task = self._spawn(self._operate(op), f"model op {op.op_id}")
        self.ops.add(task)
        task.add_done_callback(self.ops.discard)

    async def _operate(self, op: ModelLoad | ModelUnload) -> None:
        await self._send(await self.worker.operations.operate(op))

    async def report(self, draining: Callable[[], bool]) -> None:
        """Send the whole list of states whenever it changed, until cancelled.

        Runs from ``register_ack`` (when the relay accepted the extension) to the end of
        the connection. Changes that come just after a frame wait for
        :data:`MODEL_STATES_INTERVAL_SECS`, then go out together; none go out while
        draining or while the backend cannot be reached (the models are withdrawn then;
        the list goes out again when it is back).
        """
        tracker = self.worker.tracker
        loop = asyncio.get_running_loop()
        sent_at = -math.inf
        while True:
            await tracker.changed(self._told)
            wait = sent_at + MODEL_STATES_INTERVAL_SECS - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._told = tracker.version
            if draining() or self.worker.draining or self.worker.backend_error is not None:
                continue
            await self._send(self._frame())
            sent_at = loop.time()

    def _frame(self) -> ModelStates:
        frame = self.worker.tracker.frame()
        if self.worker.max_concurrent != self._concurrency_told:
            frame.max_concurrent = self._concurrency_told = self.worker.max_concurrent
        return frame
