"""Cluster mode: requests placed across every server process sharing one Redis (SPEC §11).

:class:`RedisPlacement` implements :class:`relay.core.placement.Placement` for the
dispatcher. Each decision is one atomic script (:mod:`relay.server.cluster.scripts`):

- a request admitted here reserves the least-loaded slot of the whole cluster (among
  equals, one of this process's own workers), or joins the provider's shared queue;
- when a slot frees on a worker connected here, it is released and, in the same step,
  given to the compatible request queued anywhere whose turn it is;
- a slot found for a request of another process is announced on that process's channel
  *and* recorded in Redis, where that process reads it back if the notice was lost.

A request placed on a worker of another process is assigned to a stand-in worker whose
link forwards it there (:mod:`relay.server.cluster.proxy`); a request placed here by
another process arrives through :func:`relay.server.http.inference.placed_here`.

It converges back by itself after any partial failure: its control loop is
:mod:`relay.server.cluster.convergence`; requests of a class above ``flex`` ask the
other processes for a slot a ``flex`` request may give up (:mod:`relay.server.cluster.preempt`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Coroutine
from typing import Any

from relay.core.classes import FLEX_RANK
from relay.core.fairqueue import weight_of
from relay.core.legacy.tasks import refusal
from relay.core.relay import Relay
from relay.core.state import Phase, RelayRequest, Worker
from relay.server.cluster.convergence import LEASE_MARGIN_MS, TROUBLE, Convergence, now_ms
from relay.server.cluster.loads import ClusterLoads
from relay.server.cluster.preempt import ClusterPreemption
from relay.server.cluster.proxy import ProxyPool
from relay.server.cluster.redissource import RedisSource, source_of
from relay.server.cluster.speeds import ClusterSpeeds
from relay.server.cluster.state import (
    ClusterState,
    Placed,
    lane_of,
)
from relay.wire.errors import QueueFull

logger = logging.getLogger("relay.cluster")

#: How often this process re-asserts its keys, and how long they outlive it; how often
#: it shares its workers' speeds.
TICK_SECS = 1.0
TTL_SECS = 5.0
SHARE_SECS = 5.0


class RedisPlacement(Convergence, ClusterPreemption, ClusterLoads, ClusterSpeeds):
    def __init__(
        self,
        relay: Relay,
        redis: str | RedisSource,
        prefix: str,
        token: str,
        *,
        tick: float = TICK_SECS,
        ttl: float = TTL_SECS,
        share_speeds: float = SHARE_SECS,
        local_slack: int = 0,
    ) -> None:
        """``redis``: where Redis is (the process's :class:`RedisSource`, or a URL);
        ``tick``: how often the control loop runs; ``ttl``: how long this process's
        keys outlive its last tick (CLUSTER_TICK_SECS, CLUSTER_TTL_SECS);
        ``share_speeds``: how often it shares the speeds it learned (RATES_SHARE_SECS);
        ``local_slack``: how many requests in flight more than the least loaded worker a
        worker of this process may have and still take a request that arrived here
        (CLUSTER_LOCAL_SLACK)."""
        self.relay = relay
        self.local_slack = local_slack
        self.instance = relay.instance
        self.tick = tick
        self.ttl_ms = max(1, int(ttl * 1000))
        aging = relay.config.priority_aging
        #: Priority classes (SPEC §15): the aging bound the shared queue applies (0: none).
        self.aging_ms = 0 if aging is None else max(1, int(aging * 1000))
        # Named, so that CLIENT LIST tells each process's connections and their roles apart
        # (this pool also holds the pub/sub connection). Every call bounded by the
        # source's timeout: a Redis that stops answering makes this process degraded.
        source = source_of(redis)
        self.redis = source.client(f"modelrelay:{self.instance}:cluster")
        #: The per-request scripts' own connection (None: they use ``self.redis``).
        self.lean = source.lean(f"modelrelay:{self.instance}:place")
        # A new master may lack the last writes (asynchronous replication): re-assert
        # everything at once, as after a flush.
        source.on_switch(self.master_switched)
        self.state = ClusterState(self.redis, prefix, self.lean)
        self.proxies = ProxyPool(relay, token, self._release_unsent, self._unreachable)
        #: What this process shows the others of its token (never the token itself).
        self.credentials = hashlib.sha256(token.encode()).hexdigest()[:32]
        #: Where the other processes reach this one (set once the server listens).
        self.address: str | None = None
        self._listening = asyncio.Event()
        #: Our requests waiting for a slot, by entry id (``<instance>|<request id>``).
        self.waiting: dict[str, RelayRequest] = {}
        #: Entries whose ``place`` call has not come back yet.
        self._placing: set[str] = set()
        #: Leases of local workers released while Redis could not hear it, by worker.
        self._released: dict[str, set[str]] = {}
        #: Entries withdrawn while Redis could not hear it: entry -> (provider, lane).
        self._withdrawn: dict[str, tuple[str, str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poke = asyncio.Event()
        self._announcing = asyncio.Lock()
        #: "joining", "ok" or "degraded"; ``problem`` says why it is not "ok".
        self.status = "joining"
        self.problem = "not connected yet"
        self.since = time.time()
        #: Times this process came back to "ok" after being degraded.
        self.recoveries = 0
        #: Requests waiting in the shared queues of our providers, as of the last tick.
        self.queue_depth = 0
        #: Set when the server stops: its workers are offered as draining from then on.
        self._leaving = False
        self._asks = itertools.count()
        #: Set when Redis answers again: asks for a preemption may have been lost meanwhile.
        self._reask = False
        self._init_loads()
        self._init_speeds(share_speeds)

    # -- the Placement protocol ------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.status == "ok"

    def place(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        self.waiting[entry] = request
        self._spawn(self._place(entry, request))
        if self._leaving:
            self._serve_own()

    def withdraw(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        if self.waiting.pop(entry, None) is not None:
            lane = lane_of(request.service_class, request.key_id, request.worker_id is not None)
            self._spawn(self._withdraw(entry, request.provider, lane))

    def freed(self, worker: Worker, lease: str | None) -> None:
        if not self.active:
            if lease:  # Redis hears of it with the next tick that gets through
                self._released.setdefault(worker.id, set()).add(lease)
            return
        self._spawn(self._release(worker.id, lease or ""))
        if self._leaving:
            self._serve_own()

    def worker_changed(self, worker: Worker) -> None:
        self._spawn(self._refresh(worker.id))

    def worker_gone(self, worker: Worker) -> None:
        self._released.pop(worker.id, None)
        self._spawn(self.state.remove_worker(self.instance, worker.id))

    # -- placing ---------------------------------------------------------------------

    def _entry(self, request: RelayRequest) -> str:
        return f"{self.instance}|{request.id}"

    async def _place(self, entry: str, request: RelayRequest) -> None:
        if request.phase is not Phase.QUEUED or self.waiting.get(entry) is not request:
            return
        policy = self.relay.providers.get(request.provider)
        # A request put back after its worker was lost keeps its place and its room.
        requeued = request.worker_id is not None
        now = self.relay.loop.time()
        self._placing.add(entry)
        try:
            affinity = request.affinity
            costs, default_cost = "", (0.0, 0.0)
            if self.relay.router.predicts or request.first_token_by:
                costs, default_cost = self.costs(request)  # (SPEC §21)
            kind, placed, order, spilled = await self.state.place(
                provider=request.provider,
                model=request.model,
                entry=entry,
                origin=self.instance,
                now_ms=now_ms(),
                deadline_ms=now_ms() + int(max(0.0, request.queue_deadline - now) * 1000),
                hold_ms=int(max(0.0, request.deadline - now) * 1000) + LEASE_MARGIN_MS,
                seq=request.cluster_seq,
                max_queue=-1 if requeued or policy is None else policy.policy.max_queue_len,
                plain=refusal(request) is None,
                lane=lane_of(request.service_class, request.key_id, requeued),
                weight=weight_of(request),
                service_class=request.service_class,
                anchor=affinity.anchor() if affinity is not None else "",
                load_factor=self.relay.config.affinity.load_factor,
                load_slack=self.relay.config.affinity.load_slack,
                anchor_ttl_ms=int(self.relay.config.affinity.cluster_ttl * 1000),
                costs=costs,
                default_cost=default_cost,
                local_slack=self.local_slack,
            )
        except TROUBLE as exc:
            self._trouble(exc)  # it waits here; this process's workers take it
            return
        finally:
            self._placing.discard(entry)
        request.cluster_seq = order
        if spilled and affinity is not None:
            affinity.decision = "guard"
        logger.debug("placing %s: %s %s (order %d)", entry, kind, placed, order)
        if kind == "placed":
            assert placed is not None
            self._take(entry, placed, held=True)
        elif kind == "queued" and request.rank < FLEX_RANK:
            await self._want_slot(request)
        elif kind == "full":
            self.waiting.pop(entry, None)
            logger.warning("queue full: provider=%s model=%s", request.provider, request.model)
            self.relay.fail_waiting(request, QueueFull())

    def _take(self, entry: str, placed: Placed, held: bool = False) -> None:
        """A slot was reserved (under ``entry``) for one of our requests: use it.

        ``held``: the reservation already lasts until the request's deadline (``place``
        does that for a worker of this process); otherwise it is extended here. The
        same slot may be announced twice (the notice, then the record read back): the
        second time it is already in use and nothing happens."""
        request = self.waiting.pop(entry, None)
        if request is None or request.phase is not Phase.QUEUED:
            if not self._holding(entry, placed.worker_id):
                self._spawn(self._release(placed.worker_id, entry))
            return
        if placed.owner == self.instance:
            worker = self.relay.registry.workers.get(placed.worker_id)
            if worker is None:
                self._spawn(self._release(placed.worker_id, entry))
                self.place(request)
                return
            if self.relay.full(worker):
                # Redis offered a slot this process knows is taken (it lost reservations,
                # or has not heard yet of work taken here while it could not be reached):
                # re-assert the busy slots, give this one back, and place the request again.
                self.waiting[entry] = request
                self._spawn(self._retake(worker.id, entry, request))
                return
            request.lease = entry
            self.relay.assign_to(request, worker)
            if not held:
                self._spawn(self._extend(placed.worker_id, entry, request))
            return
        stand_in = self.proxies.stand_in(
            placed.worker_id, placed.owner, placed.address, request.provider
        )
        request.lease = entry
        self.relay.assign_to(request, stand_in)

    async def _retake(self, worker_id: str, entry: str, request: RelayRequest) -> None:
        try:
            await self._announce()
        except TROUBLE as exc:
            self._released.setdefault(worker_id, set()).add(entry)  # the next pass drops it
            self._trouble(exc)
            return  # (degraded: this process's workers take what waits here meanwhile)
        await self._release(worker_id, entry)
        await self._place(entry, request)

    def _holding(self, entry: str, worker_id: str) -> bool:
        """Whether a request of ours already runs on ``worker_id`` under ``entry``."""
        request_id = entry.partition("|")[2]
        for worker in (
            self.relay.registry.workers.get(worker_id),
            self.proxies.stand_ins.get(worker_id),
        ):
            request = worker.in_flight.get(request_id) if worker is not None else None
            if request is not None and request.lease == entry:
                return True
        return False

    async def _release(self, worker_id: str, lease: str) -> bool:
        """Release ``lease`` on a worker; if that gave its slot to a queued request, tell
        that request's process. True when a request got the slot."""
        try:
            popped = await self.state.release(worker_id, lease, now_ms(), self.aging_ms)
        except TROUBLE as exc:
            if lease and worker_id in self.relay.registry.workers:
                self._released.setdefault(worker_id, set()).add(lease)  # next tick drops it
            self._trouble(exc)
            return False
        logger.debug("released %r on %s: next %s", lease, worker_id, popped)
        if popped is None:
            return False
        entry, origin, placed = popped
        if origin == self.instance:
            self._take(entry, placed)
        return True  # (another origin was told by the script, and reads it back)

    def _on_message(self, message: str) -> None:
        kind, _, rest = message.partition(" ")
        if kind == "preempt":
            self._spawn(self._preempt_for(rest))
            return
        if kind == "ops":  # models on demand: a load for one of our workers (loads.py)
            self._spawn(self._take_ops())
            return
        entry, _, where = rest.partition(" ")
        if kind == "placed" and entry and where:
            self._take(entry, Placed.parse(where))

    async def _withdraw(self, entry: str, provider: str, lane: str) -> None:
        """Take an entry out of the shared queue; a slot already found for it (whose
        notice did not come, or came too late) goes back at once."""
        try:
            unused = await self.state.withdraw(provider, entry, lane)
        except TROUBLE as exc:
            self._withdrawn[entry] = (provider, lane)  # the next tick tries again
            self._trouble(exc)
            return
        self._withdrawn.pop(entry, None)
        if unused is not None:
            await self._release(unused, entry)

    async def _extend(self, worker_id: str, lease: str, request: RelayRequest) -> None:
        remaining = max(0.0, request.deadline - self.relay.loop.time())
        try:
            await self.state.extend(
                worker_id, lease, now_ms() + int(remaining * 1000) + LEASE_MARGIN_MS
            )
        except TROUBLE as exc:
            self._trouble(exc)  # the next tick re-asserts the lease

    def extend(self, worker_id: str, lease: str, request: RelayRequest) -> None:
        """A request another process placed on our worker arrived: keep its slot."""
        self._spawn(self._extend(worker_id, lease, request))

    def _release_unsent(self, worker_id: str, lease: str | None) -> None:
        if lease:
            self._spawn(self._release(worker_id, lease))

    def _unreachable(self, instance: str) -> None:
        """``instance`` refused a connection: it is gone (or going). Drop its address so
        no process places work on its workers before its keys would have expired; a
        process that is in fact alive announces itself again within a tick."""
        logger.warning("cluster: process %s refused a connection; taking it out", instance)
        self._spawn(self.state.leave(instance))

    def release(self, worker_id: str, lease: str) -> None:
        """Give back a reservation the request never used (its worker could not take it)."""
        self._spawn(self._release(worker_id, lease))

    def refused(self, worker_id: str, lease: str) -> None:
        """A request placed on our worker found it full here (Redis had lost some of its
        reservations): re-assert them first, then give this one back, so the slot it
        named is not offered again."""

        async def resync_then_release() -> None:
            try:
                await self._announce()
            except TROUBLE as exc:
                # Still given back: the next pass that Redis hears re-asserts the busy
                # slots and drops this one in the same step (else it would hold a slot
                # of an idle worker until its pending lease lapsed).
                if worker_id in self.relay.registry.workers:
                    self._released.setdefault(worker_id, set()).add(lease)
                self._trouble(exc)
                return
            await self._release(worker_id, lease)

        self._spawn(resync_then_release())

    def leaving(self) -> None:
        """The server is stopping: no other process places work on its workers any more
        (its own waiting requests may still be placed on theirs)."""
        self._leaving = True
        self._poke.set()
        self._serve_own()

    def _serve_own(self) -> None:
        """While the server stops, its own waiting requests still take its workers' free
        slots (no other process is offered them any more): with every worker connected
        here, they would otherwise wait out the grace and end with 503."""
        for entry, request in list(self.waiting.items()):
            if request.phase is not Phase.QUEUED or entry in self._placing:
                continue
            worker = self.relay.registry.select(request.provider, request.model, request)
            if worker is None or worker.remote or self.relay.full(worker):
                continue
            self.withdraw(request)  # out of the shared queue; a slot found meanwhile goes back
            request.lease = entry
            self.relay.assign_to(request, worker)

    def describe(self) -> dict[str, Any]:
        """For ``/health``, ``/admin/stats`` and ``/metrics``."""
        return {
            "instance": self.instance,
            "state": self.status,
            "problem": self.problem,
            "since": round(self.since, 3),
            "recoveries": self.recoveries,
            "queue_depth": self.queue_depth,
        }

    # -- running -------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except TROUBLE as exc:
            self._trouble(exc)
        except Exception:
            logger.exception("cluster placement step failed")

    def listening(self, address: str) -> None:
        """The server listens: other processes reach this one at ``address``."""
        self.address = address
        self._listening.set()
