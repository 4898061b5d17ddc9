"""The bounded per-provider wait queue: its interface, and the implementation in use.

The dispatcher (the only caller, always on the event loop) holds one queue per
provider and uses nothing but :class:`WaitQueue`; the bound (MAX_QUEUE_LEN) and the
deadlines are the dispatcher's. The order is the priority classes' first
(:mod:`relay.core.classqueue`: the highest class with a compatible request, a request
waiting past the aging bound counting one class higher), then, within a class,
:mod:`relay.core.fairqueue`'s: requeued
requests first, then API keys in weighted round-robin, FIFO within a key among the
requests the freed worker can serve. Without API keys every request is in one lane
and the order is the plain one: the oldest request whose model the worker was acked
for, a request put back after its worker died ahead of every later arrival. A worker
that refuses some requests (a legacy node) is passed those, as if their model were not its.

**Across server processes** (cluster mode) the shared queue in Redis keeps the same
order: per-key lanes, one ring of keys per provider with credits and weights, and a
requeued lane that goes first, each change one atomic Lua script
(:mod:`relay.server.cluster.state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from relay.core.classqueue import ClassedQueue
from relay.core.fairqueue import Refuses
from relay.core.state import RelayRequest


class WaitQueue(Protocol):
    """What the dispatcher needs of a provider's queue."""

    def __len__(self) -> int:
        """Requests waiting."""

    def push(self, request: RelayRequest) -> None:
        """A new arrival, or a request put back after losing its worker (it has a
        ``worker_id``): the latter goes ahead of every lane."""

    def pop_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        """Take the request a worker serving ``models`` gets next, and charge that
        request's key for its turn; None when nothing waiting is compatible. A picky
        worker (``refuses``, see :attr:`Worker.refuses`) is passed what it refuses."""

    def next_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        """What :meth:`pop_for` would take, without taking it."""

    def remove(self, request: RelayRequest) -> bool:
        """Take out a request that stopped waiting (cancel, timeout, placed elsewhere);
        False when it was not queued."""

    def __iter__(self) -> Iterator[RelayRequest]:
        """A snapshot of the waiting requests in dispatch order (safe to remove from
        the queue while iterating it)."""

    def drain(self) -> list[RelayRequest]:
        """Empty the queue and return what it held."""

    def depth_by_key(self) -> dict[int | None, int]:
        """Waiting requests per API key id (None: sent without a key)."""


ProviderQueue = ClassedQueue

__all__ = ["ProviderQueue", "WaitQueue"]
