"""Which kind of backend the worker serves: one that loads models on demand (SPEC §19),
or a plain one.

``worker.Worker`` calls :func:`recognise` once the backend answers its discovery, and
hands the :class:`~relay.worker.modelhost.ModelHost` it returns to its
:class:`relay.worker.tracker.ModelTracker`. Kinds, one module each: llama-server's router
(:mod:`relay.worker.llamarouter`), llama-swap (:mod:`relay.worker.llamaswap`), Ollama
(:mod:`relay.worker.ollama`) and vLLM with sleep mode or runtime LoRA adapters
(:mod:`relay.worker.vllm`); anything else is the plain backend (the base
:class:`~relay.worker.modelhost.ModelHost`), registered as before. Imports nothing from
Django.
"""

from __future__ import annotations

import logging

import httpx

from relay.worker.backend import BackendNotReady
from relay.worker.config import Config
from relay.worker.llamarouter import (
    LlamaRouter,
    is_router,
    is_router_props,
    router_capacity,
)
from relay.worker.llamaswap import LlamaSwap, is_llamaswap
from relay.worker.modelhost import ModelHost, call
from relay.worker.ollama import Ollama, is_ollama
from relay.worker.vllm import Vllm, is_vllm, sleeping

log = logging.getLogger("modelrelay.worker")


async def recognise(http: httpx.AsyncClient, config: Config) -> ModelHost:
    """The kind of backend at ``config.backend_url``, from its answers.

    Called once, after the backend answered model discovery. Asks ``GET /v1/models``
    (llama-server's router, llama-swap and vLLM tell themselves apart by it), then
    whatever that kind needs (the router's ``/props``, llama-swap's ``/running``,
    vLLM's ``/is_sleeping``), else Ollama's ``GET /api/ps``. A backend that answers
    none of them usefully is plain. Never raises: an unanswered question counts as no.
    """
    plain = ModelHost(http, config)
    if not config.model_states:
        return plain

    async def ask(path: str) -> object:
        try:
            status, answer = await call(
                http, "GET", config.backend_url + path, secs=config.discovery_timeout
            )
        except BackendNotReady as exc:
            log.debug("recognising the backend: %s", exc)
            return None
        return answer if status == 200 else None

    listing = await ask("/v1/models")
    if is_router(listing):
        return LlamaRouter(http, config, router_capacity(await ask("/props")))
    if isinstance(listing, dict) and listing.get("data") == []:
        props = await ask("/props")  # a router with no model yet says so only here
        if is_router_props(props):
            return LlamaRouter(http, config, router_capacity(props))
    if is_llamaswap(listing) and await ask("/running") is not None:
        return LlamaSwap(http, config)
    if is_vllm(listing):
        asleep = sleeping(await ask("/is_sleeping"))
        if asleep is not None or config.lora_adapters:
            return Vllm(http, config, sleeps=asleep is not None)
        return plain
    if is_ollama(await ask("/api/ps")):
        return Ollama(http, config)
    return plain
