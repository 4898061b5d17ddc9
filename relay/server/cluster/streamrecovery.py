"""What the store of resumable responses does when Redis fails or fails over (cluster
mode, SPEC §18, §20).

:class:`Recovery` is one per :class:`~relay.server.cluster.streamstore.RedisStreams`:

- a write Redis did not take (out of reach, not answering, a new master refusing writes
  until its replica is back) is tried again by a task of its own
  (:meth:`Recovery.later`), after a backoff, until Redis takes it or its log would have
  expired;
- for :data:`SETTLE_GRACE_SECS` after Redis trouble or a master switch seen here, no log
  is taken for an orphan (:attr:`Recovery.calm` is false): a new master may lack a
  process's key, or have refused its renewal, for a moment, while the process is alive
  and writing;
- after a master switch it looks at the logs this process ended: one the new master
  holds unended (it took over without the end) is ended as lost where it stands
  (:meth:`Logs.lose`), so that no reader waits on it until it expires; one it does not
  hold is forgotten, as after a flush. A running log is its writer's to look at, at its
  next write (:mod:`relay.server.cluster.streamwriter`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from relay.core.streamlog import Bounds
from relay.server.cluster.control import PUBLISH_TTL

logger = logging.getLogger("relay.streams")

#: What Redis trouble looks like from here.
TROUBLE = (RedisError, OSError, TimeoutError)
#: After a failed write the next try waits this long, doubling up to RETRY_MAX_SECS.
RETRY_SECS = 0.05
RETRY_MAX_SECS = 1.0
#: After Redis trouble or a master switch seen here, no log is taken for an orphan for
#: this long: every process renews its key within it once Redis takes writes again.
SETTLE_GRACE_SECS = float(PUBLISH_TTL)

Key = tuple[int | None, str]
#: Tried again until it returns True (done, or nothing left to do); False: Redis trouble.
Attempt = Callable[[], Awaitable[bool]]


@dataclass(slots=True)
class Written:
    """A log this process writes or wrote: what it holds (for the total bound), which
    opening of its id it is, and when it ended (0: it runs)."""

    gen: str
    size: int
    ended: float = 0.0


class Logs(Protocol):
    """What recovery uses of :class:`~relay.server.cluster.streamstore.RedisStreams`."""

    bounds: Bounds
    redis: Any

    @property
    def written(self) -> Mapping[Key, Written]:
        """The logs this process wrote and still counts, oldest first."""

    def keys_of(self, owner: int | None, stream_id: str) -> tuple[str, str, str]: ...

    def forget(self, key: Key) -> None:
        """Stop counting the log ``key``."""

    async def lose(self, owner: int | None, stream_id: str, gen: str) -> bool:
        """End the log (of ``gen``) where Redis holds it, as lost; True when it did."""


class Recovery:
    def __init__(self, logs: Logs) -> None:
        self.logs = logs
        #: Loop time of the last Redis trouble or master switch seen here.
        self.troubled_at = float("-inf")
        self._tasks: set[asyncio.Task[None]] = set()
        self._recheck: asyncio.Task[None] | None = None

    def trouble(self) -> None:
        """Redis failed a call just now."""
        self.troubled_at = asyncio.get_running_loop().time()

    @property
    def calm(self) -> bool:
        """No Redis trouble nor master switch was seen here for SETTLE_GRACE_SECS."""
        return asyncio.get_running_loop().time() - self.troubled_at >= SETTLE_GRACE_SECS

    def later(self, attempt: Attempt, until: float, what: str) -> None:
        """Run ``attempt`` again after a backoff until it returns True, or until loop
        time ``until`` (a task of this object's, cancelled by :meth:`aclose`)."""
        self._own(self._again(attempt, until, what))

    async def _again(self, attempt: Attempt, until: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        delay = RETRY_SECS
        while loop.time() < until:
            await asyncio.sleep(delay)
            if await attempt():
                return
            delay = min(delay * 2, RETRY_MAX_SECS)
        logger.warning("gave up writing %s: Redis did not take it before it expired", what)

    def switched(self) -> None:
        """Called when the master moved (:meth:`RedisSource.on_switch`)."""
        self.trouble()
        if self._recheck is None or self._recheck.done():
            self._recheck = self._own(self._reassert())

    async def _reassert(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.logs.bounds.retain_secs  # (then every one expired)
        delay = RETRY_SECS
        while loop.time() < until:
            try:
                await self._check_ended()
                return
            except TROUBLE as exc:
                self.trouble()
                logger.info("looking at the ended logs on the new master failed: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECS)

    async def _check_ended(self) -> None:
        logs = self.logs
        for key, held in list(logs.written.items()):
            if not held.ended:
                continue
            meta, _, _ = logs.keys_of(*key)
            state, gen = await logs.redis.hmget(meta, ["state", "gen"])
            if gen is None or gen.decode() != held.gen:
                logs.forget(key)
            elif state != b"done" and await logs.lose(key[0], key[1], held.gen):
                logger.warning(
                    "stream %s: the new Redis master lacked its end; ended it as lost",
                    key[1][:100],
                )

    def _own(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
