"""Models on demand (SPEC §19): the choices made from workers' reported states — plain
functions, no clock and no I/O (the records they read, :class:`ModelOp` and
:class:`ModelCounts`, live on the worker: :mod:`relay.core.state`).

:mod:`relay.core.residency` decides *when* (a request waits, a load ends) and calls
these to decide *where*: which worker loads a model (:func:`load_target`) and which
model makes room (:func:`idle_model`). The cluster makes the same choices in Redis
(``relay/server/cluster/lua/want.lua``) from what each process announces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from relay.core.state import ModelCounts, Worker
from relay.wire import protocol
from relay.wire.protocol import LOADED, LOADING, SLEEPING

#: States that take one of the backend's model slots.
RESIDENT = frozenset({LOADED, LOADING})


@dataclass(slots=True)
class Episode:
    """A model loaded nowhere that requests wait for: the worker loading it (None while
    none could be chosen) and the workers whose load of it failed meanwhile."""

    worker_id: str | None = None
    tried: set[str] = field(default_factory=set)


def sanitize_states(worker: Worker, states: Iterable[protocol.ModelState]) -> dict[str, str]:
    """A ``model_states`` list as the relay keeps it: acked models only (a state for
    anything else is dropped), the first state given for each. (Per-model slots are not
    used: the worker's ``max_concurrent`` covers its loaded models together.)"""
    acked = set(worker.models)
    out: dict[str, str] = {}
    for entry in states:
        model = entry.model.strip()
        if model in acked and model not in out:
            out[model] = entry.state
    return out


def counts(worker: Worker, model: str) -> ModelCounts:
    """``worker``'s counters for ``model`` (created on first use; acked models only)."""
    found = worker.model_counts.get(model)
    if found is None:
        found = worker.model_counts[model] = ModelCounts()
    return found


def resident(worker: Worker) -> int:
    """How many of ``worker``'s models are loaded or loading (its model slots used)."""
    return sum(1 for s in (worker.states or {}).values() if s in RESIDENT)


def busy_with(worker: Worker, model: str) -> bool:
    """An operation for ``model`` (or one that ends in loading it) is under way."""
    return any(op.model == model or op.then == model for op in worker.ops.values())


def idle_model(worker: Worker, queued: set[str]) -> str | None:
    """``worker``'s least recently used loaded model that nothing runs on there, nothing
    waits for (``queued``: the models requests wait for) and no operation touches; None
    when every one is busy."""
    states = worker.states or {}
    running = {r.model for r in worker.in_flight.values()}
    touched = {op.model for op in worker.ops.values()}
    idle = [
        m
        for m, s in states.items()
        if s == LOADED and m not in running and m not in queued and m not in touched
    ]
    if not idle:
        return None
    return min(idle, key=lambda m: worker.used.get(m, 0.0))


def load_target(
    holders: Iterable[Worker], model: str, tried: set[str], queued: set[str]
) -> tuple[Worker, str | None] | None:
    """Where to load ``model`` now, among the workers holding it: one with a free model
    slot (where it sleeps first: waking is faster; then the least loaded, then the one
    with the fewest models in memory), else one that can unload an idle model (the one
    whose idle model was used longest ago): the worker and that model. Draining workers,
    those in ``tried`` and those already busy with ``model`` are passed over."""
    free: list[tuple[int, int, int, Worker]] = []
    evictable: list[tuple[float, Worker, str]] = []
    for worker in holders:
        if worker.draining or worker.id in tried or busy_with(worker, model):
            continue
        used = resident(worker)
        capacity = worker.model_capacity
        if capacity is None or used < capacity:
            asleep = 0 if (worker.states or {}).get(model) == SLEEPING else 1
            free.append((asleep, worker.load, used, worker))
            continue
        victim = idle_model(worker, queued)
        if victim is not None:
            evictable.append((worker.used.get(victim, 0.0), worker, victim))
    if free:
        return min(free, key=lambda c: c[:3])[3], None
    if evictable:
        _, worker, victim = min(evictable, key=lambda c: c[0])
        return worker, victim
    return None
