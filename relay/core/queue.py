"""The bounded per-provider wait queue.

Ordered by first arrival (``seq``), so a request put back after its worker died goes
ahead of every request that arrived after it. FIFO holds among requests a given
worker can serve: :meth:`ProviderQueue.next_for` returns the oldest one whose model
the worker was acked for and that it does not refuse.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from relay.core.state import RelayRequest


class ProviderQueue:
    __slots__ = ("_items", "_seqs")

    def __init__(self) -> None:
        self._items: list[RelayRequest] = []
        self._seqs: list[int] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[RelayRequest]:
        return iter(list(self._items))

    def push(self, request: RelayRequest) -> None:
        """Insert in arrival order (O(1) for new arrivals, O(n) for requeues)."""
        if not self._seqs or request.seq > self._seqs[-1]:
            self._items.append(request)
            self._seqs.append(request.seq)
            return
        index = bisect.bisect_left(self._seqs, request.seq)
        self._items.insert(index, request)
        self._seqs.insert(index, request.seq)

    def remove(self, request: RelayRequest) -> bool:
        index = bisect.bisect_left(self._seqs, request.seq)
        if index < len(self._items) and self._items[index] is request:
            del self._items[index]
            del self._seqs[index]
            return True
        return False

    def next_for(
        self,
        models: frozenset[str],
        refuses: Callable[[RelayRequest], str | None] | None = None,
    ) -> RelayRequest | None:
        for request in self._items:
            if request.model in models and (refuses is None or refuses(request) is None):
                return request
        return None

    def drain(self) -> list[RelayRequest]:
        items = self._items
        self._items = []
        self._seqs = []
        return items
