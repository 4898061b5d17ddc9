"""vLLM with sleep mode, runtime LoRA adapters, or both: one base model that may sleep,
and adapters loaded beside it, each served as a model of its own name.

What the worker reads and calls (vLLM's OpenAI-compatible server):

- ``GET /v1/models``: the base model (``parent`` null; several entries when it has
  several served names) and the adapters in memory (``parent`` the base, ``root`` the
  adapter's path);
- sleep mode (``--enable-sleep-mode`` with ``VLLM_SERVER_DEV_MODE=1``): ``GET
  /is_sleeping`` → ``{"is_sleeping": bool}``, ``POST /sleep?level=1`` (weights to host
  memory, woken in a fraction of a load's time), ``POST /wake_up``;
- runtime LoRA (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``POST
  /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}``. vLLM does not list the adapters it
  could load: those are ``--lora-adapters`` (name=path), plus any it served before.

An unload of the base model puts it to sleep (there is no other way to free it); an
adapter is loadable again after its unload. While the base sleeps, its adapters sleep
with it, and loading one wakes it. vLLM has no event stream: the tracker polls.
"""

from __future__ import annotations

from typing import Any

import httpx

from relay.wire.protocol import LOADABLE, LOADED, SLEEPING
from relay.worker.backend import BackendNotReady
from relay.worker.config import Config
from relay.worker.modelhost import (
    HostError,
    Model,
    ModelHost,
    Snapshot,
    bounded,
    call,
    entries,
    reason,
    text,
)

#: Adapters remembered from what vLLM served (their paths, to load them again).
MAX_REMEMBERED_ADAPTERS = 256


def is_vllm(listing: Any) -> bool:
    """Whether a ``GET /v1/models`` answer is vLLM's."""
    models = entries(listing, "data")
    return bool(models) and all(m.get("owned_by") == "vllm" for m in models)


def sleeping(answer: Any) -> bool | None:
    """``is_sleeping`` of a ``GET /is_sleeping`` answer (None: not an answer of it)."""
    value = answer.get("is_sleeping") if isinstance(answer, dict) else None
    return value if isinstance(value, bool) else None


class Vllm(ModelHost):
    kind = "vLLM"
    on_demand = True

    def __init__(self, http: httpx.AsyncClient, config: Config, *, sleeps: bool) -> None:
        super().__init__(http, config)
        #: Whether sleep mode answers (``GET /is_sleeping``).
        self.sleeps = sleeps
        #: Adapter name -> path: the configured ones, then those seen served.
        self.adapters: dict[str, str] = dict(config.lora_adapters)
        self._bases: list[str] = []

    async def states(self) -> Snapshot:
        status, listing = await call(self.http, "GET", self.url("/v1/models"), secs=self.timeout)
        if status != 200:
            raise BackendNotReady(f"GET /v1/models: HTTP {status}")
        bases, served = [], []
        for entry in entries(listing, "data"):
            name, parent = text(entry.get("id")), entry.get("parent")
            if not name:
                continue
            if parent is None:
                bases.append(name)
                continue
            served.append(name)
            root = text(entry.get("root"))
            if root and name not in self.adapters and len(self.adapters) < MAX_REMEMBERED_ADAPTERS:
                self.adapters[name] = root
        self._bases = bounded(bases)
        asleep = False
        if self.sleeps:
            status, answer = await call(
                self.http, "GET", self.url("/is_sleeping"), secs=self.timeout
            )
            asleep = bool(sleeping(answer)) if status == 200 else False
        awake = SLEEPING if asleep else LOADED
        models = {name: Model(awake) for name in self._bases}
        in_memory = set(served)
        for name in bounded([*served, *self.adapters]):
            models.setdefault(name, Model(awake if name in in_memory else LOADABLE))
        return Snapshot(models, self.capacity)

    async def load(self, model: str) -> None:
        if self.sleeps:
            await self._post("/wake_up", None)
        if model in self._bases:
            return
        path = self.adapters.get(model)
        if path is None:
            raise HostError(f"no path is known for the LoRA adapter {model!r} (--lora-adapters)")
        body = {"lora_name": model, "lora_path": path}
        try:
            await self._post("/v1/load_lora_adapter", body)
        except HostError as exc:
            if "already" not in str(exc):  # vLLM: "... has already been loaded"
                raise

    async def unload(self, model: str) -> None:
        if model not in self._bases:
            await self._post("/v1/unload_lora_adapter", {"lora_name": model})
            return
        if not self.sleeps:
            raise HostError(
                "this vLLM cannot free its base model: start it with --enable-sleep-mode "
                "and VLLM_SERVER_DEV_MODE=1"
            )
        await self._post("/sleep?level=1", None)

    def freed_state(self, model: str) -> str:
        return SLEEPING if model in self._bases else LOADABLE

    async def _post(self, path: str, body: dict[str, str] | None) -> None:
        status, answer = await call(
            self.http, "POST", self.url(path), secs=self.op_timeout, body=body
        )
        if status != 200:
            raise HostError(f"POST {path.split('?')[0]}: {reason(answer, f'HTTP {status}')}")
