"""Ollama: every pulled model on disk, as many in memory as ``OLLAMA_MAX_LOADED_MODELS``.

What the worker reads and calls (Ollama's API, docs/api.md):

- ``GET /api/tags``: ``{"models": [{"name", "model", ...}]}``, the models on disk;
- ``GET /api/ps``: the same shape, the models in memory now;
- ``POST /api/generate`` with ``{"model": NAME}`` and no prompt loads it and answers
  once it is in memory; with ``"keep_alive": 0`` as well it unloads it.

Ollama has no event stream and does not say how many models it holds: the tracker polls
``/api/ps``, and ``--models-max`` gives the bound (its ``OLLAMA_MAX_LOADED_MODELS``). A
model being loaded is not in ``/api/ps`` until it is in memory: the tracker reports it
``loading`` while its own load runs.
"""

from __future__ import annotations

from typing import Any

from relay.wire.protocol import LOADABLE, LOADED
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


def is_ollama(ps: Any) -> bool:
    """Whether a ``GET /api/ps`` answer is Ollama's (``{"models": [...]}``)."""
    return isinstance(ps, dict) and isinstance(ps.get("models"), list)


def _names(document: Any) -> list[str]:
    return [text(m.get("name")) or text(m.get("model")) for m in entries(document, "models")]


class Ollama(ModelHost):
    kind = "Ollama"
    on_demand = True

    async def states(self) -> Snapshot:
        status, tags = await call(self.http, "GET", self.url("/api/tags"), secs=self.timeout)
        if status != 200:
            raise BackendNotReady(f"GET /api/tags: HTTP {status}")
        status, ps = await call(self.http, "GET", self.url("/api/ps"), secs=self.timeout)
        if status != 200:
            raise BackendNotReady(f"GET /api/ps: HTTP {status}")
        loaded = set(_names(ps))
        models = {n: Model(LOADED if n in loaded else LOADABLE) for n in _names(tags) if n}
        return Snapshot(models, self.capacity)

    async def load(self, model: str) -> None:
        await self._generate({"model": model})

    async def unload(self, model: str) -> None:
        await self._generate({"model": model, "keep_alive": 0})

    async def _generate(self, body: dict[str, Any]) -> None:
        status, answer = await call(
            self.http, "POST", self.url("/api/generate"), secs=self.op_timeout, body=body
        )
        if status != 200:
            raise HostError(f"POST /api/generate: {reason(answer, f'HTTP {status}')}")
