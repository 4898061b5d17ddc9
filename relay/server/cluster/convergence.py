"""The control loop of cluster mode: every process converges back to the truth by itself.

:class:`Convergence` is a base of :class:`relay.server.cluster.placement.RedisPlacement`.
One supervised loop, :meth:`Convergence.run`, re-asserts this process's whole share of
the shared state every tick — address, workers, models, the reservations of the
requests it runs, the ones it released while Redis could not hear — so a Redis restart,
a flush, an eviction or this process stalling past its TTL heals within a tick of Redis
answering again. It also reads back where its waiting requests stand (a lost notice
costs at most a tick), offers any free slot of its workers to the shared queue, and
learns which models the other processes' workers serve. Any Redis error, wherever it
happens, makes the process *degraded* (:meth:`Convergence._trouble`) until a whole tick
succeeds again; then everything waiting is placed cluster-wide again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from relay.core.classes import FLEX_RANK
from relay.core.relay import Relay
from relay.core.state import Phase, RelayRequest, Worker
from relay.server.cluster.proxy import ProxyPool
from relay.server.cluster.state import (
    KEPT_OUT,
    ClusterState,
    CredentialsMismatch,
    Placed,
    WorkerRow,
)

logger = logging.getLogger("relay.cluster")

#: After a failed tick, the next attempt comes this soon, doubling up to a tick.
RETRY_SECS = 0.1
#: How long a new worker's registration waits for Redis before it is acked anyway
#: (the process is degraded then, and routes the worker's models itself).
JOIN_SECS = 2.0
#: How long a reservation is kept past its request's deadline.
LEASE_MARGIN_MS = 30_000
#: Failures that make the process degraded: Redis or the network said no, or the
#: cluster's credentials are not this process's.
TROUBLE = (aioredis.RedisError, OSError, TimeoutError, CredentialsMismatch)


def now_ms() -> int:
    return int(time.time() * 1000)


class Convergence:
    if TYPE_CHECKING:  # provided by the placement
        relay: Relay
        state: ClusterState
        redis: aioredis.Redis
        proxies: ProxyPool
        instance: str
        address: str | None
        tick: float
        ttl_ms: int
        credentials: str
        waiting: dict[str, RelayRequest]
        status: str
        problem: str
        since: float
        recoveries: int
        queue_depth: int
        _placing: set[str]
        _released: dict[str, set[str]]
        _withdrawn: dict[str, tuple[str, str]]
        _tasks: set[asyncio.Task[Any]]
        _poke: asyncio.Event
        _announcing: asyncio.Lock
        _listening: asyncio.Event
        _leaving: bool
        _reask: bool
        lean: Any

        @property
        def active(self) -> bool: ...

        def place(self, request: RelayRequest) -> None: ...

        def withdraw(self, request: RelayRequest) -> None: ...

        def _entry(self, request: RelayRequest) -> str: ...

        def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

        def _take(self, entry: str, placed: Placed, held: bool = False) -> None: ...

        async def _place(self, entry: str, request: RelayRequest) -> None: ...

        async def _release(self, worker_id: str, lease: str) -> bool: ...

        async def _withdraw(self, entry: str, provider: str, lane: str) -> None: ...

        def _on_message(self, message: str) -> None: ...

        def _serve_own(self) -> None: ...

        async def _want_slot(self, request: RelayRequest) -> None: ...

        async def _loads_tick(self) -> None: ...

        async def _speeds_tick(self, force: bool = False) -> None: ...

    # -- registering a worker ------------------------------------------------------

    async def join(self, worker: Worker) -> None:
        """Make a new worker of this process known to the cluster before it is acked,
        so that no process answers 404 for its models once it is (SPEC §11).

        Bounded by :data:`JOIN_SECS`: without Redis the process is degraded and the ack
        goes out anyway (this process routes the worker's models itself)."""
        if self.address is None or self.status == "degraded":
            return
        try:
            async with asyncio.timeout(JOIN_SECS):
                await self._announce(extra=worker)
        except TROUBLE as exc:
            self._trouble(exc)

    # -- keeping the shared state true -----------------------------------------------

    def _rows(self, extra: Worker | None = None) -> list[WorkerRow]:
        now = self.relay.loop.time()
        wall = now_ms()
        workers = list(self.relay.registry.workers.values())
        if extra is not None and extra.id not in self.relay.registry.workers:
            workers.append(extra)
        relay = self.relay
        rows = []
        for worker in workers:
            leases: dict[str, int] = {}
            for request in worker.in_flight.values():
                if not request.lease:  # assigned while Redis was away: count it now
                    request.lease = self._entry(request)
                remaining = max(0.0, request.deadline - now)
                leases[request.lease] = wall + int(remaining * 1000) + LEASE_MARGIN_MS
            # Models on demand: only the loaded models are routed to it (``wm``); the
            # others are where a load may go.
            models, held, idle = worker.models, tuple[str, ...](), ""
            if worker.states is not None:
                loaded = worker.model_set
                models = tuple(m for m in worker.models if m in loaded)
                held = tuple(m for m in worker.models if m not in loaded)
                idle = relay.idle_model(worker) or ""
            rows.append(
                WorkerRow(
                    worker_id=worker.id,
                    provider=worker.provider,
                    max_concurrent=worker.max_concurrent,
                    draining=worker.draining or self._leaving,
                    picky=worker.refuses is not None,
                    models=models,
                    leases=leases,
                    released=tuple(self._released.get(worker.id, ())),
                    held=held,
                    model_capacity=worker.model_capacity or 0,
                    resident=relay.resident_count(worker),
                    idle=idle,
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
                self.instance, self.address, rows, now_ms(), self.ttl_ms, self.credentials
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
        reask, self._reask = self._reask, False
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
            elif reask and request.rank < FLEX_RANK:
                self._spawn(self._want_slot(request))

    async def _learn_models(self) -> None:
        """What the other processes' workers serve, so requests for it are admitted here.

        Redis lists every live worker's models (ours too); a worker of ours serves its
        own through the registry, the rest are the others'."""
        served, loaded = await self.state.served_models()
        local: dict[str, set[str]] = {}
        local_loaded: dict[str, set[str]] = {}
        for worker in self.relay.registry.workers.values():
            local.setdefault(worker.provider, set()).update(worker.models)
            local_loaded.setdefault(worker.provider, set()).update(worker.model_set)
        # (A model loaded both here and elsewhere counts as loaded here only: at worst a
        # tick's worth of asking the cluster for a load it answers is not needed.)
        self.relay.set_remote_models(
            {p: frozenset(models - local.get(p, set())) for p, models in served.items()},
            {p: frozenset(models - local_loaded.get(p, set())) for p, models in loaded.items()},
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
        await self._loads_tick()
        await self._speeds_tick()
        self.queue_depth = await self.state.queue_depth(list(self.relay.providers))
        self.proxies.prune()
        if self._leaving:
            self._serve_own()

    # -- state ---------------------------------------------------------------------------

    def _trouble(self, exc: BaseException) -> None:
        """Redis (or the way to it) failed, or the cluster's live processes have other
        credentials: degraded until a whole tick succeeds."""
        if isinstance(exc, CredentialsMismatch):
            problem = str(exc)
        else:
            problem = f"Redis unreachable: {exc.__class__.__name__}: {str(exc)[:200]}"
        # Said once when it starts, and once more when Redis answering again only shows
        # that this process is kept out (the mismatch is retried every tick, silently).
        kept_out = isinstance(exc, CredentialsMismatch) and problem != self.problem
        if self.status != "degraded" or kept_out:
            logger.error("cluster degraded (%s): serving this process's workers only", problem)
        if self.status != "degraded":
            self.status = "degraded"
            self.since = time.time()
        self.problem = problem
        self._poke.set()
        # Meanwhile this process's workers take what waits here. (Their entries in the
        # shared queue are kept track of: sorted out when Redis answers again.)
        self.relay.dispatch_waiting()

    def master_switched(self) -> None:
        """Sentinel moved the master (:meth:`RedisSource.on_switch`): the new one may lack
        the last writes the old one took, so this process goes degraded until a whole pass
        re-asserted its share on the new one, as after a flush, and asks again for the
        slots its requests above ``flex`` wanted (an ask published meanwhile may be lost)."""
        self._trouble(RedisConnectionError("the Redis master moved (Sentinel failover)"))

    def _recovered(self) -> None:
        was, kept_out = self.status, self.problem == KEPT_OUT
        #: The next reconcile asks again for the slots of waiting requests above flex.
        self._reask = True
        self.status = "ok"
        self.problem = ""
        self.since = time.time()
        if was == "degraded":
            self.recoveries += 1
            if kept_out:
                logger.warning(
                    "cluster: joined as %s (no live process has other credentials any more); "
                    "placing cluster-wide",
                    self.instance,
                )
            else:
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

    # -- running -------------------------------------------------------------------------

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
                stop_if_cancelled()
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
                stop_if_cancelled()
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
            await pubsub.subscribe(self.state.channel(self.instance), self.state.channel_all())
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


def stop_if_cancelled() -> None:
    """Raise when the running task was asked to stop: a cancellation that arrives during
    a Redis call can be swallowed on its way up (a server stopped while it was joining
    kept ticking and never exited), so the control loops check for one themselves."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
