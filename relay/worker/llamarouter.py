"""llama-server in router mode (``--models-dir``, ``--models-max``): many models on
disk, a few in memory, each in a child process of its own.

What the worker reads and calls (llama.cpp ``tools/server/server-models.cpp``):

- ``GET /models``: ``{"data": [{"id", "aliases", "status": {"value", "failed",
  "exit_code", ...}, ...}]}``, ``value`` one of ``loaded``, ``loading``, ``unloaded``,
  ``sleeping`` (``downloading`` for a model still coming from Hugging Face); ``failed``
  and ``exit_code`` once a child exited with an error;
- ``GET /props``: ``{"role": "router", "max_instances": N}`` (its ``--models-max``; 0:
  no bound), read once at recognition;
- ``GET /props?model=NAME&autoload=false``: a loaded model's own ``total_slots``
  (``autoload=false``: asking never loads a model);
- ``POST /models/load`` / ``POST /models/unload`` with ``{"model": NAME}``: ``{"success":
  true}`` once the child is started (state ``loading``; a full router first unloads its
  least recently used model) or asked to exit; 400 "model is already running" / "model
  is not running" when there is nothing to do. A child that does not exit within the
  preset's ``stop-timeout`` (10 s) is killed: a stream it was writing ends cleanly after
  a bare ``proxy error: …`` line (see :class:`relay.wire.sse.StreamEnd`);
- ``GET /slots?model=NAME&autoload=false`` wakes a model its server put to sleep
  (``--sleep-idle-seconds``; state ``sleeping``): a load of a sleeping model asks it;
- ``GET /models/sse``: ``data: {"model", "event", "data"}`` per change (status changes,
  list reloads); any event makes the tracker read ``GET /models`` again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

from relay.wire.errors import describe
from relay.wire.protocol import LOADABLE, LOADED, LOADING, SLEEPING
from relay.worker.backend import BackendNotReady
from relay.worker.config import Config
from relay.worker.modelhost import (
    CONNECT_TIMEOUT_SECS,
    HostError,
    Model,
    ModelHost,
    Snapshot,
    call,
    entries,
    reason,
    text,
)

#: The router's words for states, in the protocol's (others pass through unchanged).
_STATES = {"loaded": LOADED, "loading": LOADING, "unloaded": LOADABLE, "sleeping": SLEEPING}


def is_router(listing: Any) -> bool:
    """Whether a ``GET /v1/models`` answer is a llama-server router's: its models are
    llama.cpp's and carry a ``status`` object (a single-model server's carry none)."""
    models = entries(listing, "data")
    return bool(models) and all(
        m.get("owned_by") == "llamacpp" and isinstance(m.get("status"), dict) for m in models
    )


def is_router_props(props: Any) -> bool:
    """Whether a ``GET /props`` answer is a llama-server router's."""
    return isinstance(props, dict) and props.get("role") == "router"


def router_capacity(props: Any) -> int | None:
    """``max_instances`` from the router's ``GET /props`` (None: no bound, or not told)."""
    if not is_router_props(props):
        return None
    value = props.get("max_instances")
    return value if type(value) is int and value > 0 else None


class LlamaRouter(ModelHost):
    kind = "llama-server router"
    on_demand = True
    has_events = True
    reports_slots = True

    def __init__(self, http: httpx.AsyncClient, config: Config, capacity: int | None) -> None:
        super().__init__(http, config)
        if capacity is not None:
            self.capacity = capacity
        #: ``total_slots`` of each model in memory, asked once per load.
        self._slots: dict[str, int] = {}

    async def states(self) -> Snapshot:
        status, listing = await call(self.http, "GET", self.url("/models"), secs=self.timeout)
        if status != 200 or not isinstance(listing, dict):
            raise BackendNotReady(f"GET /models: HTTP {status}")
        models: dict[str, Model] = {}
        for entry in entries(listing, "data"):
            name = text(entry.get("id"))
            status_doc = entry.get("status")
            word = text(status_doc.get("value")) if isinstance(status_doc, dict) else ""
            if not name or not word or name in models:
                continue
            problem = None
            if isinstance(status_doc, dict) and status_doc.get("failed") is True:
                problem = f"its llama-server exited with code {status_doc.get('exit_code')}"
            models[name] = Model(_STATES.get(word, word), problem=problem)
        # Slots belong to a model in memory: forgotten when it leaves, asked when it came.
        kept = {n for n, m in models.items() if m.state in (LOADED, SLEEPING)}
        self._slots = {n: s for n, s in self._slots.items() if n in kept}
        for name, model in models.items():
            if model.state != LOADED:
                continue
            if name not in self._slots:
                slots = await self._total_slots(name)
                if slots is None:
                    continue
                self._slots[name] = slots
            models[name] = Model(LOADED, self._slots[name])
        return Snapshot(models, self.capacity)

    async def _total_slots(self, name: str) -> int | None:
        path = f"/props?model={quote(name, safe='')}&autoload=false"
        try:
            status, props = await call(self.http, "GET", self.url(path), secs=self.timeout)
        except BackendNotReady:
            return None
        slots = props.get("total_slots") if status == 200 and isinstance(props, dict) else None
        return slots if type(slots) is int and slots >= 1 else None

    async def load(self, model: str) -> None:
        if not await self._order("/models/load", model, done="model is already running"):
            await self._wake(model)

    async def _wake(self, model: str) -> None:
        """Wake a model its server put to sleep (``--sleep-idle-seconds``): any call to
        it that needs the model does, and ``GET /slots`` needs nothing else (never a
        load: ``autoload=false``). Whatever it answers, the tracker waits for the state."""
        path = f"/slots?model={quote(model, safe='')}&autoload=false"
        with contextlib.suppress(BackendNotReady):
            await call(self.http, "GET", self.url(path), secs=self.op_timeout)

    async def unload(self, model: str) -> None:
        await self._order("/models/unload", model, done="model is not running")

    async def _order(self, path: str, model: str, done: str) -> bool:
        """POST ``path`` for ``model``: True when the router took the order, False when
        it had nothing to do (``done``: under way or done already)."""
        status, answer = await call(
            self.http, "POST", self.url(path), secs=self.op_timeout, body={"model": model}
        )
        if status == 200:
            return True
        why = reason(answer, f"HTTP {status}")
        if status == 400 and why == done:
            return False
        raise HostError(f"POST {path}: {why}")

    async def watch(self, changed: Callable[[], None], idle: float) -> bool:
        timeout = httpx.Timeout(idle, connect=min(self.timeout, CONNECT_TIMEOUT_SECS))
        try:
            async with self.http.stream(
                "GET", self.url("/models/sse"), timeout=timeout
            ) as response:
                if response.status_code == 404:
                    return False  # a router from before the event stream: poll
                if response.status_code != 200:
                    raise BackendNotReady(f"GET /models/sse: HTTP {response.status_code}")
                changed()  # anything may have changed before the stream opened
                # Only "something changed" matters: bytes are never kept or parsed.
                async for _ in response.aiter_raw():
                    changed()
        except httpx.ReadTimeout:
            pass  # silent for ``idle`` seconds: the tracker looks, then opens it again
        except httpx.HTTPError as exc:
            raise BackendNotReady(f"GET /models/sse: {describe(exc)}") from None
        return True
