"""Where a batch line may run now: free slots nobody else waits for.

A line is only claimed for a model with a free slot on a worker of this process, and
only started while one is free: it never waits in the shared queue ahead of an
interactive request, and never makes that queue refuse one (429). In cluster mode
the slots of the other processes' workers are not known here: a line is claimed for
any routable model while the shared queue is empty, and one waits for a placement
at a time.

``spare`` (BATCH_SPARE_SLOTS) free slots per model are left alone: a request that
arrives while every other slot runs a batch line starts at once instead of waiting
for one to end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from relay.core.relay import Relay
from relay.server.batches.claims import Claimed
from relay.server.batches.execute import Running


def free_slots(relay: Relay, model: str) -> int:
    """Slots free now on this process's workers for ``model`` (as clients name it)."""
    free = 0
    for name, state in relay.providers.items():
        if not state.policy.enabled:
            continue
        target = relay.resolve(state, model)
        owner = relay.reserved.get(target)
        if owner is not None and owner != name:
            continue
        for worker in relay.registry.serving_workers(name, target):
            if not worker.draining:
                free += max(0, worker.max_concurrent - worker.load)
    return free


def claimable_models(relay: Relay, shared_queue_depth: int | None, spare: int = 0) -> set[str]:
    """Models a line may be claimed for now (``shared_queue_depth``: cluster mode's
    shared queue as last seen, None in a single process)."""
    routable = relay.routable_models()
    if shared_queue_depth is not None:
        return set(routable) if shared_queue_depth == 0 else set()
    return {model for model in routable if free_slots(relay, model) > spare}


def startable(
    relay: Relay,
    ready: list[Claimed],
    running: list[Running],
    *,
    now: float,
    room: int,
    shared_queue_depth: int | None,
    key_cap: Callable[[int], int | None],
    spare: int = 0,
) -> list[Claimed]:
    """The claimed lines to start now, in order: at most ``room``, each on a free slot
    of its model not spoken for by a line still being admitted, none of a key past
    ``key_cap`` (its lines that may run at once; None: no cap). In cluster mode: one
    line while none waits for a placement and the shared queue is empty."""
    per_key: Counter[int | None] = Counter(run.line.key_id for run in running)
    starting: Counter[str] = Counter(run.line.model for run in running if run.request is None)
    budget: dict[str, int] = {}
    chosen: list[Claimed] = []
    for line in ready:
        if len(chosen) >= room:
            break
        if line.not_before > now:
            continue
        if line.key_id is not None:
            cap = key_cap(line.key_id)
            if cap is not None and per_key[line.key_id] >= cap:
                continue
        if shared_queue_depth is not None:
            waiting = any(run.request is None or run.request.worker is None for run in running)
            if shared_queue_depth == 0 and not waiting:
                chosen.append(line)
            break
        if line.model not in budget:
            free = free_slots(relay, line.model) - spare
            budget[line.model] = free - starting[line.model]
        if budget[line.model] <= 0:
            continue
        budget[line.model] -= 1
        per_key[line.key_id] += 1
        chosen.append(line)
    return chosen
