"""The cluster's shared state in Redis: who serves what, reservations, the shared queue.

Every decision that must be atomic across server processes is one Lua script, so
Redis runs it alone: choosing the least-loaded worker and reserving its slot, or
queueing the request when there is none (:meth:`ClusterState.place`); releasing a slot
and, in the same step, handing it to the oldest compatible queued request
(:meth:`ClusterState.release`). A slot can therefore never be free while a request
that fits it waits, and no worker is ever reserved past its ``max_concurrent``.

The shared queue keeps the order of :mod:`relay.core.classqueue` across processes: the
highest priority class with a compatible request first (a request that waited the
aging bound per class counting that many classes higher); within a class, requeued
requests and those aged into it first, oldest arrival first (nothing that arrived after
a request aged passes it); then the API keys take turns in one ring per provider and
class (weighted round-robin, every request costs one credit of its key's turn), FIFO
within a key among the requests the worker can serve.

Keys (``P`` is REDIS_PREFIX):

- ``P:procs`` (the processes that announced themselves; dead ones pruned on reading)
  and ``P:proc:<instance>``: the process's address for the others; expires unless
  refreshed (a dead process drops out within CLUSTER_TTL_SECS);
- ``P:pw:<instance>``: the workers connected to that process; ``P:w:<worker>`` (hash:
  proc, provider, max, draining, picky — a worker that does not take every request for
  its models, such as a legacy node), ``P:wm:<worker>`` (its models), ``P:l:<worker>``
  (its reservations, scored by expiry): all re-asserted by their process every second
  (:data:`relay.server.cluster.scripts.ANNOUNCE`) and expiring with it, so a dead
  process's workers vanish with it and whatever Redis lost comes back; ``P:la:<worker>``
  (when its process first announced it without a reservation Redis holds: one whose
  request never came is dropped a TTL later);
- ``P:m:<provider>:<model>``: the workers serving a model — a hint, pruned of any
  worker its live process does not list with that model;
- models on demand (SPEC §19): a worker's ``wm`` lists only the models it has loaded
  (the ones routed to it); ``P:wh:<worker>`` the others it holds, ``P:mh:<provider>:
  <model>`` (a hint, like ``m``) the workers holding a model without having it loaded,
  and its row's ``mcap``, ``resident`` and ``idle`` its model slots, how many it has
  loaded or loading, and the model it could unload to make room; ``P:ld:<provider>:
  <model>`` the single load on its way (the worker; expires with MODEL_LOAD_TIMEOUT_SECS),
  ``P:ldf:<provider>:<model>`` the workers whose load of it failed lately, and
  ``P:ops:<instance>`` (hash) the loads that process is to start, read by it on its
  channel's notice or at its next tick;
- ``P:pl:<entry>``: where the slot found for a queued request is (until it lapses), for
  its process to read back when the notice on its channel was lost;
- ``P:qm:<provider>`` (hash: entries waiting per model, never below the truth);
- ``P:q:<provider>`` (every waiting entry, scored by global arrival order) and
  ``P:qe:<entry>`` (model, origin process, deadline, plain — whether picky workers may
  take it —, lane; expires at the deadline): the shared queue;
- ``P:ql:<provider>:<lane>``: a lane's entries by arrival order; the lane is
  ``<class>:k<key id>``, ``<class>:anon`` (requests without a key) or
  ``<class>:requeued`` (dispatched before), ``<class>`` a priority class (SPEC §15);
  ``P:qk:<provider>`` (hash): entries waiting per class (the queue bound is per class);
- ``P:qr:<provider>:<class>`` (list): the class's ring of key lanes with entries, the
  lane whose turn it is first; ``P:qc:<provider>`` and ``P:qw:<provider>`` (hashes): each
  ring lane's
  credit left in its turn and its weight. A lane is in the ring exactly while it
  holds entries (every script that adds or removes entries keeps that true);
- ``P:seq`` (arrival order), ``P:rr:<provider>`` (round-robin among equals);
- ``P:aff:<provider>:<anchor>``: the worker that took a conversation's last turn
  (cache-aware routing, SPEC §14), expiring AFFINITY_TTL_SECS after it;
- ``P:sp:<instance>``: the speeds that process learned of its workers, and their loads,
  as it last shared them (speed-aware routing, SPEC §21; every RATES_SHARE_SECS,
  expiring three periods later): what every process predicts from
  (:mod:`relay.server.cluster.speeds`);
- ``P:credentials``: a fingerprint of the cluster token (derived from the pepper) of the
  live processes: set by the first process to announce itself when none are held,
  renewed by each announce of a process that has them and expiring CLUSTER_TTL_SECS
  after the last one; a process with others stays out until then (:data:`scripts.ANNOUNCE`).

A reservation's id is its request's entry id, ``<instance>|<request id>``: unique, and
the same string names the request's queue entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

from relay.server.cluster import scripts
from relay.server.cluster.leanredis import LeanRedis, Script

#: A reservation whose request has not reached its worker's process within this long
#: lapses (the placing process died in between); on arrival it is extended.
PENDING_LEASE_MS = 15_000


#: What a process kept out for its credentials says (``/health``, the log, admin stats).
KEPT_OUT = (
    "this process's cluster credentials differ from those of the cluster's live processes: "
    "every process must share MODELRELAY_SECRET_PEPPER; this one stays out while a process "
    "with another pepper runs, and joins by itself within CLUSTER_TTL_SECS of the last one "
    "stopping (docs/CLUSTER.md)"
)


class CredentialsMismatch(Exception):
    """The cluster's live processes have other credentials (another pepper): this process
    stays out until the last of them is gone."""

    def __init__(self) -> None:
        super().__init__(KEPT_OUT)


def lane_of(service_class: str, key_id: int | None, requeued: bool) -> str:
    """The shared-queue lane of a request of priority class ``service_class`` and API
    key ``key_id`` (None: no key); ``requeued``: it was dispatched before and goes ahead
    of every key of its class."""
    if requeued:
        return f"{service_class}:requeued"
    return f"{service_class}:" + ("anon" if key_id is None else f"k{key_id}")


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a reservation landed: a worker, the process it is connected to, and that
    process's address."""

    worker_id: str
    owner: str
    address: str

    @classmethod
    def parse(cls, text: str) -> Placed:
        """From ``<worker> <owner> <address>`` (the address may be empty)."""
        worker_id, owner, address = [*text.split(" ", 2), "", ""][:3]
        return cls(worker_id, owner, address)


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """A worker of this process as :meth:`ClusterState.announce` re-asserts it."""

    worker_id: str
    provider: str
    max_concurrent: int
    draining: bool
    picky: bool
    models: tuple[str, ...]
    #: The reservations of the requests it runs now: lease -> expiry (ms).
    leases: dict[str, int]
    #: Reservations released here that Redis may not have heard of.
    released: tuple[str, ...] = ()
    #: Models on demand: the models it holds without having them loaded (``models`` are
    #: the loaded ones), its model slots (0: no bound), how many it has loaded or
    #: loading, and the model it could unload to make room for another ('' for none).
    held: tuple[str, ...] = ()
    model_capacity: int = 0
    resident: int = 0
    idle: str = ""


class ClusterState:
    def __init__(self, redis: aioredis.Redis, prefix: str, lean: LeanRedis | None = None) -> None:
        """``lean``: run the per-request scripts through it (:mod:`relay.server.cluster.leanredis`);
        membership and the rest go through ``redis``."""
        self.redis = redis
        self.prefix = prefix
        fast: Any = (lambda source: Script(lean, source)) if lean else redis.register_script
        self._place = fast(scripts.PLACE)
        self._release = fast(scripts.RELEASE)
        self._extend = fast(scripts.EXTEND)
        self._withdraw = fast(scripts.WITHDRAW)
        self._announce = redis.register_script(scripts.ANNOUNCE)
        self._served = redis.register_script(scripts.SERVED)
        self._lookup = redis.register_script(scripts.LOOKUP)
        self._where = redis.register_script(scripts.WHERE)
        self._want = redis.register_script(scripts.WANT)
        self._load_done = redis.register_script(scripts.LOAD_DONE)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- reservations and the shared queue ---------------------------------------

    async def place(
        self,
        *,
        provider: str,
        model: str,
        entry: str,
        origin: str,
        now_ms: int,
        deadline_ms: int,
        hold_ms: int,
        seq: int,
        max_queue: int,
        plain: bool = True,
        lane: str = "default:anon",
        weight: int = 1,
        service_class: str = "default",
        anchor: str = "",
        load_factor: float = 1.25,
        anchor_ttl_ms: int = 3_600_000,
        load_slack: int = 0,
        costs: str = "",
        default_cost: tuple[float, float] = (0.0, 0.0),
        local_slack: int = 0,
    ) -> tuple[str, Placed | None, int, bool]:
        """Reserve the least-loaded slot for ``model`` or queue ``entry`` at the back of
        ``lane`` (see :func:`lane_of`), whose turns are ``weight`` requests long.

        Returns ``("placed", where, seq)``, ``("queued", None, seq)`` or
        ``("full", None, seq)``. A slot on a worker of ``origin`` itself is held for
        ``hold_ms`` at once (nothing has to travel, so nothing has to be extended); one
        elsewhere for PENDING_LEASE_MS until the request arrives. ``seq`` is the
        request's place in the global arrival order (give it back when the request is
        placed again, to keep its place).

        ``anchor`` names the request's conversation (SPEC §14): the worker that took its
        last turn (remembered ``anchor_ttl_ms``) takes it again while its load stays
        within the bounded-load guard (``load_factor`` times the mean, or ``load_slack``
        above the least loaded worker); otherwise least-load decides,
        and the worker chosen becomes the conversation's. The last value returned is
        True when the conversation's worker was passed over for the guard.

        ``costs`` (speed-aware routing, SPEC §21; see ``lua/place.lua``): the placing
        process's predicted cost of each worker, from the speeds the processes share;
        then the worker with the lowest cost within the guard is chosen, a worker
        without an entry costing ``default_cost`` (base, per request in flight).

        ``local_slack``: under least load, a worker of ``origin`` with a free slot takes
        the request while its load is at most this much above the least (the least
        loaded of them; 0: only on a tie), so that it need not cross to another process.
        """
        reply = await self._place(
            args=[
                self.prefix,
                provider,
                model,
                now_ms,
                entry,
                PENDING_LEASE_MS,
                origin,
                deadline_ms,
                seq,
                max_queue,
                "1" if plain else "0",
                lane,
                weight,
                hold_ms,
                service_class,
                anchor,
                load_factor,
                anchor_ttl_ms,
                load_slack,
                costs,
                default_cost[0],
                default_cost[1],
                local_slack,
            ]
        )
        kind, worker, owner, address = (self.decode(part) for part in reply[:4])
        placed = Placed(worker, owner, address) if kind == "placed" else None
        return kind, placed, int(reply[4]), self.decode(reply[5]) == "1"

    async def release(
        self, worker_id: str, lease: str, now_ms: int, aging_ms: int = 0
    ) -> tuple[str, str, Placed] | None:
        """Release ``lease`` on the worker and give the free slot to the queued request
        it should serve next (requeued first, then the keys' turns): returns that
        request's ``(entry, origin, where)`` (its slot is reserved under ``entry``), or
        None. Another origin is told on its channel, and can read ``where`` back."""
        popped = await self._release(
            args=[self.prefix, worker_id, lease, now_ms, PENDING_LEASE_MS, aging_ms]
        )
        if not popped:
            return None
        entry, origin, where = (self.decode(part) for part in popped)
        return entry, origin, Placed.parse(where)

    async def extend(self, worker_id: str, lease: str, expiry_ms: int) -> None:
        """The reserved request reached its worker: keep the slot until its deadline."""
        await self._extend(args=[self.prefix, worker_id, lease, expiry_ms])

    async def withdraw(self, provider: str, entry: str, lane: str) -> str | None:
        """Drop a waiting entry (its request ended where it was admitted, or took a slot
        elsewhere). Returns the worker of a slot found for it that it never took (the
        caller releases it), else None."""
        found = await self._withdraw(args=[self.prefix, provider, entry, lane])
        return self.decode(found) if found else None

    async def queue_depth(self, providers: list[str]) -> int:
        """Requests waiting in the shared queues of ``providers``."""
        if not providers:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for provider in providers:
                pipe.zcard(self._key("q", provider))
            return sum(await pipe.execute())

    async def where(self, entries: list[tuple[str, str]]) -> list[str]:
        """For each ``(provider, entry)`` waiting here: ``placed <worker> <owner>
        <address>``, ``queued`` or ``lost`` (see :data:`scripts.WHERE`)."""
        if not entries:
            return []
        args: list[str] = [self.prefix]
        for provider, entry in entries:
            args += [provider, entry]
        return [self.decode(item) for item in await self._where(args=args)]

    # -- speeds (SPEC §21) -------------------------------------------------------------

    async def share_speeds(self, instance: str, document: bytes, ttl_ms: int) -> None:
        """Publish what ``instance`` learned of its workers' speeds (``P:sp:<instance>``)."""
        await self.redis.set(self._key("sp", instance), document, px=ttl_ms)

    async def shared_speeds(self) -> list[tuple[str, bytes]]:
        """Every process's speeds document still in Redis: ``(instance, document)``."""
        instances = sorted(self.decode(i) for i in await self.redis.smembers(self._key("procs")))
        if not instances:
            return []
        values = await self.redis.mget([self._key("sp", i) for i in instances])
        return [
            (i, v if isinstance(v, bytes) else str(v).encode())
            for i, v in zip(instances, values, strict=True)
            if v is not None
        ]

    # -- membership ----------------------------------------------------------------

    async def announce(
        self,
        instance: str,
        address: str,
        workers: list[WorkerRow],
        now_ms: int,
        ttl_ms: int,
        credentials: str,
    ) -> list[str]:
        """Re-assert this process and its workers (see :data:`scripts.ANNOUNCE`); the
        workers that have a free slot while their provider's queue holds entries.
        Raises :class:`CredentialsMismatch` (having re-asserted nothing) while the
        cluster's live processes have other credentials."""
        args: list[Any] = [
            self.prefix,
            instance,
            address,
            ttl_ms,
            now_ms,
            len(workers),
            credentials,
        ]
        for row in workers:
            args += [
                row.worker_id,
                row.provider,
                row.max_concurrent,
                "1" if row.draining else "0",
                "1" if row.picky else "0",
                len(row.models),
                *row.models,
                len(row.held),
                *row.held,
                row.model_capacity,
                row.resident,
                row.idle,
                len(row.leases),
            ]
            for lease, expiry in row.leases.items():
                args += [lease, expiry]
            args += [len(row.released), *row.released]
        status, *feed = [self.decode(item) for item in await self._announce(args=args)]
        if status != "ok":
            raise CredentialsMismatch
        return feed

    async def remove_worker(self, instance: str, worker_id: str) -> None:
        """A worker left this process: no longer offered (its keys go with it)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(self._key("pw", instance), worker_id)
            for kind in ("w", "wm", "wh", "l"):
                pipe.delete(self._key(kind, worker_id))
            await pipe.execute()

    async def served_models(self) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
        """provider -> models some live worker of the cluster serves (ours included), and
        provider -> the part of them some live worker has loaded (models on demand)."""
        flat = await self._served(args=[self.prefix])
        served: dict[str, set[str]] = {}
        loaded: dict[str, set[str]] = {}
        for i in range(0, len(flat) - 2, 3):
            provider, model = self.decode(flat[i]), self.decode(flat[i + 1])
            served.setdefault(provider, set()).add(model)
            if self.decode(flat[i + 2]) == "1":
                loaded.setdefault(provider, set()).add(model)
        return served, loaded

    # -- models on demand (SPEC §19) -------------------------------------------------

    async def want(
        self, provider: str, model: str, lock_ms: int, now_ms: int, *, scale: bool = False
    ) -> tuple[str, str, str]:
        """Requests wait for ``model``: have it loaded once, cluster-wide (see
        :data:`scripts.WANT`). Returns the verdict and, when ``sent``, the worker chosen
        and its process (else empty strings)."""
        reply = await self._want(
            args=[self.prefix, provider, model, lock_ms, "1" if scale else "0", now_ms]
        )
        parts = [self.decode(item) for item in reply] + ["", ""]
        return parts[0], parts[1], parts[2]

    async def load_done(
        self, provider: str, model: str, worker_id: str, ok: bool | None, lock_ms: int
    ) -> None:
        """The worker chosen by :meth:`want` is done loading ``model`` (``ok`` None: it
        did not start, the worker could not take it by then; see
        :data:`scripts.LOAD_DONE`)."""
        outcome = "" if ok is None else "1" if ok else "0"
        await self._load_done(args=[self.prefix, provider, model, worker_id, outcome, lock_ms])

    async def take_ops(self, instance: str) -> list[tuple[str, str, str, str, bool]]:
        """The loads the cluster chose this process's workers for, taken (each once):
        ``(provider, model, worker, model to unload first or '', scale-out)``."""
        key = self._key("ops", instance)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.delete(key)
            records, _ = await pipe.execute()
        out = []
        for field, value in records.items():
            try:
                provider, model = msgspec.json.decode(field)
                worker_id, victim, scale = msgspec.json.decode(value)
            except (msgspec.DecodeError, ValueError, TypeError):
                continue  # (written by our own script: never, but never trusted either)
            out.append((str(provider), str(model), str(worker_id), str(victim), scale == "1"))
        return out

    async def queued(self, provider: str, model: str) -> int:
        """Requests for ``model`` waiting in the shared queue (never below the truth)."""
        return int(await self.redis.hget(self._key("qm", provider), model) or 0)

    async def lookup(self, pairs: list[tuple[str, str]]) -> set[str]:
        """The providers among ``(provider, model)`` pairs that a live worker serves."""
        if not pairs:
            return set()
        args: list[str] = [self.prefix]
        for provider, model in pairs:
            args += [provider, model]
        return {self.decode(p) for p in await self._lookup(args=args)}

    async def leave(self, instance: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self._key("proc", instance), self._key("pw", instance))
            pipe.srem(self._key("procs"), instance)
            await pipe.execute()

    def channel_all(self) -> str:
        """The pub/sub channel every process listens on (a slot wanted for a higher class)."""
        return self._key("ctl-all")

    async def broadcast(self, message: str) -> None:
        await self.redis.publish(self.channel_all(), message)

    async def claim(self, token: str, instance: str, ttl_ms: int = 5000) -> bool:
        """The first process to claim ``token`` acts on it; the others leave it."""
        return bool(await self.redis.set(self._key("claim", token), instance, nx=True, px=ttl_ms))

    def channel(self, instance: str) -> str:
        """The pub/sub channel on which ``instance`` hears of slots found for its requests."""
        return self._key("ctl", instance)

    @staticmethod
    def decode(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)
