"""Cluster mode: requests placed across every server process sharing one Redis (SPEC §11).

:class:`RedisPlacement` implements :class:`relay.core.placement.Placement` for the
dispatcher. Each decision is one atomic script in :mod:`relay.server.cluster.state`:

- a request admitted here reserves the least-loaded slot of the whole cluster, or joins
  the provider's shared queue (``place``);
- when a slot frees on a worker connected here, it is released and, in the same step,
  given to the oldest compatible request queued anywhere (``freed``);
- a slot found for a request of another process is announced to that process on its
  pub/sub channel; a slot found for one of ours is used at once.

A request placed on a worker of another process is assigned to a stand-in worker whose
link forwards it there over HTTP (:mod:`relay.server.cluster.proxy`); a request placed here by
another process arrives through the fast path (:func:`relay.server.http.inference.placed_here`,
branch). Redis holds membership, capacity and the queue only; bytes never go through it.

When Redis is unreachable the placement goes inactive: the dispatcher places requests on
this process's workers (degraded, logged, ``/health`` says so), and everything is
published again once Redis is back.
"""

from __future__ import annotations

import asyncio
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
from relay.server.cluster.state import ClusterState, Placed, lane_of
from relay.wire.errors import QueueFull

logger = logging.getLogger("relay.cluster")

#: How often this process refreshes its keys (they expire after PROC_TTL_MS).
ANNOUNCE_EVERY = 1.0
#: How long a reservation is kept past its request's deadline.
LEASE_MARGIN_MS = 30_000


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisPlacement:
    def __init__(self, relay: Relay, redis_url: str, prefix: str, token: str) -> None:
        self.relay = relay
        self.instance = relay.instance
        self.redis = aioredis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        #: The per-request scripts' own connection (None: they use ``self.redis``).
        self.lean = lean_client(redis_url)
        self.state = ClusterState(self.redis, prefix, self.lean)
        self.proxies = ProxyPool(relay, token, self._release_unsent, self._unreachable)
        #: Where the other processes reach this one (set once the server listens).
        self.address: str | None = None
        self._active = False
        #: Our requests waiting for a slot, by entry id (``<instance>|<request id>``).
        self.waiting: dict[str, RelayRequest] = {}
        #: Cluster-wide arrival order of each waiting request (kept across requeues).
        self._order: dict[str, int] = {}
        #: Models each local worker was last published with.
        self._published: dict[str, tuple[str, ...]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listening = asyncio.Event()
        #: Requests waiting in the shared queue, as of the last refresh.
        self.queue_depth = 0
        self.problem = "not connected yet"

    # -- the Placement protocol ------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._active

    def place(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        self.waiting[entry] = request
        self._spawn(self._place(entry, request))

    def withdraw(self, request: RelayRequest) -> None:
        entry = self._entry(request)
        self._order.pop(entry, None)
        if self.waiting.pop(entry, None) is not None:
            lane = lane_of(request.key_id, request.worker_id is not None)
            self._spawn(self.state.withdraw(request.provider, entry, lane))

    def freed(self, worker: Worker, lease: str | None) -> None:
        self._spawn(self._release(worker.id, lease or ""))

    def worker_changed(self, worker: Worker) -> None:
        self._spawn(self._publish(worker))

    def worker_gone(self, worker: Worker) -> None:
        models = self._published.pop(worker.id, worker.models)
        self._spawn(self.state.remove_worker(worker.id, worker.provider, list(models)))

    # -- placing --------------------------------------------------------------------

    def _entry(self, request: RelayRequest) -> str:
        return f"{self.instance}|{request.id}"

    async def _place(self, entry: str, request: RelayRequest) -> None:
        if request.phase is not Phase.QUEUED:
            self.waiting.pop(entry, None)
            return
        policy = self.relay.providers.get(request.provider)
        requeued = entry in self._order
        now = self.relay.loop.time()
        kind, placed, order = await self.state.place(
            provider=request.provider,
            model=request.model,
            entry=entry,
            origin=self.instance,
            now_ms=_now_ms(),
            deadline_ms=_now_ms() + int(max(0.0, request.queue_deadline - now) * 1000),
            hold_ms=int(max(0.0, request.deadline - now) * 1000) + LEASE_MARGIN_MS,
            seq=self._order.get(entry, 0),
            max_queue=-1 if requeued or policy is None else policy.policy.max_queue_len,
            plain=refusal(request) is None,
            lane=lane_of(request.key_id, request.worker_id is not None),
            weight=weight_of(request),
        )
        self._order[entry] = order
        logger.debug("placing %s: %s %s (order %d)", entry, kind, placed, order)
        if kind == "placed":
            assert placed is not None
            self._take(entry, placed, held=True)
        elif kind == "full":
            self.waiting.pop(entry, None)
            self._order.pop(entry, None)
            logger.warning("queue full: provider=%s model=%s", request.provider, request.model)
            self.relay.fail_waiting(request, QueueFull())

    def _take(self, entry: str, placed: Placed, held: bool = False) -> None:
        """A slot was reserved (under ``entry``) for one of our requests: use it.

        ``held``: the reservation already lasts until the request's deadline (``place``
        does that for a worker of this process); otherwise it is extended here."""
        request = self.waiting.pop(entry, None)
        if request is None or request.phase is not Phase.QUEUED:
            self._spawn(self._release(placed.worker_id, entry))
            return
        self._order.pop(entry, None)
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

    async def _release(self, worker_id: str, lease: str) -> bool:
        """Release ``lease`` on a worker; if that gave its slot to a queued request, tell
        that request's process. True when a request got the slot."""
        popped = await self.state.release(worker_id, lease, _now_ms())
        logger.debug("released %r on %s: next %s", lease, worker_id, popped)
        if popped is None:
            return False
        entry, origin = popped
        if worker_id in self.relay.registry.workers:
            placed = Placed(worker_id, self.instance, self.address or "")
        else:  # released from here on another process's worker: look up its owner
            proc = ClusterState.decode(
                await self.redis.hget(self.state._key("w", worker_id), "proc") or b""
            )
            address = await self.redis.get(self.state._key("proc", proc)) if proc else None
            placed = Placed(worker_id, proc, ClusterState.decode(address or b""))
        if origin == self.instance:
            self._take(entry, placed)
        else:
            message = f"placed {entry} {placed.worker_id} {placed.owner} {placed.address}"
            await self.state.notify(origin, message)
        return True

    def _on_message(self, message: str) -> None:
        parts = message.split(" ")
        if len(parts) == 5 and parts[0] == "placed":
            _, entry, worker_id, owner, address = parts
            self._take(entry, Placed(worker_id, owner, address))

    async def _extend(self, worker_id: str, lease: str, request: RelayRequest) -> None:
        remaining = max(0.0, request.deadline - self.relay.loop.time())
        await self.state.extend(
            worker_id, lease, _now_ms() + int(remaining * 1000) + LEASE_MARGIN_MS
        )

    def extend(self, worker_id: str, lease: str, request: RelayRequest) -> None:
        """A request another process placed on our worker arrived: keep its slot."""
        self._spawn(self._extend(worker_id, lease, request))

    def _release_unsent(self, worker_id: str, lease: str | None) -> None:
        if lease:
            self._spawn(self._release(worker_id, lease))

    def _unreachable(self, instance: str) -> None:
        """``instance`` refused a connection: it is gone (or going). Drop its address so
        no process places work on its workers before its keys would have expired; a
        process that is in fact alive announces itself again within a second."""
        logger.warning("cluster: process %s refused a connection; taking it out", instance)
        self._spawn(self.state.leave(instance))

    def release(self, worker_id: str, lease: str) -> None:
        """Give back a reservation the request never used (its worker could not take it)."""
        self._spawn(self._release(worker_id, lease))

    # -- membership -----------------------------------------------------------------

    async def _publish(self, worker: Worker) -> None:
        if not worker.attached:
            return
        before = self._published.get(worker.id, ())
        self._published[worker.id] = worker.models
        for request in worker.in_flight.values():
            if not request.lease:  # assigned while Redis was away: count it now
                request.lease = self._entry(request)
        leases = {
            request.lease: _now_ms()
            + int(max(0.0, request.deadline - self.relay.loop.time()) * 1000)
            + LEASE_MARGIN_MS
            for request in worker.in_flight.values()
            if request.lease
        }
        await self.state.publish_worker(
            worker_id=worker.id,
            instance=self.instance,
            provider=worker.provider,
            max_concurrent=worker.max_concurrent,
            draining=worker.draining,
            picky=worker.refuses is not None,
            models=list(worker.models),
            dropped=[m for m in before if m not in worker.models],
            leases=leases,
        )
        if not worker.draining:
            for _ in range(max(0, worker.max_concurrent - len(worker.in_flight))):
                if not await self._release(worker.id, ""):
                    break

    # -- running --------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except (aioredis.RedisError, OSError) as exc:
            self._lost(exc)
        except Exception:
            logger.exception("cluster placement step failed")

    def _lost(self, exc: BaseException) -> None:
        if self._active:
            logger.error("Redis unreachable (%s): serving this process's workers only", exc)
        self._active = False
        self.problem = f"Redis unreachable: {exc.__class__.__name__}"
        # Our waiting requests wait here now: local workers take them.
        self.waiting.clear()
        self.relay.dispatch_waiting()

    async def run(self) -> None:
        """Owned by the runtime: keep our keys fresh, listen for slots found for us, and
        rejoin after Redis comes back."""
        try:
            while True:
                try:
                    await self._session()
                except asyncio.CancelledError:
                    raise
                except (aioredis.RedisError, OSError) as exc:
                    self._lost(exc)
                await asyncio.sleep(ANNOUNCE_EVERY)
        finally:
            self._active = False
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

    def listening(self, address: str) -> None:
        """The server listens: other processes reach this one at ``address``."""
        self.address = address
        self._listening.set()

    async def _session(self) -> None:
        await self._listening.wait()
        assert self.address is not None
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.state.channel(self.instance))
        try:
            await self._rejoin()
            listener = asyncio.get_running_loop().create_task(self._listen(pubsub))
            try:
                while not listener.done():
                    await self.state.announce(
                        self.instance, self.address, list(self.relay.registry.workers)
                    )
                    self.proxies.prune()
                    await self._learn_models()
                    self.queue_depth = await self.state.queue_depth()
                    await asyncio.wait({listener}, timeout=ANNOUNCE_EVERY)
                if listener.done():
                    listener.result()  # raise what ended it
            finally:
                listener.cancel()
                await asyncio.wait({listener})
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                pass

    def describe(self) -> dict[str, Any]:
        """For ``/health`` and ``/admin/stats``."""
        return {
            "instance": self.instance,
            "state": "ok" if self._active else "degraded",
            "problem": self.problem,
            "queue_depth": self.queue_depth,
        }

    async def _learn_models(self) -> None:
        """What the other processes' workers serve, so requests for it are admitted here.

        Redis lists every live worker's models (ours too); a worker of ours serves its
        own through the registry, the rest are the others'.
        """
        served = await self.state.served_models()
        local: dict[str, set[str]] = {}
        for worker in self.relay.registry.workers.values():
            local.setdefault(worker.provider, set()).update(worker.models)
        self.relay.set_remote_models(
            {p: frozenset(models - local.get(p, set())) for p, models in served.items()}
        )

    async def _listen(self, pubsub: Any) -> None:
        async for message in pubsub.listen():
            if message.get("type") == "message":
                self._on_message(ClusterState.decode(message["data"]))

    async def _rejoin(self) -> None:
        """(Re)publish our workers and requeue what waits here, then place cluster-wide."""
        assert self.address is not None
        await self.state.announce(self.instance, self.address, [])
        for worker in list(self.relay.registry.workers.values()):
            self._published.pop(worker.id, None)
            await self._publish(worker)
        was_down = not self._active
        self._active = True
        self.problem = ""
        if was_down:
            logger.info("cluster: joined through Redis as %s (%s)", self.instance, self.address)
        for request in self.relay.waiting_requests():
            self.place(request)
