"""The Django edge around the relay core: one :class:`Relay` per event loop.

Builds the core's config from settings and keeps its provider table and the API-key
cache in sync with the database (at once for changes made in this process, within
SYNC_SECS for changes made elsewhere). Owns the background tasks that go with the
relay (sync, request-log bookkeeping), the auth throttle and the metrics registry.
HTTP handlers and the worker consumer reach the core only through :func:`current`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Callable
from typing import Any, cast

from django.conf import settings

from relay.core import classes, deadlines, providers, snapshot
from relay.core.affinity import AffinityConfig, Policy
from relay.core.config import DeadlineConfig, HedgeConfig, RelayConfig
from relay.core.keeper import StreamKeeper
from relay.core.keycache import KeyCache
from relay.core.keystats import KeyStats, key_name, key_rows
from relay.core.limits import NO_LIMITS, KeyLimits, Limiter, LimitStore, Ticket
from relay.core.limitstore import MemoryLimitStore
from relay.core.ratelimit import AuthThrottle, Network, parse_networks
from relay.core.relay import Relay
from relay.core.speed import SpeedConfig
from relay.core.stats import RequestRecord
from relay.core.streamlog import Bounds, StreamStore
from relay.core.streamstore import MemoryStreams
from relay.server import store
from relay.server.accesslog import AccessLog
from relay.server.batches.engine import BatchEngine
from relay.server.bookkeeper import Bookkeeper, in_thread
from relay.server.cluster.control import TROUBLE as CLUSTER_TROUBLE
from relay.server.cluster.control import Cluster, close_workers_of
from relay.server.cluster.limits import RedisLimitStore
from relay.server.cluster.placement import RedisPlacement
from relay.server.cluster.proxy import cluster_token
from relay.server.cluster.redissource import RedisSource
from relay.server.cluster.streamstore import RedisStreams
from relay.server.cors import CorsPolicy
from relay.server.federation import Federation
from relay.server.identities import Identities
from relay.server.metrics import RelayMetrics
from relay.server.tracing import EdgeTracer
from relay.server.tracing import from_environment as tracing_from_environment
from relay.wire.errors import Flavor

logger = logging.getLogger("relay.runtime")

#: The close reason workers see when an operator rotates their provider's secret and
#: disconnects them.
SECRET_ROTATED = providers.SECRET_ROTATED
#: How long a stopping runtime waits for its background tasks to end.
STOP_TASKS_SECS = 5.0
#: Retained streams that expired are forgotten at least this often.
SWEEP_SECS = 10.0
#: The longest an admin key change waits for this process to take it (:meth:`Runtime.synced`).
SYNCED_WAIT_SECS = 5.0


def relay_config() -> RelayConfig:
    s = settings
    return RelayConfig(
        max_queue_len=s.MAX_QUEUE_LEN,
        queue_timeout=s.QUEUE_TIMEOUT_SECS,
        request_timeout=s.REQUEST_TIMEOUT_SECS,
        heartbeat_interval=s.HEARTBEAT_INTERVAL_SECS,
        heartbeat_timeout=s.HEARTBEAT_TIMEOUT_SECS,
        register_timeout=s.REGISTER_TIMEOUT_SECS,
        max_requeue_count=s.MAX_REQUEUE_COUNT,
        max_models_per_worker=s.MAX_MODELS_PER_WORKER,
        max_model_name_len=s.MAX_MODEL_NAME_LEN,
        max_message_bytes=s.MAX_MESSAGE_BYTES,
        max_stream_bytes=s.MAX_STREAM_BYTES,
        max_request_bytes=s.MAX_REQUEST_BYTES,
        stream_buffer_bytes=s.STREAM_BUFFER_BYTES,
        stream_buffer_total_bytes=s.STREAM_BUFFER_TOTAL_BYTES,
        stall_timeout=s.STALL_TIMEOUT_SECS,
        stream_end_grace=s.STREAM_END_GRACE_SECS,
        aliases=dict(s.MODEL_ALIASES),
        model_memory=s.MODEL_MEMORY_SECS,
        drain_timeout=s.DRAIN_TIMEOUT_SECS,
        shutdown_grace=s.SHUTDOWN_GRACE_SECS,
        require_protocol_version=s.REQUIRE_PROTOCOL_VERSION,
        priority_aging=s.PRIORITY_AGING_SECS or None,
        max_preemptions=s.PRIORITY_MAX_PREEMPTIONS,
        affinity=AffinityConfig(
            policy=cast(Policy, s.ROUTING_POLICY),  # (checked by the settings)
            block_bytes=s.AFFINITY_BLOCK_BYTES,
            worker_blocks=s.AFFINITY_WORKER_BLOCKS,
            max_keys=s.AFFINITY_MAX_KEYS,
            load_factor=s.AFFINITY_LOAD_FACTOR,
            load_slack=s.AFFINITY_LOAD_SLACK,
            min_match=s.AFFINITY_MIN_MATCH,
            cluster_ttl=s.AFFINITY_TTL_SECS,
            session_header=s.AFFINITY_SESSION_HEADER,
            share_across_keys=s.AFFINITY_SHARE_ACROSS_KEYS,
        ),
        non_generating_per_worker=s.NON_GENERATING_PER_WORKER,
        model_load_timeout=s.MODEL_LOAD_TIMEOUT_SECS,
        model_scale_out_wait=s.MODEL_SCALE_OUT_WAIT_SECS,
        model_idle_unload=s.MODEL_IDLE_UNLOAD_SECS,
        speed=SpeedConfig(half_life=s.RATES_HALF_LIFE_SECS),
        deadlines=DeadlineConfig(
            by_class={
                name: ms
                for name, ms in (
                    (classes.PRIORITY, s.DEADLINE_MS_PRIORITY),
                    (classes.DEFAULT, s.DEADLINE_MS_DEFAULT),
                    (classes.FLEX, s.DEADLINE_MS_FLEX),
                )
                if ms
            }
        ),
        hedging=HedgeConfig(max_share=s.HEDGE_MAX_SHARE, min_delay=s.HEDGE_MIN_DELAY_MS / 1000),
    )


def stream_bounds() -> Bounds:
    s = settings
    return Bounds(
        retain_secs=s.STREAM_RETAIN_SECS,
        max_bytes=s.STREAM_RETAIN_BYTES,
        total_bytes=s.STREAM_RETAIN_TOTAL_BYTES,
        per_key=s.STREAM_RETAIN_PER_KEY,
    )


class Runtime:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.config = relay_config()
        self.relay = Relay(self.config, instance=secrets.token_hex(3))
        self.throttle = AuthThrottle(
            max_failures=settings.AUTH_MAX_FAILURES,
            window=settings.AUTH_FAILURE_WINDOW_SECS,
            block=settings.AUTH_BLOCK_SECS,
        )
        self.trusted_proxies: list[Network] = parse_networks(settings.TRUSTED_PROXIES)
        #: Workers with a credential of their own connected here (SPEC §22).
        self.identities = Identities(
            self.relay.instance, settings.SECRET_PEPPER, settings.WORKER_LEASE_SECS
        )
        self.cors = CorsPolicy(settings.CORS_ALLOWED_ORIGINS)
        self.require_keys: bool = settings.MODELRELAY_REQUIRE_API_KEYS
        self.metrics_token: str = settings.MODELRELAY_METRICS_TOKEN
        self.keys = KeyCache(settings.SECRET_PEPPER)
        self.bookkeeper = Bookkeeper(
            self.keys,
            flush_interval=settings.REQUEST_LOG_FLUSH_SECS,
            retention_days=settings.AUDIT_RETENTION_DAYS,
        )
        #: Every Redis connection of this process is built from it (cluster mode).
        target = settings.REDIS_TARGET
        self.redis: RedisSource | None = RedisSource(target) if target is not None else None
        self.limit_store: LimitStore
        if self.redis is not None and self.require_keys:
            self.limit_store = RedisLimitStore(
                self.redis,
                settings.REDIS_PREFIX,
                self.relay.instance,
                lease_secs=settings.LIMITS_LEASE_SECS,
                spend_source=lambda at: in_thread(store.load_spend, at),
                calendar=lambda: self.limiter.calendar.at(self.limiter.clock()),
            )
        else:
            self.limit_store = MemoryLimitStore()
        self.limiter = Limiter(self.limit_store)
        self.key_stats = KeyStats()
        #: Resumable responses (SPEC §18): their logs and the pumps that write them (in
        #: cluster mode the logs are in Redis, where every process reads them).
        kept: StreamStore = MemoryStreams(stream_bounds())
        if self.redis is not None:
            kept = RedisStreams(
                self.redis,
                settings.REDIS_PREFIX,
                self.relay.instance,
                stream_bounds(),
                running_ttl=settings.REQUEST_TIMEOUT_SECS,
            )
        self.streams = StreamKeeper(self.relay, kept, broadcast=self._stream_cancel)
        #: Batches (SPEC §16): runs the lines of batches on idle capacity.
        self.batches = BatchEngine(self)
        self.metrics = RelayMetrics(
            self.relay,
            key_rows=self._key_rows_now,
            batch_counts=self.batches.counts,
            stream_counts=self.streams.describe,
        )
        self.relay.observers.extend(
            [
                self.keys.observe,
                self.bookkeeper.observe,
                self.metrics.observe,
                self.key_stats.observe,
                self._charge_placed,
                self.batches.observe,
            ]
        )
        if settings.ACCESS_LOG:
            access = AccessLog(self.keys, json_lines=settings.LOG_FORMAT == "json")
            self.relay.observers.append(access.observe)
        #: OpenTelemetry traces (SPEC §17): a NullTracing unless OTEL_* turns them on.
        self.tracing: EdgeTracer = tracing_from_environment(
            clock=loop.time, keys=self.keys, trust_incoming=settings.OTEL_TRUST_INCOMING
        )
        self.relay.tracer = self.tracing
        #: The latest metrics sample of each worker connected here (SPEC §17).
        self.federation = Federation(
            settings.WORKER_METRICS_MAX_BYTES, settings.WORKER_METRICS_MAX_SERIES
        )
        self.sockets = 0
        self._sockets_gone = asyncio.Event()
        #: HTTP requests this process is serving now (any path).
        self.http_open = 0
        self._http_idle = asyncio.Event()
        self._poke = asyncio.Event()
        self._loaded = asyncio.Event()
        #: Sync rounds begun and ended, for :meth:`synced`; a round ending wakes it.
        self._rounds_begun = 0
        self._rounds_ended = 0
        self._round_ended = asyncio.Event()
        self._keys_version: tuple[object, int] | None = None
        self._batch_task = loop.create_task(self.batches.run())
        self._tasks: list[asyncio.Task[None]] = [
            loop.create_task(self._sync_loop()),
            loop.create_task(self.bookkeeper.run()),
            self._batch_task,
            loop.create_task(self.streams.run(min(settings.STREAM_RETAIN_SECS, SWEEP_SECS))),
        ]
        if isinstance(self.limit_store, RedisLimitStore):
            self._tasks.append(loop.create_task(self.limit_store.run()))
        self._spend_seeded = False
        self.cluster: Cluster | None = None
        self.placement: RedisPlacement | None = None
        self.cluster_token = cluster_token(settings.SECRET_PEPPER)
        if self.redis is not None:
            # Sentinel: where the master is, asked every tick (a switch is noticed then).
            self._tasks.append(loop.create_task(self.redis.watch(settings.CLUSTER_TICK_SECS)))
            self.cluster = Cluster(
                self.relay,
                self.redis,
                settings.REDIS_PREFIX,
                on_sync=self.poke,
                on_stream_cancel=self.streams.cancel_here,
            )
            self._tasks.append(loop.create_task(self.cluster.run()))
            self.placement = RedisPlacement(
                self.relay,
                self.redis,
                settings.REDIS_PREFIX,
                self.cluster_token,
                tick=settings.CLUSTER_TICK_SECS,
                ttl=settings.CLUSTER_TTL_SECS,
                share_speeds=settings.RATES_SHARE_SECS,
                local_slack=settings.CLUSTER_LOCAL_SLACK,
            )
            self.relay.placement = self.placement
            self.metrics.collector.cluster = self.placement.describe
            self._tasks.append(loop.create_task(self.placement.run()))
            if settings.CLUSTER_ADVERTISE_URL:
                self.placement.listening(settings.CLUSTER_ADVERTISE_URL)

    async def _stream_cancel(self, owner: int | None, stream: str) -> None:
        """Cluster mode: ask every process to stop a resumable response (its log is
        marked as well, which its writer reads at its next append: a lost notice only
        delays the stop)."""
        if self.cluster is None:
            return
        try:
            await self.cluster.broadcast_stream_cancel(owner, stream)
        except CLUSTER_TROUBLE as exc:
            logger.warning("could not tell the other processes to stop %s: %s", stream, exc)

    def listening(self, host: str, port: int) -> None:
        """The server listens on ``host:port``: in cluster mode, the other processes
        reach this one there (unless CLUSTER_ADVERTISE_URL says otherwise)."""
        if self.placement is not None and not settings.CLUSTER_ADVERTISE_URL:
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostname()
            shown = f"[{host}]" if ":" in host else host
            self.placement.listening(f"http://{shown}:{port}")

    def authenticate(
        self, headers: list[tuple[bytes, bytes]], flavor: Flavor
    ) -> tuple[int | None, frozenset[str]]:
        """Check the client's API key when keys are required.

        Returns the key id (``None`` when keys are off) and the names of the headers
        that carried relay credentials, which must not be forwarded to backends.
        """
        if not self.require_keys:
            return None, frozenset()
        return self.keys.authenticate(headers, flavor)

    def key_limits(self, key_id: int) -> KeyLimits:
        known = self.keys.get(key_id)
        return NO_LIMITS if known is None else known.limits

    def deadline(self, key_id: int | None, service_class: str, stated: int | None) -> int | None:
        """A request's first-token deadline in ms (SPEC §21): what it stated
        (``X-Deadline-Ms``), else its key's default, else its class's; None: none."""
        key_default = self.key_limits(key_id).deadline_ms if key_id is not None else None
        return deadlines.resolve(
            stated, key_default, self.config.deadlines.by_class.get(service_class)
        )

    def service_class(self, key_id: int | None, wanted: str | None) -> str:
        """The priority class a request gets (SPEC §15): what it asked for, else its key's
        default, never above what its key may ask for. Without keys, what it asked for."""
        if key_id is None:
            return classes.resolve(wanted)
        limits = self.key_limits(key_id)
        return classes.resolve(wanted, limits.default_class, limits.max_class)

    async def admit(self, key_id: int, model: str, cost: Callable[[], int] | None = None) -> Ticket:
        """Check the key's limits for one request (SPEC §13); raises the error to send.
        ``cost()`` says what it may cost (:func:`relay.core.limits.reservation`): called,
        and reserved, only when the key has a token budget."""
        limits = self.key_limits(key_id)
        tokens = cost() if cost is not None and limits.budgeted else 0
        return await self.limiter.admit(key_id, limits, model, tokens)

    def _charge_placed(self, record: RequestRecord) -> None:
        """Request observer (cluster mode): a request another process admitted ran on
        a worker here; its tokens count against the key's budgets from here (the other
        process frees the key's slot but never learns the tokens)."""
        if record.relay_role == "worker" and record.key_id is not None:
            tokens = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
            self.limiter.charge(record.key_id, tokens)

    def key_name(self, key_id: int) -> str:
        return key_name(self.keys, key_id)

    async def key_usage(self) -> list[dict[str, Any]]:
        """Who is using the pool: one row per key, busiest first, spend refreshed."""
        spend = await self.limiter.spend(self._spend_ids())
        return key_rows(self.relay, self.keys, self.limiter, self.key_stats, spend)

    def _key_rows_now(self) -> list[dict[str, Any]]:
        """:meth:`key_usage` with the spend last read (for scrapes, which cannot wait)."""
        return key_rows(
            self.relay, self.keys, self.limiter, self.key_stats, self.limiter.last_spend
        )

    def _spend_ids(self) -> set[int]:
        ids = {key.id for key in self.keys.active()}
        ids.update(self.limiter.open, self.key_stats.finished, self.key_stats.refused)
        return ids

    async def workers(self) -> list[dict[str, object]]:
        """Connected workers: of every server process with Redis, else of this one."""
        if self.cluster is not None:
            return await self.cluster.workers()
        return snapshot.workers(self.relay)

    async def drain(self, worker_id: str, *, drain_secs: float | None = None, reason: str) -> bool:
        """Drain a worker connected here or, with Redis, to another process (raises
        :class:`~relay.server.cluster.control.ClusterUnreachable` when Redis cannot say)."""
        if self.relay.drain_worker(worker_id, timeout=drain_secs, reason=reason):
            return True
        return self.cluster is not None and await self.cluster.forward(
            "drain", worker_id, timeout=drain_secs, reason=reason
        )

    async def refresh(self, worker_id: str, *, reason: str) -> bool:
        """Ask a worker connected here or, with Redis, to another process for its models."""
        if self.relay.refresh_models(worker_id, reason=reason):
            return True
        return self.cluster is not None and await self.cluster.forward(
            "refresh", worker_id, reason=reason
        )

    async def disconnect_provider(self, provider: str, reason: str = SECRET_ROTATED) -> int:
        """Close every worker of ``provider`` (1008) here and, with Redis, in every process.

        Returns how many were closed here plus how many the other processes list.
        """
        # (The provider sync may have closed some already: the row says so too.)
        closed = close_workers_of(self.relay, provider, reason) + self.relay.take_evicted(provider)
        if self.cluster is not None:
            try:
                closed += await self.cluster.disconnect_provider(provider, reason)
            except CLUSTER_TROUBLE as exc:
                # The other processes evict them anyway at their next provider sync.
                logger.warning("could not tell the other processes to disconnect: %s", exc)
        if closed:
            logger.info("disconnected %d worker(s) of provider %s: %s", closed, provider, reason)
        return closed

    async def ready(self) -> None:
        """Wait (briefly, once) for the first provider load."""
        if self._loaded.is_set():
            return
        try:
            async with asyncio.timeout(10):
                await self._loaded.wait()
        except TimeoutError:
            logger.error("provider table not loaded after 10 s; serving with what is known")

    async def sync(self) -> None:
        """Re-read providers (always) and API keys (when they changed)."""
        as_of = self.loop.time()
        policies = await in_thread(store.load_providers, self.config)
        self.relay.sync_providers(policies, as_of=as_of)
        try:
            await self.identities.reconcile(self.loop.time())
        except Exception:
            logger.exception("checking the joined workers connected here failed")
        if self.require_keys:
            version, keys = await in_thread(store.load_keys, self._keys_version)
            if keys is not None:
                self.keys.replace(keys)
                logger.debug("API keys reloaded: %d active", len(keys))
            self._keys_version = version
            if not self._spend_seeded and isinstance(self.limit_store, MemoryLimitStore):
                # Budgets outlive a restart: start from the request log's sums.
                at = self.limiter.calendar.at(self.limiter.clock())
                self.limit_store.seed(await in_thread(store.load_spend, at), at)
            self._spend_seeded = True
            await self.limiter.spend(self._spend_ids())  # for /metrics
        self._loaded.set()

    async def _sync_loop(self) -> None:
        while True:
            self._rounds_begun += 1
            try:
                await self.sync()
            except Exception:
                logger.exception("sync failed; keeping the last known providers and keys")
            self._rounds_ended += 1
            self._round_ended.set()
            self._round_ended = asyncio.Event()
            try:
                async with asyncio.timeout(settings.SYNC_SECS):
                    await self._poke.wait()
            except TimeoutError:
                pass
            self._poke.clear()

    def poke(self) -> None:
        self._poke.set()

    async def synced(self) -> bool:
        """Wait for a sync round begun after this call to end (bounded): what was
        committed before it, a new or changed API key, is in force here when it returns
        True. (Other processes take it within SYNC_SECS, or at once through Redis.)"""
        wanted = self._rounds_begun + 1
        self.poke()
        try:
            async with asyncio.timeout(SYNCED_WAIT_SECS):
                while self._rounds_ended < wanted:
                    await self._round_ended.wait()
        except TimeoutError:
            return False
        return True

    def socket_opened(self) -> None:
        self.sockets += 1
        self._sockets_gone.clear()

    def socket_closed(self) -> None:
        self.sockets -= 1
        if self.sockets <= 0:
            self._sockets_gone.set()

    async def shutdown(self) -> None:
        """Graceful stop: drain the relay, close workers with 1012, wait for the closes.

        In cluster mode the server has stopped listening (new connections go to the
        other processes); the requests already on their way in are still admitted and
        placed on the other processes' workers (ours take nothing new), so that none of
        them gets a 503 a load balancer would not retry. Batch lines do not hold the
        shutdown up: they are stopped first and handed back, for another process or the
        next start to run."""
        await self.batches.stop()
        try:
            async with asyncio.timeout(10):
                await asyncio.shield(self._batch_task)
        except TimeoutError:
            logger.warning("batch engine did not stop in time")
        grace = settings.SHUTDOWN_GRACE_SECS
        started = self.loop.time()
        if self.placement is not None and self.placement.active:
            self.placement.leaving()  # no process places anything more on our workers
            await self._requests_done(grace)
        grace = max(0.0, grace - (self.loop.time() - started))
        await self.relay.shutdown(grace)
        await self.bookkeeper.flush()
        await self.tracing.aclose()
        if self.sockets > 0:
            try:
                async with asyncio.timeout(5):
                    await self._sockets_gone.wait()
            except TimeoutError:
                logger.warning("%d worker socket(s) did not close in time", self.sockets)
        await self.aclose()

    def http_started(self) -> None:
        self.http_open += 1
        self._http_idle.clear()

    def http_finished(self) -> None:
        self.http_open -= 1
        if self.http_open <= 0:
            self._http_idle.set()

    async def _requests_done(self, limit: float) -> None:
        """Wait (at most ``limit`` seconds) until no HTTP request is being served."""
        if self.http_open <= 0:
            return
        try:
            async with asyncio.timeout(limit):
                await self._http_idle.wait()
        except TimeoutError:
            logger.warning("%d HTTP request(s) still open after the grace", self.http_open)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a task that does not stop must not keep the process from exiting.
            _, stuck = await asyncio.wait(self._tasks, timeout=STOP_TASKS_SECS)
            for task in stuck:
                logger.warning("%s did not stop within %s s", _name(task), STOP_TASKS_SECS)
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.error("%s failed", _name(task), exc_info=task.exception())
        self._tasks.clear()
        await self.streams.aclose()  # (its retries use the Redis source: first)
        if self.redis is not None:
            await self.redis.aclose()
        self.federation.close()
        await self.relay.aclose()


def _name(task: asyncio.Task[Any]) -> str:
    return getattr(task.get_coro(), "__qualname__", task.get_name())


_current: Runtime | None = None


def current() -> Runtime:
    """The runtime of the running event loop, created on first use."""
    global _current
    loop = asyncio.get_running_loop()
    if _current is None or _current.loop is not loop:
        _current = Runtime(loop)
    return _current


def peek() -> Runtime | None:
    return _current


async def reset() -> None:
    """Tear down the current runtime (tests; the next :func:`current` builds a new one)."""
    global _current
    runtime, _current = _current, None
    if runtime is not None and runtime.loop is asyncio.get_running_loop():
        await runtime.aclose()
