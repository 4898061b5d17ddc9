"""Every Redis connection of a process, wherever Redis is: one URL, or a master found
through Sentinel (SPEC §20).

:class:`RedisSource` builds every connection of a process from its
:class:`~relay.server.cluster.redisconf.RedisTarget` — redis-py clients, the
lean client of the request path (:mod:`relay.server.cluster.leanredis`) — as the
channel layer's pools (``channel_hosts`` there) find theirs, so that all of them find the
master the same way:

- at connect, and after any error, each connection asks the sentinels where the master
  is (redis-py's ``SentinelConnectionPool``; the lean client through :meth:`RedisSource.locate`);
- a ``-READONLY`` reply (a master demoted to a replica) counts as a lost connection, so
  the next call asks again;
- :meth:`RedisSource.watch` asks the sentinels every tick and, when the master moved,
  drops every connection to the old one and tells the subsystems that keep state there
  (:meth:`RedisSource.on_switch`): they re-assert it as after a flush, since a replica
  promoted by a failover may lack the last writes the old master took (replication is
  asynchronous).

Every connection has a timeout (``REDIS_TIMEOUT_SECS``): a Redis that stops answering
fails the calls waiting on it within that time, never hangs them.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from relay.server.cluster.leanredis import LeanRedis, lean_client
from relay.server.cluster.redisconf import RedisTarget, retry, sentinel_options, tls_options

logger = logging.getLogger("relay.cluster")


class MasterUnknown(MasterNotFoundError):
    """Sentinels answered, and none of them monitors a master of that name: a setting is
    wrong (retrying does not help)."""


class _MasterConnection(SentinelManagedConnection):
    """A connection to where the sentinels say the master is, which checks that it is:
    a sentinel that has not heard of a failover yet names the old master, which may be
    back as a replica (whose reads would be stale or empty). Not a master: the
    connection fails, and the next attempt asks again."""

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        await super().on_connect_check_health(check_health)
        await self.send_command("ROLE", check_health=False)
        role = await self.read_response()
        kind = role[0] if isinstance(role, list) and role else b""
        if (kind.decode() if isinstance(kind, bytes) else str(kind)) != "master":
            await self.disconnect()
            raise RedisConnectionError(f"{self.host}:{self.port} is not the master (yet)")


class _MasterSSLConnection(_MasterConnection, SentinelManagedSSLConnection):
    pass


class _Sentinels(Sentinel):
    """redis-py's Sentinel manager, finding the master through :meth:`RedisSource.locate`
    (one bound for the whole question, a clear error for a wrong name, switches noticed)."""

    def __init__(self, source: RedisSource, **options: Any) -> None:
        super().__init__(list(source.target.sentinels), **options)
        self.source = source

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        return await self.source.locate()


Listener = Callable[[], None]


class RedisSource:
    """Every Redis connection of one process, built from one :class:`RedisTarget`."""

    def __init__(self, target: RedisTarget) -> None:
        self.target = target
        self._sentinels: _Sentinels | None = None
        if target.through_sentinel:
            self._sentinels = _Sentinels(self, sentinel_kwargs=sentinel_options(target))
        #: Where the master was last found (None: not asked yet, or no Sentinel).
        self.master: tuple[str, int] | None = None
        #: Times the master moved since this process started.
        self.switches = 0
        self._listeners: list[Listener] = []
        self._clients: weakref.WeakSet[aioredis.Redis] = weakref.WeakSet()
        self._leans: weakref.WeakSet[LeanRedis] = weakref.WeakSet()
        self._asking: asyncio.Future[tuple[str, int]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- connections -----------------------------------------------------------------

    def client(
        self,
        name: str,
        *,
        decode_responses: bool = False,
        timeout: float | None = None,
    ) -> aioredis.Redis:
        """A redis-py client (a pool) named ``name`` in ``CLIENT LIST``; every reply bounded
        by ``timeout`` (default: the target's)."""
        bound = self.target.timeout if timeout is None else timeout
        options: dict[str, Any] = {
            "socket_timeout": bound,
            "socket_connect_timeout": min(bound, self.target.timeout),
            "client_name": name,
            "decode_responses": decode_responses,
            "retry": retry(),
        }
        if self._sentinels is None:
            return aioredis.from_url(self.target.url, **options)
        if self.target.password:
            options["password"] = self.target.password
        options.update(tls_options(self.target))
        tls = options.pop("ssl", False)
        options["connection_class"] = _MasterSSLConnection if tls else _MasterConnection
        client = self._sentinels.master_for(self.target.master, **options)
        self._clients.add(client)
        return client

    def lean(self, name: str, reply_secs: float | None = None) -> LeanRedis | None:
        """The lean client of the request path, or None where it does not apply (TLS, a
        Unix socket, URL options it does not read): redis-py is used then."""
        bound = self.target.timeout if reply_secs is None else reply_secs
        if self._sentinels is None:
            return lean_client(self.target.url, bound, name)
        if self.target.tls:
            return None
        password = self.target.password or None
        lean = LeanRedis("redis://", bound, name, locate=self.locate, password=password)
        self._leans.add(lean)
        return lean

    # -- finding the master ------------------------------------------------------------

    async def locate(self) -> tuple[str, int]:
        """Where the master is, as the first sentinel that knows says (one question at a
        time per process: callers that ask meanwhile share the answer). Raises
        :class:`MasterNotFoundError` (a ``ConnectionError``) when no sentinel can say,
        :class:`MasterUnknown` when the sentinels that answered know no such master."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask())
        asking = self._asking
        return await asyncio.shield(asking)

    async def _ask(self) -> tuple[str, int]:
        assert self._sentinels is not None
        name = self.target.master
        problems: list[str] = []
        known: set[str] = set()
        answered = 0
        for sentinel in list(self._sentinels.sentinels):
            where = "{host}:{port}".format(**sentinel.connection_pool.connection_kwargs)
            try:
                async with asyncio.timeout(self.target.timeout):
                    masters: dict[str, dict[str, Any]] = await sentinel.sentinel_masters()  # type: ignore[assignment]
            except (RedisError, OSError, TimeoutError) as exc:
                problems.append(f"{where}: {type(exc).__name__}: {exc}"[:200])
                continue
            answered += 1
            known.update(masters)
            state = masters.get(name)
            if state is None:
                continue
            if self._sentinels.check_master_state(state, name):
                address = (str(state["ip"]), int(state["port"]))
                await self._saw(address)
                return address
            problems.append(f"{where}: the master is down (a failover is under way)")
        if answered and name not in known:
            shown = ", ".join(sorted(known)) or "none"
            raise MasterUnknown(
                f"no sentinel monitors a master named {name!r} (REDIS_SENTINEL_MASTER); "
                f"they monitor: {shown}"
            )
        raise MasterNotFoundError(
            f"no sentinel names a master {name!r} now: " + "; ".join(problems or ["no answer"])
        )

    async def _saw(self, address: tuple[str, int]) -> None:
        previous, self.master = self.master, address
        if previous is None or previous == address:
            return
        self.switches += 1
        logger.warning(
            "Redis master %r moved from %s:%d to %s:%d; reconnecting every connection",
            self.target.master,
            *previous,
            *address,
        )
        for lean in list(self._leans):
            lean.drop("the Redis master moved")
        # Not from here: this may be a connection of those pools asking as it connects.
        task = asyncio.get_running_loop().create_task(self._switched())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _switched(self) -> None:
        for client in list(self._clients):
            # In-use connections too: a subscriber or a blocked call on the old master
            # would otherwise stay there.
            try:
                await client.connection_pool.disconnect()
            except Exception:
                logger.debug("closing a connection to the old master failed", exc_info=True)
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                logger.exception("a subsystem failed to take note of the master switch")

    def on_switch(self, listener: Listener) -> None:
        """Call ``listener`` (on the event loop) each time the master moves: what the new
        master lacks must be re-asserted, as after a flush."""
        self._listeners.append(listener)

    async def watch(self, every: float) -> None:
        """Owned by the runtime (Sentinel only): ask where the master is every ``every``
        seconds, so a switch is noticed within a tick even by a process with nothing to
        send. Errors are the connections' to report (they go degraded); this only looks."""
        if self._sentinels is None:
            return
        while True:
            try:
                await self.locate()
            except MasterUnknown as exc:
                logger.error("Redis: %s", exc)
            except (RedisError, OSError, TimeoutError) as exc:
                logger.debug("Redis: the sentinels cannot say where the master is: %s", exc)
            await asyncio.sleep(every)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._sentinels is not None:
            await self._sentinels.aclose()


def check_master(target: RedisTarget) -> None:
    """At start (Sentinel only): raise :class:`MasterUnknown` when the sentinels that
    answer know no master of that name — a wrong setting, which retrying cannot mend.
    Sentinels that cannot be reached are no error: the process starts degraded and keeps
    asking."""
    if not target.through_sentinel:
        return

    async def ask() -> None:
        source = RedisSource(target)
        try:
            address = await source.locate()
            logger.info("Redis: %s is at %s:%d", target.describe(), *address)
        except MasterUnknown:
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("Redis: starting without the master for now: %s", exc)
        finally:
            await source.aclose()

    asyncio.run(ask())


def source_of(redis: str | RedisSource) -> RedisSource:
    """A :class:`RedisSource` as given, or one for a plain URL."""
    if isinstance(redis, RedisSource):
        return redis
    return RedisSource(RedisTarget(url=redis))
