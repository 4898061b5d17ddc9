"""A provider's wait queue with priority classes (SPEC §15) over the fair share of §13.

One :class:`~relay.core.fairqueue.FairQueue` per class. When a worker frees a slot it is
offered the highest class first, and inside a class the order of §13: requeued requests
first, then the API keys in weighted turns, FIFO within a key.

**Aging.** A request that has waited longer than the aging bound counts one class higher:
it moves to the front of the next class up (ahead of that class's lanes, behind what was
put back there before it, by arrival), so a stream of ``default`` work can delay a
``flex`` request but never starve it. Each class keeps its requests in arrival order on
a deque as well; the promotion check looks only at the front of each (O(1) amortised,
done on every look at the queue).

A request keeps its class (what it is billed and reported as); its ``rank`` is where it
waits now, and what it counts as once dispatched: every way out of the queue ages it
first (:meth:`ClassedQueue.remove` too, which the cluster's placement takes requests out
by), so a request leaves with the rank its wait earned and preemption
(:mod:`relay.core.preemption`) judges it by that.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from relay.core.classes import CLASSES
from relay.core.fairqueue import FairQueue, LaneKey, Refuses
from relay.core.state import Phase, RelayRequest


class ClassedQueue:
    """Implements :class:`relay.core.queue.WaitQueue`; see the module docstring."""

    __slots__ = ("_aging", "_arrivals", "_clock", "_size", "classes")

    def __init__(self, *, aging: float | None = None, clock: Callable[[], float]) -> None:
        """``aging``: seconds after which a waiting request counts one class higher
        (None: never)."""
        self.classes = [FairQueue() for _ in CLASSES]
        #: Per rank: a heap of (when it started waiting there, seq, request).
        self._arrivals: list[list[tuple[float, int, RelayRequest]]] = [[] for _ in CLASSES]
        self._aging = aging
        self._clock = clock
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def depth_by_class(self) -> dict[str, int]:
        """Queued requests by the class they count as now (aged ones in their new class)."""
        self._age()
        return {name: len(queue) for name, queue in zip(CLASSES, self.classes, strict=True)}

    def push(self, request: RelayRequest) -> None:
        rank = min(max(request.rank, 0), len(CLASSES) - 1)
        request.rank = rank
        self.classes[rank].push(request)
        self._size += 1
        if self._aging is not None and rank > 0:
            heapq.heappush(self._arrivals[rank], (self._clock(), request.seq, request))

    def _age(self) -> None:
        """Promote every request that has waited past the bound in its rank."""
        aging = self._aging
        if aging is None:
            return
        now = self._clock()
        for rank in reversed(range(1, len(CLASSES))):  # lowest first: it may move on up
            arrivals = self._arrivals[rank]
            while arrivals:
                since, seq, request = arrivals[0]
                if request.rank != rank or request.phase is not Phase.QUEUED:
                    heapq.heappop(arrivals)  # it left this rank meanwhile
                    continue
                if now - since < aging:
                    break
                heapq.heappop(arrivals)
                if not self.classes[rank].remove(request):
                    continue
                request.rank = rank - 1
                self.classes[rank - 1].push(request, front=True)
                if rank - 1 > 0:  # counted from when it would have moved up
                    heapq.heappush(self._arrivals[rank - 1], (since + aging, seq, request))

    def pop_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        if not self._size:
            return None
        self._age()
        for queue in self.classes:
            if queue:
                request = queue.pop_for(models, refuses)
                if request is not None:
                    self._size -= 1
                    return request
        return None

    def next_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        self._age()
        for queue in self.classes:
            if queue:
                request = queue.next_for(models, refuses)
                if request is not None:
                    return request
        return None

    def remove(self, request: RelayRequest) -> bool:
        self._age()  # (a request taken out to run leaves with the rank its wait earned)
        rank = request.rank
        if 0 <= rank < len(self.classes) and self.classes[rank].remove(request):
            self._size -= 1
            return True
        for queue in self.classes:  # (not where its rank says: never, but be sure)
            if queue.remove(request):
                self._size -= 1
                return True
        return False

    def __iter__(self) -> Iterator[RelayRequest]:
        """Every queued request, highest class first, each class in its own order."""
        self._age()
        out: list[RelayRequest] = []
        for queue in self.classes:
            out.extend(queue)
        return iter(out)

    def drain(self) -> list[RelayRequest]:
        items = list(self)
        for queue in self.classes:
            queue.drain()
        for arrivals in self._arrivals:
            arrivals.clear()
        self._size = 0
        return items

    def depth_by_key(self) -> dict[LaneKey, int]:
        depth: dict[LaneKey, int] = {}
        for queue in self.classes:
            for key, count in queue.depth_by_key().items():
                depth[key] = depth.get(key, 0) + count
        return depth
