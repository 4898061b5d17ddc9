"""llama-swap: one proxy in front of many inference servers, started and stopped on demand.

What the worker reads and calls (llama-swap's documented API):

- ``GET /v1/models``: every configured model (``owned_by: "llama-swap"``); peers,
  selectors and profiles (``meta.llamaswap.type``) are routes to other models, not
  models of this box, and are left out;
- ``GET /running``: ``{"running": [{"model", "state"}]}``, ``state`` one of ``starting``,
  ``ready``, ``stopping`` (a model that is not listed is stopped);
- a load is any request routed to the model: ``GET /upstream/{model}/health`` starts its
  server (after stopping others, as its groups say) and answers once it is ready;
- ``POST /api/models/unload/{model}`` stops one model (llama-swap's older ``GET
  /unload`` stops them all, which the worker never asks for).

It has no event stream the worker reads: the tracker polls ``GET /running``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from relay.wire.protocol import LOADABLE, LOADED, LOADING
from relay.worker.backend import BackendNotReady
from relay.worker.modelhost import (
    HostError,
    Model,
    ModelHost,
    Snapshot,
    call,
    entries,
    reason,
    text,
)

#: llama-swap's process states, in the protocol's words: a model on its way out takes
#: no new work well (a request would start it again), so it counts as not loaded.
_STATES = {"ready": LOADED, "starting": LOADING, "stopping": LOADABLE}
#: ``meta.llamaswap.type`` of entries that are not models of this box.
_ROUTES = frozenset({"peer", "selector", "profile"})


def is_llamaswap(listing: Any) -> bool:
    """Whether a ``GET /v1/models`` answer is llama-swap's."""
    models = entries(listing, "data")
    return bool(models) and any(m.get("owned_by") == "llama-swap" for m in models)


def _local(entry: dict[str, Any]) -> bool:
    meta = entry.get("meta")
    swap = meta.get("llamaswap") if isinstance(meta, dict) else None
    return not (isinstance(swap, dict) and swap.get("type") in _ROUTES)


def _model_path(model: str) -> str:
    return quote(model, safe=":@")


class LlamaSwap(ModelHost):
    kind = "llama-swap"
    on_demand = True

    async def states(self) -> Snapshot:
        status, listing = await call(self.http, "GET", self.url("/v1/models"), secs=self.timeout)
        if status != 200:
            raise BackendNotReady(f"GET /v1/models: HTTP {status}")
        status, running = await call(self.http, "GET", self.url("/running"), secs=self.timeout)
        if status != 200:
            raise BackendNotReady(f"GET /running: HTTP {status}")
        now = {text(r.get("model")): text(r.get("state")) for r in entries(running, "running")}
        models: dict[str, Model] = {}
        for entry in entries(listing, "data"):
            name = text(entry.get("id"))
            if name and _local(entry) and name not in models:
                models[name] = Model(_STATES.get(now.get(name, ""), LOADABLE))
        return Snapshot(models, self.capacity)

    async def load(self, model: str) -> None:
        path = f"/upstream/{_model_path(model)}/health"
        status, answer = await call(self.http, "GET", self.url(path), secs=self.op_timeout)
        if status >= 400:
            raise HostError(f"GET /upstream/…/health: {reason(answer, f'HTTP {status}')}")

    async def unload(self, model: str) -> None:
        path = f"/api/models/unload/{_model_path(model)}"
        status, answer = await call(self.http, "POST", self.url(path), secs=self.op_timeout)
        if status == 200:
            return
        if status in (404, 405) and answer is None:
            raise HostError(
                "this llama-swap cannot unload one model (it has no POST /api/models/unload/"
                "{model}); upgrade it"
            )
        raise HostError(f"POST /api/models/unload: {reason(answer, f'HTTP {status}')}")
