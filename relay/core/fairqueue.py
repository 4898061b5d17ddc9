"""A provider's wait queue, shared fairly between API keys (SPEC §6, §13).

Order, when a worker that serves the models ``M`` has a free slot (:meth:`FairQueue.pop_for`):

1. **Requeued requests first.** A request put back after its worker was lost (it was
   dispatched before: it has a ``worker_id``) goes ahead of everything, oldest
   arrival first. It already had its turn; it is not charged another.
2. **Then the keys take turns** (weighted round-robin, unit cost: deficit round robin
   where every request costs one). Each key with requests waiting has a *lane*;
   requests without a key share one anonymous lane. The active lanes form a ring.
   The first lane in ring order that holds a request the worker can serve gives its
   oldest such request; that costs the lane one *credit*, and a lane whose credit
   runs out goes to the back of the ring with its credit refilled to its weight.
   A lane that empties leaves the ring; a lane that becomes active joins at the back
   with full credit. Lanes the worker can serve nothing of are skipped and keep
   their place, so the next worker that can serve them finds them in front.
3. **FIFO within a key** among the requests the worker can serve: each lane keeps one
   FIFO per model, and the oldest head among the worker's models wins.

With a single lane (keys off, or one busy key) this is exactly the old rule: the
oldest request whose model the worker serves.

**Bound.** Let ``r`` be a request of key B that arrives while B's lane is empty, and
let ``w_k`` be the weight of each other key k with requests waiting at that moment.
Before ``r`` is dispatched, at most ``w_k`` requests of each such key k, and none of
any key that became active after ``r`` arrived, are dispatched to workers that can
serve ``r`` — plus any requeued requests. With every weight 1 (the default): ``r``
waits behind at most one request per other active key, per freed slot, however many
requests those keys have queued. Proof sketch: every lane ahead of B's in the ring
moves behind it after spending its credit (at most its weight); a worker that can
serve ``r`` scans from the front and reaches B's lane before any lane behind it; a
lane that joins later joins behind B's. While B keeps requests queued, each of B's
turns (``w_B`` requests) is separated by at most ``w_k`` requests of each other lane.

**Cost.** :meth:`push`, :meth:`remove` and dispatching from the first lane are O(1)
(one ``OrderedDict`` per (key, model); the ring is an ``OrderedDict`` too).
:meth:`pop_for` scans only active lanes, and only as far as the first one holding
something the worker serves (plus the lane's own models, usually one), never the
whole queue. Requeued requests sit in a short list sorted by arrival.

See :mod:`relay.core.queue` for the interface and how a cluster-wide queue in Redis
would keep the same order.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from relay.core.state import RelayRequest

#: The lane of requests sent without an API key.
ANONYMOUS = None

LaneKey = int | None

#: :attr:`relay.core.state.Worker.refuses` of the worker asking, or None (it takes
#: every request of its models).
Refuses = Callable[[RelayRequest], str | None] | None


def weight_of(request: RelayRequest) -> int:
    """The fair-share weight ``request`` was admitted with (1 without a key)."""
    ticket = request.ticket
    return 1 if ticket is None else ticket.weight


class _Lane:
    """One key's waiting requests: a FIFO per model, and its credit in the current turn."""

    __slots__ = ("credit", "fifos", "size", "weight")

    def __init__(self, weight: int) -> None:
        self.weight = weight
        self.credit = weight
        self.size = 0
        self.fifos: dict[str, OrderedDict[int, RelayRequest]] = {}

    def oldest_for(self, models: frozenset[str], refuses: Refuses) -> RelayRequest | None:
        best: RelayRequest | None = None
        for model, fifo in self.fifos.items():
            if model not in models:
                continue
            if refuses is None:
                head: RelayRequest | None = next(iter(fifo.values()))
            else:  # a picky worker: the oldest of this model it does not refuse
                head = next((r for r in fifo.values() if refuses(r) is None), None)
            if head is not None and (best is None or head.seq < best.seq):
                best = head
        return best

    def discard(self, request: RelayRequest) -> bool:
        fifo = self.fifos.get(request.model)
        if fifo is None or fifo.get(request.seq) is not request:
            return False
        del fifo[request.seq]
        if not fifo:
            del self.fifos[request.model]
        self.size -= 1
        return True

    def in_order(self) -> Iterator[RelayRequest]:
        """The lane's requests, oldest first (across its models)."""
        return heapq.merge(*(f.values() for f in self.fifos.values()), key=_seq)


def _seq(request: RelayRequest) -> int:
    return request.seq


class FairQueue:
    """Implements :class:`relay.core.queue.WaitQueue`; see the module docstring."""

    __slots__ = ("_requeued", "_requeued_seqs", "_ring", "_size")

    def __init__(self) -> None:
        #: Active lanes in turn order: the first one is the lane whose turn it is.
        self._ring: OrderedDict[LaneKey, _Lane] = OrderedDict()
        self._requeued: list[RelayRequest] = []
        self._requeued_seqs: list[int] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, request: RelayRequest, *, front: bool = False) -> None:
        """Queue a new arrival at the back of its key's lane, or a requeued request
        (one dispatched before) ahead of every lane, in arrival order; ``front`` puts
        any request there (one promoted from a lower class after waiting long)."""
        self._size += 1
        if front or request.worker_id is not None:
            index = bisect.bisect_left(self._requeued_seqs, request.seq)
            self._requeued.insert(index, request)
            self._requeued_seqs.insert(index, request.seq)
            return
        key = request.key_id
        weight = weight_of(request)
        lane = self._ring.get(key)
        if lane is None:
            lane = self._ring[key] = _Lane(weight)  # joins at the back of the ring
        elif lane.weight != weight:  # the key's weight was changed meanwhile
            lane.weight = weight
            lane.credit = min(lane.credit, weight)
        fifo = lane.fifos.get(request.model)
        if fifo is None:
            fifo = lane.fifos[request.model] = OrderedDict()
        fifo[request.seq] = request
        lane.size += 1

    def pop_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        """Take the request a worker serving ``models`` gets next, charging its key's
        turn; None when nothing queued is compatible. A worker with ``refuses`` is
        passed the requests it would refuse, as if their model were not its."""
        if not self._size:
            return None
        for index, request in enumerate(self._requeued):
            if request.model in models and (refuses is None or refuses(request) is None):
                del self._requeued[index]
                del self._requeued_seqs[index]
                self._size -= 1
                return request
        for key, lane in self._ring.items():
            found = lane.oldest_for(models, refuses)
            if found is not None:
                self._charge(key, lane, found)
                return found
        return None

    def _charge(self, key: LaneKey, lane: _Lane, request: RelayRequest) -> None:
        """``request`` leaves ``lane`` for a worker: one credit of the lane's turn."""
        lane.discard(request)
        self._size -= 1
        if not lane.size:
            del self._ring[key]  # (iteration over the ring stops right after this)
        else:
            lane.credit -= 1
            if lane.credit <= 0:
                lane.credit = lane.weight
                self._ring.move_to_end(key)

    def next_for(self, models: frozenset[str], refuses: Refuses = None) -> RelayRequest | None:
        """The request :meth:`pop_for` would take, left in place (nothing is charged)."""
        for request in self._requeued:
            if request.model in models and (refuses is None or refuses(request) is None):
                return request
        for lane in self._ring.values():
            found = lane.oldest_for(models, refuses)
            if found is not None:
                return found
        return None

    def remove(self, request: RelayRequest) -> bool:
        """Take out a request that is no longer waiting (cancelled, timed out, or
        placed by the caller); its key's turn is not charged. False if not queued."""
        lane = self._ring.get(request.key_id)
        if lane is not None and lane.discard(request):
            self._size -= 1
            if not lane.size:
                del self._ring[request.key_id]
            return True
        index = bisect.bisect_left(self._requeued_seqs, request.seq)
        if index < len(self._requeued) and self._requeued[index] is request:
            del self._requeued[index]
            del self._requeued_seqs[index]
            self._size -= 1
            return True
        return False

    def __iter__(self) -> Iterator[RelayRequest]:
        """A snapshot of every queued request, in the order :meth:`pop_for` would take
        them if every worker served every model (the caller may remove while iterating)."""
        out = list(self._requeued)
        turns = deque(
            (lane.in_order(), lane.size, lane.credit, lane.weight) for lane in self._ring.values()
        )
        while turns:
            requests, left, credit, weight = turns.popleft()
            take = min(credit, left)
            out.extend(next(requests) for _ in range(take))
            if left > take:
                turns.append((requests, left - take, weight, weight))
        return iter(out)

    def drain(self) -> list[RelayRequest]:
        """Empty the queue; returns what it held."""
        items = list(self)
        self._ring.clear()
        self._requeued.clear()
        self._requeued_seqs.clear()
        self._size = 0
        return items

    def depth_by_key(self) -> dict[LaneKey, int]:
        """Queued requests per API key id (None: no key), requeued ones included."""
        depth = {key: lane.size for key, lane in self._ring.items()}
        for request in self._requeued:
            depth[request.key_id] = depth.get(request.key_id, 0) + 1
        return depth
