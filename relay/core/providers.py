"""The dispatcher's provider table: providers as the core sees them, which models each
may serve (declared, advertised, exclusive, aliased), and which provider a request for
a model goes to.

:class:`ProviderTable` is a base of :class:`relay.core.dispatch.Dispatcher`; like the
rest of the dispatcher it runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from relay.core.config import ProviderPolicy, RelayConfig
from relay.core.queue import ProviderQueue
from relay.core.registry import Registry
from relay.core.state import Completion, RelayRequest, Worker
from relay.wire.errors import (
    BadRequest,
    ModelNotFound,
    ProviderDisabled,
    ProviderGone,
    RelayError,
)

if TYPE_CHECKING:
    from relay.core.placement import Placement

logger = logging.getLogger("relay")

#: The close reason of workers disconnected because their provider's secret was rotated.
SECRET_ROTATED = "provider secret rotated"

_json_decode = msgspec.json.Decoder(dict[str, Any]).decode
_json_encode = msgspec.json.Encoder().encode


def rewrite_model(body: str, model: str) -> str:
    """``body`` (a JSON object) with its ``model`` replaced, everything else kept."""
    document = _json_decode(body)
    document["model"] = model
    return _json_encode(document).decode()


class ProviderState:
    __slots__ = ("policy", "queue", "touched")

    def __init__(
        self,
        policy: ProviderPolicy,
        touched: float,
        *,
        aging: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.queue = ProviderQueue(aging=aging, clock=clock)
        self.touched = touched


class ProviderTable:
    """Providers by name, the exclusive-model table and the models of other processes."""

    #: model -> the provider that declared it exclusive (the first by name, if two do).
    reserved: dict[str, str]
    #: Cluster mode: provider -> models served by workers of other processes.
    remote_models: dict[str, frozenset[str]]
    #: provider -> workers closed because their secret was rotated away, not yet counted
    #: by whoever asked for it (see :meth:`take_evicted`).
    evicted: dict[str, int]

    if TYPE_CHECKING:  # provided by the dispatcher
        config: RelayConfig
        loop: asyncio.AbstractEventLoop
        registry: Registry
        providers: dict[str, ProviderState]
        placement: Placement | None

        def _finish(
            self,
            request: RelayRequest,
            result: Completion | RelayError | object,
            *,
            outcome: str | None = None,
            cancel_reason: str | None = None,
        ) -> None: ...

        def close_worker(self, worker: Worker, code: int, reason: str) -> None: ...

    def set_provider(self, policy: ProviderPolicy) -> None:
        """Create or update a provider; disabling fails its queue and closes its workers."""
        state = self.providers.get(policy.name)
        previous = state.policy.exclusive_models if state is not None else frozenset()
        if state is None:
            self.providers[policy.name] = ProviderState(
                policy,
                self.loop.time(),
                aging=self.config.priority_aging,
                clock=self.loop.time,
            )
        else:
            state.policy = policy
            state.touched = self.loop.time()
        if policy.exclusive_models != previous:
            self._reserve_models()
        if not policy.enabled:
            self._evict_provider(policy.name, ProviderDisabled, "provider disabled")
            return
        for worker in self.registry.of_provider(policy.name):
            if worker.eviction is not None and worker.eviction < policy.eviction:
                # Its secret was rotated away (the broadcast may not have come).
                self.close_worker(worker, 1008, SECRET_ROTATED)
                self.evicted[policy.name] = self.evicted.get(policy.name, 0) + 1

    def take_evicted(self, provider: str) -> int:
        """How many workers of ``provider`` the provider sync closed for a rotated secret
        since the last call (the rotation that asked for it counts them as its own)."""
        return self.evicted.pop(provider, 0)

    def reserved_for_others(self, provider: str, models: Iterable[str]) -> list[str]:
        """Which of ``models`` another provider declared exclusive."""
        reserved = self.reserved
        return [m for m in models if reserved.get(m, provider) != provider]

    def _reserve_models(self) -> None:
        """Rebuild the exclusive-model table and take newly reserved models away from
        other providers' workers (they are no longer routed there)."""
        reserved: dict[str, str] = {}
        for name in sorted(self.providers):
            for model in self.providers[name].policy.exclusive_models:
                reserved.setdefault(model, name)
        self.reserved = reserved
        now = self.loop.time()
        for worker in list(self.registry.workers.values()):
            taken = self.reserved_for_others(worker.provider, worker.models)
            if taken:
                logger.warning(
                    "worker %r (%s) no longer serves %s: reserved for another provider",
                    worker.name,
                    worker.id,
                    ", ".join(taken),
                )
                keep = [m for m in worker.models if m not in taken]
                self.registry.set_models(worker, keep, now)

    def sync_providers(self, policies: Iterable[ProviderPolicy], *, as_of: float) -> None:
        """Replace the provider set with a snapshot read at loop time ``as_of``.

        Providers touched after the snapshot was taken (a worker authenticated
        against a row created meanwhile) are kept: the snapshot is older than them.
        """
        seen = set()
        for policy in policies:
            seen.add(policy.name)
            current = self.providers.get(policy.name)
            if current is None or current.policy != policy:
                self.set_provider(policy)
        for name in [n for n, s in self.providers.items() if n not in seen and s.touched < as_of]:
            self.remove_provider(name)

    def remove_provider(self, name: str) -> None:
        """The provider was deleted: its queued and in-flight requests fail at once with the
        generic provider error, and its workers are closed."""
        state = self.providers.pop(name, None)
        self._evict_provider(name, ProviderGone, "provider deleted", state)
        self.registry.forget_provider(name)
        if state is not None and state.policy.exclusive_models:
            self._reserve_models()

    def _evict_provider(
        self,
        name: str,
        error: type[RelayError],
        reason: str,
        state: ProviderState | None = None,
    ) -> None:
        """Fail the provider's queue and close its workers; their requests in flight fail
        too (``_requeue`` finds the provider gone or disabled), never wait in a queue."""
        state = state or self.providers.get(name)
        if state is not None:
            for request in state.queue.drain():
                self._finish(request, error())
        for worker in self.registry.of_provider(name):
            self.close_worker(worker, 1008, reason)

    def resolve(self, provider: ProviderState, model: str) -> str:
        """The backend model id ``model`` names at ``provider``: its own alias, else the
        server-wide alias, else the name itself."""
        return provider.policy.aliases.get(model) or self.config.aliases.get(model) or model

    def knows(self, model: str) -> bool:
        """Whether a request for ``model`` would be admitted now (not 404)."""
        try:
            self._candidates(model)
        except ModelNotFound:
            return False
        except RelayError:
            return True  # known, but refused for another reason (a disabled provider)
        return True

    def _candidates(self, model: str) -> list[tuple[ProviderState, str]]:
        """Enabled providers that can serve ``model`` (with the model id it names there,
        after aliases), best first; raises when none.

        Preference: a connected worker advertises it, then the provider declares it,
        then a worker advertised it within ``model_memory``. A model one provider
        declared exclusive is routed to that provider only.
        """
        now = self.loop.time()
        ranked: list[tuple[int, str, ProviderState, str]] = []
        disabled = False
        for name, state in self.providers.items():
            target = self.resolve(state, model)
            owner = self.reserved.get(target)
            if owner is not None and name != owner:
                continue
            if self.registry.serving(name, target) or target in self.remote_models.get(name, ()):
                rank = 0
            elif target in state.policy.declared_models or owner == name:
                rank = 1
            elif self.registry.remembers(name, target, now):
                rank = 2
            else:
                continue
            if not state.policy.enabled:
                disabled = True
                continue
            ranked.append((rank, name, state, target))
        if not ranked:
            if disabled:
                raise ProviderDisabled()
            raise ModelNotFound(model)
        ranked.sort(key=lambda item: (item[0], item[1]))
        return [(state, target) for _, _, state, target in ranked]

    def routable_models(self) -> dict[str, set[str]]:
        """Models a request could be routed for now, aliases included: model -> providers."""
        out: dict[str, set[str]] = {}
        reserved = self.reserved
        for name, state in self.providers.items():
            if not state.policy.enabled:
                continue
            for model in state.policy.declared_models | state.policy.exclusive_models:
                if reserved.get(model, name) == name:
                    out.setdefault(model, set()).add(name)
        served = self.registry.models()
        for name, models in self.remote_models.items():
            for model in models:
                served.setdefault(model, set()).add(name)
        for model, names in served.items():
            for name in names:
                live = self.providers.get(name)
                if live is not None and live.policy.enabled:
                    out.setdefault(model, set()).add(name)
        for name, state in self.providers.items():
            aliases = {**self.config.aliases, **state.policy.aliases}
            for alias, target in aliases.items():
                if name in out.get(target, ()):
                    out.setdefault(alias, set()).add(name)
        return out

    def queue_depth(self, provider: str | None = None) -> int:
        if provider is not None:
            state = self.providers.get(provider)
            return len(state.queue) if state else 0
        return sum(len(s.queue) for s in self.providers.values())

    def _aim(self, request: RelayRequest, state: ProviderState, target: str) -> None:
        """Route ``request`` to ``state``'s provider as model ``target``.

        When an alias applied, the body the worker gets names the backend's model;
        otherwise the client's raw body goes through untouched.
        """
        request.provider = state.policy.name
        if target != request.model:
            request.model = target
            request.body = rewrite_model(request.body, target)

    def _waiting_room(
        self, candidates: list[tuple[ProviderState, str]], request: RelayRequest
    ) -> tuple[ProviderState, str]:
        """The provider whose queue ``request`` waits in when no worker is free now.

        The best-ranked provider that has a connected worker willing to take it, or
        none connected at all (one may come back). When every connected worker of
        every candidate refuses it (a model served only by legacy nodes, a request
        they cannot express), waiting would only end in a timeout: refused now, 400.
        """
        refusal: str | None = None
        for state, target in candidates:
            workers = self.registry.serving_workers(state.policy.name, target)
            if not workers:
                return state, target
            for worker in workers:
                why = worker.refuses(request) if worker.refuses is not None else None
                if why is None:
                    return state, target
                refusal = refusal or why
        raise BadRequest(refusal or "No worker here can take this request")
