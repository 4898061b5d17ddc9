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

Everything converges back by itself (the controller idiom: observe, compare, act).
One supervised loop, :meth:`RedisPlacement.run`, re-asserts this process's whole share
of the shared state every :data:`TICK_SECS` — address, workers, models, the
reservations of the requests it runs, the ones it released while Redis could not hear
— so a Redis restart, a flush, an eviction or this process stalling past its TTL heals
within a tick of Redis answering again. It also reads back where its waiting requests
stand (a lost notice costs at most a tick), offers any free slot of its workers to the
shared queue, and learns which models the other processes' workers serve. Any Redis
error, wherever it happens, makes the process *degraded*: it places what waits here on
its own workers (as a single process does) and says so in ``/health`` and ``/metrics``
until a whole tick succeeds again; then everything waiting is placed cluster-wide again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis

from relay.core.fairqueue import weight_of
from relay.core.legacy.tasks import refusal
from relay.core.relay import Relay
from relay.core.state import Phase, RelayRequest, Worker
from relay.server.cluster.leanredis import lean_client
from relay.server.cluster.proxy import ProxyPool
from relay.server.cluster.state import (
    ClusterState,
    CredentialsMismatch,
    Placed,
    WorkerRow,
    lane_of,
)
from relay.wire.errors import QueueFull

logger = logging.getLogger("relay.cluster")

#: How often this process re-asserts its keys, and how long they outlive it.
TICK_SECS = 1.0
TTL_SECS = 5.0
#: After a failed tick, the next attempt comes this soon, doubling up to a tick.
RETRY_SECS = 0.1
#: How long a new worker's registration waits for Redis before it is acked anyway
#: (the process is degraded then, and routes the worker's models itself).
JOIN_SECS = 2.0
#: How long a reservation is kept past its request's deadline.
LEASE_MARGIN_MS = 30_000
#: Failures that make the process degraded: Redis or the network said no.
TROUBLE = (aioredis.RedisError, OSError, TimeoutError, CredentialsMismatch)


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisPlacement:
    def __init__(
        self,
        relay: Relay,
        redis_url: str,
        prefix: str,
        token: str,
        *,
        tick: float = TICK_SECS,
        ttl: float = TTL_SECS,
    ) -> None:
        """``tick``: how often the control loop runs; ``ttl``: how long this process's
        keys outlive its last tick (CLUSTER_TICK_SECS, CLUSTER_TTL_SECS)."""
        self.relay = relay
        self.instance = relay.instance
        self.tick = tick
        self.ttl_ms = max(1, int(ttl * 1000))
        self.redis = aioredis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        #: The per-request scripts' own connection (None: they use ``self.redis``).
        self.lean = lean_client(redis_url)
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

    # -- the Placement protocol ------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.status == "ok"

    def place(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        self.waiting[entry] = request
        self._spawn(self._place(entry, request))

    def withdraw(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        if self.waiting.pop(entry, None) is not None:
            lane = lane_of(request.key_id, request.worker_id is not None)
            self._spawn(self._withdraw(entry, request.provider, lane))

    def freed(self, worker: Worker, lease: str | None) -> None:
        if not self.active:
            if lease:  # Redis hears of it with the next tick that gets through
                self._released.setdefault(worker.id, set()).add(lease)
            return
        self._spawn(self._release(worker.id, lease or ""))

    def worker_changed(self, worker: Worker) -> None:
        self._spawn(self._refresh(worker.id))

    def worker_gone(self, worker: Worker) -> None:
        self._released.pop(worker.id, None)
        self._spawn(self.state.remove_worker(self.instance, worker.id))

    # -- registering a worker ------------------------------------------------------

    async def join(self, worker: Worker) -> None:
        """Make a new worker of this process known to the cluster before it is acked,
        so that no process answers 404 for its models once it is (SPEC §11).

        Bounded by :data:`JOIN_SECS`: without Redis the process is degraded and the ack
        goes out anyway (this process routes the worker's models itself)."""
        if self.address is None:
            return
        try:
            async with asyncio.timeout(JOIN_SECS):
                await self._announce(extra=worker)
        except TROUBLE as exc:
            self._trouble(exc)

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
            kind, placed, order = await self.state.place(
                provider=request.provider,
                model=request.model,
                entry=entry,
                origin=self.instance,
                now_ms=_now_ms(),
                deadline_ms=_now_ms() + int(max(0.0, request.queue_deadline - now) * 1000),
                hold_ms=int(max(0.0, request.deadline - now) * 1000) + LEASE_MARGIN_MS,
                seq=request.cluster_seq,
                max_queue=-1 if requeued or policy is None else policy.policy.max_queue_len,
                plain=refusal(request) is None,
                lane=lane_of(request.key_id, requeued),
                weight=weight_of(request),
            )
        except TROUBLE as exc:
            self._trouble(exc)  # it waits here; this process's workers take it
            return
        finally:
            self._placing.discard(entry)
        request.cluster_seq = order
        logger.debug("placing %s: %s %s (order %d)", entry, kind, placed, order)
        if kind == "placed":
            assert placed is not None
            self._take(entry, placed, held=True)
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
            popped = await self.state.release(worker_id, lease, _now_ms())
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
                worker_id, lease, _now_ms() + int(remaining * 1000) + LEASE_MARGIN_MS
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
                self._trouble(exc)
                return
            await self._release(worker_id, lease)

        self._spawn(resync_then_release())

    def leaving(self) -> None:
        """The server is stopping: no other process places work on its workers any more
        (its own waiting requests may still be placed on theirs)."""
        self._leaving = True
        self._poke.set()

    # -- keeping the shared state true -----------------------------------------------

    def _rows(self, extra: Worker | None = None) -> list[WorkerRow]:
        now = self.relay.loop.time()
        wall = _now_ms()
        workers = list(self.relay.registry.workers.values())
        if extra is not None and extra.id not in self.relay.registry.workers:
            workers.append(extra)
        rows = []
        for worker in workers:
            leases: dict[str, int] = {}
            for request in worker.in_flight.values():
                if not request.lease:  # assigned while Redis was away: count it now
                    request.lease = self._entry(request)
                remaining = max(0.0, request.deadline - now)
                leases[request.lease] = wall + int(remaining * 1000) + LEASE_MARGIN_MS
            rows.append(
                WorkerRow(
                    worker_id=worker.id,
                    provider=worker.provider,
                    max_concurrent=worker.max_concurrent,
                    draining=worker.draining or self._leaving,
                    picky=worker.refuses is not None,
                    models=worker.models,
                    leases=leases,
                    released=tuple(self._released.get(worker.id, ())),
                )
            )
        return rows

    async def _announce(self, extra: Worker | None = None) -> list[str]:
        """Re-assert everything this process owns in Redis (coalesced: one at a time);
        the local workers with a free slot while their queue holds work."""
        assert self.address is not None
        async with self._announcing:
            rows = self._rows(extra)
            feed = await self.state.announce(
                self.instance, self.address, rows, _now_ms(), self.ttl_ms, self.credentials
            )
            for row in rows:  # Redis has heard of those releases now
                left = self._released.get(row.worker_id)
                if left is not None:
                    left.difference_update(row.released)
                    if not left:
                        del self._released[row.worker_id]
            return feed

    async def _feed(self, worker_id: str) -> None:
        """Offer each free slot of a local worker to the shared queue."""
        worker = self.relay.registry.workers.get(worker_id)
        if worker is None or worker.draining:
            return
        for _ in range(max(0, worker.max_concurrent - len(worker.in_flight))):
            if not await self._release(worker_id, ""):
                return

    async def _refresh(self, worker_id: str) -> None:
        """A local worker registered or changed (models, drain): re-assert, then offer
        its free slots."""
        if self.address is None or not self.active:
            return
        try:
            await self._announce()
        except TROUBLE as exc:
            self._trouble(exc)
            return
        await self._feed(worker_id)

    async def _reconcile(self) -> None:
        """Read back where each request waiting here stands: a slot found for it whose
        notice was lost is taken now; an entry the shared queue lost is placed again."""
        entries = [
            (request.provider, entry)
            for entry, request in self.waiting.items()
            if entry not in self._placing
        ]
        statuses = await self.state.where(entries)
        for (_, entry), status in zip(entries, statuses, strict=True):
            request = self.waiting.get(entry)
            if request is None or entry in self._placing:
                continue  # it moved on meanwhile
            if status.startswith("placed "):
                logger.info("cluster: %s was given a slot whose notice was lost", entry)
                self._take(entry, Placed.parse(status[len("placed ") :]))
            elif status == "lost":
                logger.info("cluster: the shared queue lost %s; placing it again", entry)
                self._spawn(self._place(entry, request))

    async def _learn_models(self) -> None:
        """What the other processes' workers serve, so requests for it are admitted here.

        Redis lists every live worker's models (ours too); a worker of ours serves its
        own through the registry, the rest are the others'."""
        served = await self.state.served_models()
        local: dict[str, set[str]] = {}
        for worker in self.relay.registry.workers.values():
            local.setdefault(worker.provider, set()).update(worker.models)
        self.relay.set_remote_models(
            {p: frozenset(models - local.get(p, set())) for p, models in served.items()}
        )

    async def learn(self, model: str) -> bool:
        """A request names a model no worker known here serves: ask Redis whether a live
        worker anywhere does (it may have registered a moment ago at another process).
        True when the model became routable here. (Also while this process is still
        joining: it may have just started, before its first tick learned anything.)"""
        if self.status == "degraded":
            return False
        relay = self.relay
        pairs = [
            (name, relay.resolve(state, model))
            for name, state in relay.providers.items()
            if state.policy.enabled
        ]
        try:
            serving = await self.state.lookup(pairs)
        except TROUBLE as exc:
            self._trouble(exc)
            return False
        if not serving:
            return False
        models = dict(relay.remote_models)
        for name, target in pairs:
            if name in serving:
                models[name] = models.get(name, frozenset()) | {target}
        relay.set_remote_models(models)
        return True

    async def _tick(self) -> None:
        """One pass of the control loop; raises on any Redis error."""
        feed = await self._announce()
        for entry, (provider, lane) in list(self._withdrawn.items()):
            await self._withdraw(entry, provider, lane)
        if not self.active:
            self._recovered()
        await self._reconcile()
        for worker_id in feed:
            await self._feed(worker_id)
        await self._learn_models()
        self.queue_depth = await self.state.queue_depth(list(self.relay.providers))
        self.proxies.prune()

    # -- state ---------------------------------------------------------------------------

    def _trouble(self, exc: BaseException) -> None:
        """Redis (or the way to it) failed: degraded until a whole tick succeeds."""
        if isinstance(exc, CredentialsMismatch):
            problem = str(exc)
        else:
            problem = f"Redis unreachable: {exc.__class__.__name__}: {str(exc)[:200]}"
        if self.status != "degraded":
            logger.error("cluster degraded (%s): serving this process's workers only", problem)
            self.status = "degraded"
            self.since = time.time()
        self.problem = problem
        self._poke.set()
        # Meanwhile this process's workers take what waits here. (Their entries in the
        # shared queue are kept track of: sorted out when Redis answers again.)
        self.relay.dispatch_waiting()

    def _recovered(self) -> None:
        was = self.status
        self.status = "ok"
        self.problem = ""
        self.since = time.time()
        if was == "degraded":
            self.recoveries += 1
            logger.warning("cluster: Redis answers again; placing cluster-wide again")
        else:
            logger.info("cluster: joined through Redis as %s (%s)", self.instance, self.address)
        for request in list(self.waiting.values()):
            if request.phase is not Phase.QUEUED:  # served here meanwhile
                self.withdraw(request)
        # What still waits in the shared queue is read back by the tick (placed, queued
        # or lost); what arrived meanwhile is placed now.
        for request in self.relay.waiting_requests():
            if self._entry(request) not in self.waiting:
                self.place(request)

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

    async def run(self) -> None:
        """Owned by the runtime: the control loop, restarted after every failure (with a
        short backoff) for as long as the process runs."""
        delay = RETRY_SECS
        try:
            while True:
                try:
                    await self._session()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not isinstance(exc, TROUBLE):
                        logger.exception("cluster control loop failed; restarting it")
                    self._trouble(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.tick)
        finally:
            await self._stop()

    async def _session(self) -> None:
        """Tick until a tick fails; keep our channel subscribed meanwhile. A lost
        subscription is renewed at once and followed by a tick, which reads back any
        notice sent while it was down (so it costs nothing else)."""
        await self._listening.wait()
        listener: asyncio.Task[None] | None = None
        try:
            while True:
                if listener is None or listener.done():
                    if listener is not None and not listener.cancelled():
                        logger.info(
                            "cluster: notice channel lost (%s); renewing it", listener.exception()
                        )
                    listener = await self._subscribe()
                self._poke.clear()
                await self._tick()
                poked = asyncio.ensure_future(self._poke.wait())
                try:
                    await asyncio.wait(
                        {listener, poked}, timeout=self.tick, return_when="FIRST_COMPLETED"
                    )
                finally:
                    poked.cancel()
        finally:
            if listener is not None:
                listener.cancel()
                await asyncio.wait({listener})

    async def _subscribe(self) -> asyncio.Task[None]:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.state.channel(self.instance))
        except BaseException:
            await pubsub.aclose()
            raise
        return asyncio.get_running_loop().create_task(self._listen(pubsub))

    async def _listen(self, pubsub: Any) -> None:
        try:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self._on_message(ClusterState.decode(message["data"]))
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                pass

    async def _stop(self) -> None:
        self.status = "degraded"
        self.problem = "stopped"
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        try:
            await self.state.leave(self.instance)
        except Exception:
            pass
        await self.proxies.aclose()
        if self.lean is not None:
            await self.lean.aclose()
        await self.redis.aclose()
