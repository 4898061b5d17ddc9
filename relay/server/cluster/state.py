"""The cluster's shared state in Redis: who serves what, reservations, the shared queue.

Every decision that must be atomic across server processes is one Lua script, so
Redis runs it alone: choosing the least-loaded worker and reserving its slot, or
queueing the request when there is none (:meth:`ClusterState.place`); releasing a slot
and, in the same step, handing it to the oldest compatible queued request
(:meth:`ClusterState.release`). A slot can therefore never be free while a request
that fits it waits, and no worker is ever reserved past its ``max_concurrent``.

The shared queue keeps the order of :mod:`relay.core.fairqueue` across processes:
requeued requests first, oldest arrival first; then the API keys take turns in one
ring per provider (weighted round-robin, every request costs one credit of its key's
turn), FIFO within a key among the requests the worker can serve.

Keys (``P`` is REDIS_PREFIX):

- ``P:proc:<instance>``: the process's address for the others; expires unless
  refreshed (a dead process drops out within PROC_TTL);
- ``P:w:<worker>`` (hash: proc, provider, max, draining, picky — a worker that does
  not take every request for its models, such as a legacy node), ``P:wm:<worker>`` (its
  models), ``P:l:<worker>`` (its reservations, scored by expiry): refreshed with the
  process, so a dead process's workers vanish with it;
- ``P:m:<provider>:<model>``: the workers serving a model (dead ones pruned lazily);
- ``P:q:<provider>`` (every waiting entry, scored by global arrival order) and
  ``P:qe:<entry>`` (model, origin process, deadline, plain — whether picky workers may
  take it —, lane; expires at the deadline): the shared queue;
- ``P:ql:<provider>:<lane>``: a lane's entries by arrival order; the lane is ``k<key
  id>``, ``anon`` (requests without a key) or ``requeued`` (dispatched before);
- ``P:qr:<provider>`` (list): the ring of key lanes with entries, the lane whose turn
  it is first; ``P:qc:<provider>`` and ``P:qw:<provider>`` (hashes): each ring lane's
  credit left in its turn and its weight. A lane is in the ring exactly while it
  holds entries (every script that adds or removes entries keeps that true);
- ``P:seq`` (arrival order), ``P:rr:<provider>`` (round-robin among equals).

A reservation's id is its request's entry id, ``<instance>|<request id>``: unique, and
the same string names the request's queue entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from relay.server.cluster.leanredis import LeanRedis, Script

#: A process that has not refreshed its keys for this long is gone.
PROC_TTL_MS = 5000
#: A reservation whose request has not reached its worker's process within this long
#: lapses (the placing process died in between); on arrival it is extended.
PENDING_LEASE_MS = 15_000

_PLACE = """
local P, provider, model = ARGV[1], ARGV[2], ARGV[3]
local now, lease, lease_ms = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local origin, deadline = ARGV[7], tonumber(ARGV[8])
local seq, max_queue, plain = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
local lane, weight = ARGV[12], tonumber(ARGV[13])
local own_lease_ms = tonumber(ARGV[14])
local members_key = P .. ':m:' .. provider .. ':' .. model
local best, ties = nil, {}
for _, wid in ipairs(redis.call('SMEMBERS', members_key)) do
  local w = redis.call('HMGET', P .. ':w:' .. wid, 'proc', 'max', 'draining', 'picky')
  if not w[1] then
    redis.call('SREM', members_key, wid)
  elseif w[3] ~= '1' and (plain == '1' or w[4] ~= '1')
      and redis.call('EXISTS', P .. ':proc:' .. w[1]) == 1 then
    local leases = P .. ':l:' .. wid
    redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
    local load = redis.call('ZCARD', leases)
    if load < tonumber(w[2]) then
      if best == nil or load < best then
        best, ties = load, {wid}
      elseif load == best then
        table.insert(ties, wid)
      end
    end
  end
end
if seq == 0 then
  seq = redis.call('INCR', P .. ':seq')
end
if #ties > 0 then
  table.sort(ties)
  local turn = redis.call('INCR', P .. ':rr:' .. provider)
  local wid = ties[(turn % #ties) + 1]
  local proc = redis.call('HGET', P .. ':w:' .. wid, 'proc')
  if proc == origin then  -- the request is there already: held until its deadline
    lease_ms = own_lease_ms
  end
  redis.call('ZADD', P .. ':l:' .. wid, now + lease_ms, lease)
  return {'placed', wid, proc, redis.call('GET', P .. ':proc:' .. proc) or '', seq}
end
local queue = P .. ':q:' .. provider
if max_queue >= 0 and redis.call('ZCARD', queue) >= max_queue then
  return {'full', '', '', '', seq}
end
redis.call('ZADD', queue, seq, lease)
local lane_key = P .. ':ql:' .. provider .. ':' .. lane
if lane ~= 'requeued' then
  local weights = P .. ':qw:' .. provider
  if redis.call('ZCARD', lane_key) == 0 then
    redis.call('RPUSH', P .. ':qr:' .. provider, lane)  -- joins at the back, full credit
    redis.call('HSET', P .. ':qc:' .. provider, lane, weight)
  elseif tonumber(redis.call('HGET', weights, lane) or weight) ~= weight then
    local credits = P .. ':qc:' .. provider
    local credit = tonumber(redis.call('HGET', credits, lane) or weight)
    redis.call('HSET', credits, lane, math.min(credit, weight))
  end
  redis.call('HSET', weights, lane, weight)
end
redis.call('ZADD', lane_key, seq, lease)
redis.call('HSET', P .. ':qe:' .. lease, 'model', model, 'origin', origin, 'deadline', deadline,
           'plain', plain, 'lane', lane)
redis.call('PEXPIREAT', P .. ':qe:' .. lease, deadline)
return {'queued', '', '', '', seq}
"""

#: Lua shared by the scripts that take entries out of the shared queue.
_LANES = """
local function drop_lane_if_empty(P, provider, lane)
  if lane ~= 'requeued' and redis.call('ZCARD', P .. ':ql:' .. provider .. ':' .. lane) == 0 then
    redis.call('LREM', P .. ':qr:' .. provider, 1, lane)
    redis.call('HDEL', P .. ':qc:' .. provider, lane)
    redis.call('HDEL', P .. ':qw:' .. provider, lane)
  end
end

local function unqueue(P, provider, lane, entry)
  redis.call('ZREM', P .. ':q:' .. provider, entry)
  redis.call('ZREM', P .. ':ql:' .. provider .. ':' .. lane, entry)
  redis.call('DEL', P .. ':qe:' .. entry)
end
"""

_RELEASE = (
    _LANES
    + """
local P, wid, lease = ARGV[1], ARGV[2], ARGV[3]
local now, lease_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local leases = P .. ':l:' .. wid
if lease ~= '' then
  redis.call('ZREM', leases, lease)
end
local w = redis.call('HMGET', P .. ':w:' .. wid, 'proc', 'max', 'draining', 'provider', 'picky')
if not w[1] or w[3] == '1' or redis.call('EXISTS', P .. ':proc:' .. w[1]) == 0 then
  return false
end
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
if redis.call('ZCARD', leases) >= tonumber(w[2]) then
  return false
end
local provider = w[4]
local models = {}
for _, m in ipairs(redis.call('SMEMBERS', P .. ':wm:' .. wid)) do
  models[m] = true
end

-- The oldest entry of a lane this worker can serve (dead entries are pruned on the way).
local function oldest(lane)
  local lane_key = P .. ':ql:' .. provider .. ':' .. lane
  local start = 0
  while true do
    local batch = redis.call('ZRANGE', lane_key, start, start + 63)
    if #batch == 0 then
      return nil
    end
    local kept = 0
    for _, entry in ipairs(batch) do
      local e = redis.call('HMGET', P .. ':qe:' .. entry, 'model', 'origin', 'deadline', 'plain')
      if not e[1] or tonumber(e[3]) <= now or redis.call('EXISTS', P .. ':proc:' .. e[2]) == 0 then
        unqueue(P, provider, lane, entry)
      elseif models[e[1]] and (w[5] ~= '1' or e[4] == '1') then
        return {entry, e[2]}
      else
        kept = kept + 1
      end
    end
    start = start + kept
  end
end

local function take(lane, found)
  unqueue(P, provider, lane, found[1])
  redis.call('ZADD', leases, now + lease_ms, found[1])
  return found
end

local found = oldest('requeued')
if found then
  return take('requeued', found)  -- it had its turn already: nothing is charged
end
local ring = P .. ':qr:' .. provider
for _, lane in ipairs(redis.call('LRANGE', ring, 0, -1)) do
  found = oldest(lane)
  if found then
    take(lane, found)
    if redis.call('ZCARD', P .. ':ql:' .. provider .. ':' .. lane) == 0 then
      drop_lane_if_empty(P, provider, lane)
    elseif redis.call('HINCRBY', P .. ':qc:' .. provider, lane, -1) <= 0 then
      -- the lane's turn is over: to the back of the ring, credit refilled
      local weight = redis.call('HGET', P .. ':qw:' .. provider, lane) or '1'
      redis.call('HSET', P .. ':qc:' .. provider, lane, weight)
      redis.call('LREM', ring, 1, lane)
      redis.call('RPUSH', ring, lane)
    end
    return found
  end
  drop_lane_if_empty(P, provider, lane)  -- when pruning emptied it
end
return false
"""
)

_WITHDRAW = (
    _LANES
    + """
local P, provider, entry = ARGV[1], ARGV[2], ARGV[3]
local lane = redis.call('HGET', P .. ':qe:' .. entry, 'lane') or ARGV[4]
unqueue(P, provider, lane, entry)
drop_lane_if_empty(P, provider, lane)
return 1
"""
)

_EXTEND = """
local P, wid, lease, expiry = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', P .. ':w:' .. wid) == 1 then
  redis.call('ZADD', P .. ':l:' .. wid, 'XX', expiry, lease)
end
return 1
"""


def lane_of(key_id: int | None, requeued: bool) -> str:
    """The shared-queue lane of a request of API key ``key_id`` (None: no key);
    ``requeued``: it was dispatched before and goes ahead of every key."""
    if requeued:
        return "requeued"
    return "anon" if key_id is None else f"k{key_id}"


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a reservation landed: a worker, the process it is connected to, and that
    process's address."""

    worker_id: str
    owner: str
    address: str


class ClusterState:
    def __init__(self, redis: aioredis.Redis, prefix: str, lean: LeanRedis | None = None) -> None:
        """``lean``: run the per-request scripts through it (:mod:`relay.server.cluster.leanredis`);
        membership and the rest go through ``redis``."""
        self.redis = redis
        self.prefix = prefix
        scripts: Any = (lambda source: Script(lean, source)) if lean else redis.register_script
        self._place = scripts(_PLACE)
        self._release = scripts(_RELEASE)
        self._extend = scripts(_EXTEND)
        self._withdraw = scripts(_WITHDRAW)

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
        lane: str = "anon",
        weight: int = 1,
    ) -> tuple[str, Placed | None, int]:
        """Reserve the least-loaded slot for ``model`` or queue ``entry`` at the back of
        ``lane`` (see :func:`lane_of`), whose turns are ``weight`` requests long.

        Returns ``("placed", where, seq)``, ``("queued", None, seq)`` or
        ``("full", None, seq)``. A slot on a worker of ``origin`` itself is held for
        ``hold_ms`` at once (nothing has to travel, so nothing has to be extended); one
        elsewhere for PENDING_LEASE_MS until the request arrives. ``seq`` is the
        request's place in the global arrival order (give it back when the request is
        placed again, to keep its place).
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
            ]
        )
        kind, worker, owner, address = (self.decode(part) for part in reply[:4])
        placed = Placed(worker, owner, address) if kind == "placed" else None
        return kind, placed, int(reply[4])

    async def release(self, worker_id: str, lease: str, now_ms: int) -> tuple[str, str] | None:
        """Release ``lease`` on the worker and give the free slot to the queued request
        it should serve next (requeued first, then the keys' turns): returns that
        request's ``(entry, origin)`` (its slot is reserved under ``entry``), or None."""
        popped = await self._release(args=[self.prefix, worker_id, lease, now_ms, PENDING_LEASE_MS])
        if not popped:
            return None
        return self.decode(popped[0]), self.decode(popped[1])

    async def extend(self, worker_id: str, lease: str, expiry_ms: int) -> None:
        """The reserved request reached its worker: keep the slot until its deadline."""
        await self._extend(args=[self.prefix, worker_id, lease, expiry_ms])

    async def withdraw(self, provider: str, entry: str, lane: str) -> None:
        """Drop a waiting entry (its request ended where it was admitted)."""
        await self._withdraw(args=[self.prefix, provider, entry, lane])

    async def queue_depth(self) -> int:
        total = 0
        async for key in self.redis.scan_iter(match=self._key("q", "*")):
            total += await self.redis.zcard(key)
        return total

    # -- membership ----------------------------------------------------------------

    async def announce(self, instance: str, address: str, workers: list[str]) -> None:
        """Refresh this process's address and its workers' keys (called every second)."""
        ttl = PROC_TTL_MS
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self._key("proc", instance), address, px=ttl)
            for wid in workers:
                for kind in ("w", "wm", "l"):
                    pipe.pexpire(self._key(kind, wid), ttl)
            await pipe.execute()

    async def publish_worker(
        self,
        *,
        worker_id: str,
        instance: str,
        provider: str,
        max_concurrent: int,
        draining: bool,
        picky: bool,
        models: list[str],
        dropped: list[str],
        leases: dict[str, int],
    ) -> None:
        """Offer a local worker's capacity (or update it); ``dropped`` are models it no
        longer serves; ``leases`` the reservations it holds (after Redis came back)."""
        ttl = PROC_TTL_MS
        w, wm, ls = self._key("w", worker_id), self._key("wm", worker_id), self._key("l", worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                w,
                mapping={
                    "proc": instance,
                    "provider": provider,
                    "max": max_concurrent,
                    "draining": "1" if draining else "0",
                    "picky": "1" if picky else "0",
                },
            )
            pipe.delete(wm)
            if models:
                pipe.sadd(wm, *models)
            for model in models:
                pipe.sadd(self._key("m", provider, model), worker_id)
            for model in dropped:
                pipe.srem(self._key("m", provider, model), worker_id)
            if leases:
                pipe.zadd(ls, leases)
            for key in (w, wm, ls):
                pipe.pexpire(key, ttl)
            await pipe.execute()

    async def remove_worker(self, worker_id: str, provider: str, models: list[str]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for kind in ("w", "wm", "l"):
                pipe.delete(self._key(kind, worker_id))
            for model in models:
                pipe.srem(self._key("m", provider, model), worker_id)
            await pipe.execute()

    async def served_models(self) -> dict[str, set[str]]:
        """provider -> models some live worker of the cluster serves (its own included)."""
        out: dict[str, set[str]] = {}
        pattern = self._key("m", "*")
        skip = len(self.prefix) + 3
        async for raw in self.redis.scan_iter(match=pattern, count=1000):
            provider, _, model = self.decode(raw)[skip:].partition(":")
            out.setdefault(provider, set()).add(model)
        return out

    async def leave(self, instance: str) -> None:
        await self.redis.delete(self._key("proc", instance))

    async def instances(self) -> list[str]:
        return [
            key.rsplit(":", 1)[1]
            async for key in self.redis.scan_iter(match=self._key("proc", "*"))
        ]

    def channel(self, instance: str) -> str:
        """The pub/sub channel on which ``instance`` hears of slots found for its requests."""
        return self._key("ctl", instance)

    async def notify(self, instance: str, message: str) -> None:
        await self.redis.publish(self.channel(instance), message)

    @staticmethod
    def decode(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)
