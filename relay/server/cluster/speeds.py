"""Speeds across processes (SPEC §21): every process predicts from the same numbers.

:class:`ClusterSpeeds` is a base of :class:`relay.server.cluster.placement.RedisPlacement`.
Each process learns the speeds of the workers connected to it (:mod:`relay.core.rates`)
and, every RATES_SHARE_SECS (from its control loop, never on a request's way), shares
them in Redis with each worker's load at that moment (``P:sp:<instance>``, expiring three
periods later), then reads every process's back. From those documents alone (its own
included) each process builds the same table, so two processes predict the same cost
for the same worker until the next share:

- placing a request under ``ROUTING_POLICY=predicted`` (or with a deadline), the
  process passes each worker's predicted cost to the placement script
  (:meth:`ClusterSpeeds.costs`): ``base`` (overhead plus the prompt's tokens at the
  worker's prefill rate), ``per`` (what one request in flight adds, from its learned
  prefill and service times) and ``hit`` (what the worker saves when it holds the
  conversation); the script adds the load it reads atomically and picks the cheapest
  within the bounded-load guard (``lua/place.lua``);
- a deadline checked in cluster mode takes the best of the other processes' workers
  from the same table, loads as last shared (:meth:`ClusterSpeeds.predict`);
- the other processes' speeds count in each model's fleet median
  (:meth:`relay.core.rates.Rates.share`): a worker with no history borrows the whole
  cluster's.

The documents are the cluster's own (written by processes that share its credentials),
bounded all the same: one over :data:`MAX_DOCUMENT_BYTES` or that does not decode is
skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from relay.core.relay import Relay
from relay.core.speed import Fit, Speed
from relay.core.state import RelayRequest

if TYPE_CHECKING:
    from relay.server.cluster.state import ClusterState

logger = logging.getLogger("relay.cluster")

#: The largest speeds document a process shares or reads (about 2,500 workers' one model
#: each: decoded in a few ms), and how many of its workers are taken between two looks at
#: the event loop: reading every process's never holds the loop up. A process with more
#: shares the speeds of as many of its workers as fit.
MAX_DOCUMENT_BYTES = 256 * 1024
SLICE = 200


class _Shared(msgspec.Struct, array_like=True):
    """One worker as its process shares it: provider, load, model -> numbers (see
    :class:`SharedSpeed`; none for a model it has no history of)."""

    provider: str
    load: int
    models: dict[str, list[float]]


class _Document(msgspec.Struct):
    workers: dict[str, _Shared] = {}
    #: model -> bytes per token, as that process learned it.
    bpt: dict[str, float] = {}


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Document).decode


class SharedSpeed(NamedTuple):
    """A worker's speed on a model as shared (seconds, tokens a second): what its
    process predicts from, then the worker's own line (see :class:`relay.core.rates.Speed`)."""

    secs_per_token: float
    overhead: float
    decode: float
    service: float
    confidence: float
    samples: float
    per_load: float
    own_secs_per_token: float
    own_overhead: float
    own_decode: float
    own_service: float


#: How many numbers a shared speed is.
_FIELDS = len(SharedSpeed._fields)


class SharedWorker(NamedTuple):
    provider: str
    load: int
    instance: str
    #: The models routed to it, and its speeds on those it has a history of.
    serves: frozenset[str]
    models: dict[str, SharedSpeed]


#: A speed's numbers are shared anew once one moved by more than this share (or it
#: learned from a new request).
MOVED = 0.02


def _same(before: list[float], now: list[float]) -> bool:
    """Whether ``now`` may be shared as ``before``: no new sample (index 5), and no
    number moved by more than :data:`MOVED` of itself."""
    if len(before) != len(now) or before[5] != now[5]:
        return False
    return all(abs(b - n) <= MOVED * max(abs(b), abs(n)) for b, n in zip(before, now, strict=True))


class ClusterSpeeds:
    if TYPE_CHECKING:  # provided by the placement
        relay: Relay
        state: ClusterState
        instance: str

    def _init_speeds(self, share_secs: float) -> None:
        self.share_secs = share_secs
        self._shared_at = -math.inf
        #: Every live worker's shared speeds (this process's too), by worker id.
        self.shared: dict[str, SharedWorker] = {}
        #: model -> bytes per token (the mean of what the processes shared).
        self.shared_bpt: dict[str, float] = {}
        #: (worker, model) -> the numbers last shared for it here.
        self._published: dict[tuple[str, str], list[float]] = {}

    async def _speeds_tick(self, force: bool = False) -> None:
        """Share this process's speeds and read everyone's, once per RATES_SHARE_SECS
        (called by the control loop; raises on a Redis error like the rest of it)."""
        now = self.relay.loop.time()
        if not force and now - self._shared_at < self.share_secs:
            return
        self._shared_at = now
        ttl_ms = max(1000, int(3000 * self.share_secs))
        await self.state.share_speeds(self.instance, self._document(now), ttl_ms)
        await self._take_speeds(await self.state.shared_speeds(), now)

    def _document(self, now: float) -> bytes:
        """This process's workers, their loads and speeds. A speed is shared again as it
        was while it learned nothing new and its fit (fading towards the fleet's) moved
        by less than :data:`MOVED`: between changes, every process reads the same
        numbers, so they predict exactly alike."""
        relay = self.relay
        published: dict[tuple[str, str], list[float]] = {}
        workers: dict[str, _Shared] = {}
        for worker in relay.registry.workers.values():
            models: dict[str, list[float]] = {}
            for model in worker.model_set:
                speed = worker.speed.get(model)
                if speed is None or not speed.samples:
                    models[model] = []
                    continue
                fit = relay.rates.fit(worker, model, now)
                numbers = [
                    *fit,
                    speed.confidence,
                    float(speed.samples),
                    speed.per_load,
                    *speed.own,
                ]
                before = self._published.get((worker.id, model))
                if before is not None and _same(before, numbers):
                    numbers = before
                models[model] = published[(worker.id, model)] = numbers
            workers[worker.id] = _Shared(worker.provider, worker.load, models)
        self._published = published
        bpt = {
            model: round(relay.rates.bytes_per_token(model), 2) for model in relay.rates.models()
        }
        raw = _encode(_Document(workers=workers, bpt=bpt))
        while len(raw) > MAX_DOCUMENT_BYTES and workers:
            keep = int(len(workers) * MAX_DOCUMENT_BYTES / len(raw) * 0.95)
            workers = dict(sorted(workers.items())[:keep])
            raw = _encode(_Document(workers=workers, bpt=bpt))
            logger.warning("cluster: speeds of only %d workers fit in what is shared", keep)
        return raw

    async def _take_speeds(self, documents: Iterable[tuple[str, bytes]], now: float) -> None:
        """Every process's document, into the table predictions use (swapped in whole at
        the end), taken a slice of workers at a time."""
        shared: dict[str, SharedWorker] = {}
        bpt: dict[str, list[float]] = {}
        taken = 0
        for instance, raw in documents:
            if len(raw) > MAX_DOCUMENT_BYTES:
                logger.warning("cluster: speeds of %s skipped: %d bytes", instance, len(raw))
                continue
            try:
                document = _decode(raw)
            except msgspec.DecodeError as exc:
                logger.warning("cluster: speeds of %s skipped: %s", instance, exc)
                continue
            await asyncio.sleep(0)
            for worker_id, row in document.workers.items():
                taken += 1
                if taken % SLICE == 0:
                    await asyncio.sleep(0)
                models = {
                    model: SharedSpeed(*numbers[:_FIELDS])
                    for model, numbers in row.models.items()
                    if len(numbers) >= _FIELDS
                    and all(math.isfinite(x) and x >= 0 for x in numbers[:_FIELDS])
                    and numbers[0] > 0
                }
                shared[worker_id] = SharedWorker(
                    row.provider, row.load, instance, frozenset(row.models), models
                )
            for model, value in document.bpt.items():
                if math.isfinite(value) and value > 0:
                    bpt.setdefault(model, []).append(value)
        local = self.relay.registry.workers
        remote: dict[str, dict[str, Speed]] = {}
        for worker_id, known in shared.items():
            if worker_id in local or not known.models:
                continue
            taken += 1
            if taken % SLICE == 0:
                await asyncio.sleep(0)
            remote[worker_id] = {
                model: Speed.shared(
                    now,
                    Fit(x.secs_per_token, x.overhead, x.decode, x.service),
                    Fit(x.own_secs_per_token, x.own_overhead, x.own_decode, x.own_service),
                    x.confidence,
                    int(x.samples),
                )
                for model, x in known.models.items()
            }
        self.shared = shared
        self.shared_bpt = {model: sum(v) / len(v) for model, v in bpt.items()}
        self.relay.rates.share(remote)

    def shared_view(self) -> dict[str, Any]:
        """The table every process predicts from (``/admin/stats``): per worker, its
        process, load and speeds as last shared."""
        return {
            worker_id: {
                "instance": row.instance,
                "provider": row.provider,
                "load": row.load,
                "models": {
                    model: {
                        "prefill_tokens_per_sec": round(1.0 / s.secs_per_token, 1),
                        "overhead_ms": round(1000 * s.overhead, 1),
                        "decode_tokens_per_sec": round(s.decode, 2),
                        "per_request_in_flight_ms": round(1000 * s.per_load, 1),
                        "confidence": round(s.confidence, 3),
                    }
                    for model, s in sorted(row.models.items())
                },
            }
            for worker_id, row in sorted(self.shared.items())
        }

    # -- what predictions use ------------------------------------------------------------

    def _tokens(self, request: RelayRequest) -> tuple[float, float]:
        """``request``'s prompt tokens, and those a worker holding its conversation would
        have cached (its whole blocks), by the cluster's bytes per token."""
        per_token = self.shared_bpt.get(request.model) or self.relay.rates.bytes_per_token(
            request.model
        )
        tokens = request.prompt_bytes / per_token
        affinity = request.affinity
        held = 0.0
        if affinity is not None and affinity.blocks:
            config = self.relay.config.affinity
            held = affinity.covered(len(affinity.blocks), config.block_bytes) / per_token
        return tokens, held

    def costs(self, request: RelayRequest) -> tuple[str, tuple[float, float]]:
        """The predicted costs (ms) of the workers serving ``request``'s model, for the
        placement script, and the cost of a worker none was shared for (the fleet's)."""
        tokens, held = self._tokens(request)
        entries = []
        for worker_id, row in self.shared.items():
            speed = row.models.get(request.model)
            if speed is None or row.provider != request.provider:
                continue
            base = speed.overhead + tokens * speed.secs_per_token
            hit = min(held, tokens) * speed.secs_per_token
            entries.append(
                f"{worker_id} {1000 * base:.3f} {1000 * speed.per_load:.3f} {1000 * hit:.3f}"
            )
        prior = self.relay.rates.prior(request.model, self.relay.loop.time())
        default = 1000 * (prior.overhead + tokens * prior.secs_per_token)
        return ";".join(entries), (round(default, 3), 0.0)

    def predict(self, request: RelayRequest) -> float | None:
        """The lowest predicted time to first token of ``request`` on another process's
        worker (loads as last shared); None: none known to serve its model."""
        tokens, _ = self._tokens(request)
        local = self.relay.registry.workers
        prior = self.relay.rates.prior(request.model, self.relay.loop.time())
        best: float | None = None
        for worker_id, row in self.shared.items():
            if worker_id in local or row.provider != request.provider:
                continue
            if request.model not in row.serves:
                continue
            speed = row.models.get(request.model)
            if speed is None:  # no history there: the fleet's
                ttft = prior.overhead + tokens * prior.secs_per_token
            else:
                ttft = speed.overhead + tokens * speed.secs_per_token + row.load * speed.per_load
            if best is None or ttft < best:
                best = ttft
        return best
