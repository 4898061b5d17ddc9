"""Connected workers: identity, acked models, capacity, load and drain state.

The registry only answers questions and records facts; the dispatcher decides.
Selection is "lowest load, round-robin among equals" over non-draining workers that
were acked for the model and have a free slot (see :attr:`Worker.load`).

A worker with the ``model_states`` extension (SPEC §19, models on demand) is acked for
every model its backend can serve, but routed only the ones it has loaded: those are
its ``model_set`` and are indexed for selection; the others (loadable, loading,
asleep) are indexed apart, so a request for them is known (queued, not 404) and the
dispatcher can choose where to load them.

It also remembers, for MODEL_MEMORY_SECS, which models a vanished worker served, so
a request for them queues while the worker restarts. That memory is keyed by names
workers chose, so it is bounded: entries expire in order and the oldest go first
when it is full.
"""

from __future__ import annotations

import itertools

from relay.core.state import RelayRequest, Worker
from relay.wire.protocol import LOADED

#: Most (provider, model) pairs remembered after their last worker left.
MAX_REMEMBERED_MODELS = 10_000


def sanitize_models(raw: list[str], *, cap: int, max_len: int) -> tuple[list[str], list[str]]:
    """Trim, drop empty and over-long names, de-duplicate keeping first-seen order, cap.

    Returns the accepted list and one warning per kind of change, so a worker can be
    told exactly what was not accepted.
    """
    accepted: list[str] = []
    seen: set[str] = set()
    trimmed = empty = too_long = duplicates = dropped = 0
    for name in raw:
        clean = name.strip()
        if clean != name:
            trimmed += 1
        if not clean:
            empty += 1
            continue
        if len(clean) > max_len:
            too_long += 1
            continue
        if clean in seen:
            duplicates += 1
            continue
        if len(accepted) >= cap:
            dropped += 1
            continue
        seen.add(clean)
        accepted.append(clean)
    warnings: list[str] = []
    if trimmed:
        warnings.append(f"trimmed whitespace from {trimmed} model name(s)")
    if empty:
        warnings.append(f"dropped {empty} empty model name(s)")
    if too_long:
        warnings.append(f"dropped {too_long} model name(s) longer than {max_len} characters")
    if duplicates:
        warnings.append(f"dropped {duplicates} duplicate model name(s)")
    if dropped:
        warnings.append(f"accepted only the first {cap} models; dropped {dropped}")
    return accepted, warnings


def routable(worker: Worker) -> frozenset[str]:
    """The models requests may be routed to ``worker`` for now: every acked one, or with
    the ``model_states`` extension the acked ones its backend has loaded."""
    states = worker.states
    if states is None:
        return frozenset(worker.models)
    return frozenset(m for m in worker.models if states.get(m) == LOADED)


_worker_ids = itertools.count(1)


class Registry:
    """Workers by id, indexed by ``(provider, model)`` for O(candidates) selection."""

    def __init__(self, *, model_memory: float, max_remembered: int = MAX_REMEMBERED_MODELS) -> None:
        self.workers: dict[str, Worker] = {}
        #: (provider, model) -> the workers routed it now (loaded there).
        self._by_model: dict[tuple[str, str], list[Worker]] = {}
        #: (provider, model) -> the workers acked for it that do not have it loaded.
        self._held: dict[tuple[str, str], list[Worker]] = {}
        self._cursor: dict[str, int] = {}
        #: (provider, model) -> when its last worker left; oldest first (insertion order).
        self._last_seen: dict[tuple[str, str], float] = {}
        self._model_memory = model_memory
        self._max_remembered = max_remembered

    # -- membership -----------------------------------------------------------

    def add(self, worker: Worker) -> None:
        worker.model_set = routable(worker)
        self.workers[worker.id] = worker
        self._index(worker)

    def remove(self, worker: Worker, now: float) -> None:
        if self.workers.pop(worker.id, None) is None:
            return
        self._unindex(worker, now)
        worker.attached = False

    def set_models(self, worker: Worker, models: list[str], now: float) -> None:
        self._unindex(worker, now)
        worker.models = tuple(models)
        if worker.states is not None:
            acked = set(models)
            worker.states = {m: s for m, s in worker.states.items() if m in acked}
        worker.model_set = routable(worker)
        self._index(worker)

    def set_states(self, worker: Worker, states: dict[str, str], now: float) -> None:
        """The worker's models changed state (``model_states``): route it what it has
        loaded now. ``states`` holds acked models only."""
        self._unindex(worker, now)
        worker.states = states
        worker.model_set = routable(worker)
        self._index(worker)

    def _index(self, worker: Worker) -> None:
        if not worker.attached or self.workers.get(worker.id) is not worker:
            return
        loaded = worker.model_set
        for model in worker.models:
            key = (worker.provider, model)
            index = self._by_model if model in loaded else self._held
            index.setdefault(key, []).append(worker)
            self._last_seen.pop(key, None)  # served again: nothing to remember

    def _unindex(self, worker: Worker, now: float) -> None:
        for model in worker.models:
            key = (worker.provider, model)
            for index in (self._by_model, self._held):
                bucket = index.get(key)
                if bucket is None:
                    continue
                try:
                    bucket.remove(worker)
                except ValueError:
                    continue
                if not bucket:
                    del index[key]
            if key not in self._by_model and key not in self._held:
                self._last_seen.pop(key, None)
                self._last_seen[key] = now  # re-inserted: the newest entry
        self.forget_expired(now)

    def remember(self, provider: str, model: str, now: float) -> None:
        """Keep ``model`` known for MODEL_MEMORY_SECS (its last worker, elsewhere, left)."""
        key = (provider, model)
        self._last_seen.pop(key, None)
        self._last_seen[key] = now
        self.forget_expired(now)

    def forget_expired(self, now: float) -> None:
        """Drop remembered models older than the memory, and the oldest beyond the cap."""
        seen = self._last_seen
        while seen:
            key, at = next(iter(seen.items()))
            if now - at <= self._model_memory and len(seen) <= self._max_remembered:
                return
            del seen[key]

    # -- queries --------------------------------------------------------------

    def select(
        self, provider: str, model: str, request: RelayRequest | None = None
    ) -> Worker | None:
        """The worker that should take the next request for ``model``, or ``None``.

        Lowest load wins; among equally loaded workers the provider's cursor rotates
        so consecutive requests spread out. Workers that refuse ``request`` (see
        :attr:`Worker.refuses`) are passed over. The caller must reserve the slot
        before yielding to the event loop.
        """
        candidates = self._by_model.get((provider, model))
        if not candidates:
            return None
        best: list[Worker] = []
        best_load = 1 << 62
        for worker in candidates:
            if worker.draining:
                continue
            load = worker.load
            if load >= worker.max_concurrent:
                continue
            if request is not None and worker.refuses is not None and worker.refuses(request):
                continue
            if load < best_load:
                best_load = load
                best = [worker]
            elif load == best_load:
                best.append(worker)
        if not best:
            return None
        if len(best) == 1:
            return best[0]
        cursor = self._cursor.get(provider, 0)
        self._cursor[provider] = cursor + 1
        return best[cursor % len(best)]

    def workers_by_model(self, now: float) -> dict[tuple[str, str], int]:
        """(provider, model) -> connected workers acked for it (its model loaded there or
        not); 0 for a model none serves now that one served within the model memory
        (for ``/metrics``)."""
        counts = {key: 0 for key, at in self._last_seen.items() if now - at <= self._model_memory}
        for index in (self._by_model, self._held):
            for key, workers in index.items():
                counts[key] = counts.get(key, 0) + len(workers)
        return counts

    def eligible(self, provider: str, model: str, request: RelayRequest) -> list[Worker]:
        """The workers that could take ``request`` now (what :meth:`select` chooses
        among): not draining, a free slot, not refusing it."""
        out = []
        for worker in self._by_model.get((provider, model), ()):
            if worker.draining or worker.load >= worker.max_concurrent:
                continue
            if worker.refuses is not None and worker.refuses(request):
                continue
            out.append(worker)
        return out

    def serving_workers(self, provider: str, model: str) -> list[Worker]:
        """The connected workers of ``provider`` acked for ``model`` (busy or not, its
        model loaded or not)."""
        return [*self._by_model.get((provider, model), ()), *self._held.get((provider, model), ())]

    def loaded_workers(self, provider: str, model: str) -> list[Worker]:
        """The connected workers of ``provider`` routed ``model`` now (busy or not)."""
        return list(self._by_model.get((provider, model), ()))

    def holders(self, provider: str, model: str) -> list[Worker]:
        """The connected workers of ``provider`` acked for ``model`` that do not have it
        loaded (models on demand: where it could be loaded)."""
        return list(self._held.get((provider, model), ()))

    def serving(self, provider: str, model: str) -> bool:
        """True when a connected worker of ``provider`` was acked for ``model`` (loaded
        there or not: a request for it waits for a load rather than a 404)."""
        key = (provider, model)
        return key in self._by_model or key in self._held

    def loaded(self, provider: str, model: str) -> bool:
        """True when a connected worker of ``provider`` has ``model`` loaded."""
        return (provider, model) in self._by_model

    def remembers(self, provider: str, model: str, now: float) -> bool:
        seen = self._last_seen.get((provider, model))
        return seen is not None and now - seen <= self._model_memory

    def remembered(self) -> int:
        """How many (provider, model) pairs are remembered (expired ones may linger
        until the next :meth:`forget_expired`)."""
        return len(self._last_seen)

    def models(self) -> dict[str, set[str]]:
        """Models served now, loaded or loadable: model -> providers with a connected
        worker acked for it."""
        out: dict[str, set[str]] = {}
        for provider, model in itertools.chain(self._by_model, self._held):
            out.setdefault(model, set()).add(provider)
        return out

    def loadable(self) -> set[tuple[str, str]]:
        """(provider, model) pairs some connected worker holds but none has loaded."""
        return {key for key in self._held if key not in self._by_model}

    def of_provider(self, provider: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.provider == provider]

    def forget_provider(self, provider: str) -> None:
        for key in [k for k in self._last_seen if k[0] == provider]:
            del self._last_seen[key]


def next_worker_id(prefix: str) -> str:
    """A short id unique within this process and unlikely to collide across processes."""
    return f"w-{prefix}{next(_worker_ids):x}"
