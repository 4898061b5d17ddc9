"""Several server processes sharing one Redis: who has which worker, and control messages.

Each worker is connected to exactly one server process. With ``REDIS_URL`` set,
every process

- publishes its live worker list under ``<prefix>:instance:<id>`` (refreshed every
  second, expiring after a few), so the admin API of *any* process lists them all;
- listens on the channel layer for control messages, so an admin action or a
  ``manage.py`` command issued to one process reaches a worker connected to another
  (``relay.drain`` / ``relay.refresh`` sent to the owning process's channel);
- reacts to ``relay.sync`` broadcasts by re-reading providers and API keys at once,
  so a key revoked through one process is refused by all of them immediately;
- reacts to ``relay.disconnect_provider`` broadcasts by closing its workers of that
  provider (1008), so rotating a leaked secret evicts every worker let in with it.

Token chunks never travel through here (see SPEC §2: the Redis layer is far too
slow for them); only rare control messages do.

The loop is supervised like the placement's: any failure (Redis restarted, flushed,
a connection killed) ends one session, and the next one starts after a short backoff,
re-creating this process's group membership (which a flush loses) and its published
worker list; the membership is also re-asserted every few seconds while all is well.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from channels.layers import BaseChannelLayer, get_channel_layer
from redis.exceptions import RedisError

from relay.core import snapshot
from relay.core.relay import Relay
from relay.server.cluster.convergence import stop_if_cancelled

logger = logging.getLogger("relay.cluster")

GROUP = "modelrelay.control"
PUBLISH_EVERY = 1.0
PUBLISH_TTL = 5
#: The group membership is re-asserted this often (a flushed Redis forgets it).
REJOIN_EVERY = 5.0
#: After a failed session, the next one starts this soon, doubling up to a second.
RETRY_SECS = 0.1
TROUBLE = (RedisError, OSError, TimeoutError)


class ClusterUnreachable(Exception):
    """The other processes cannot be reached through Redis right now."""


class Cluster:
    def __init__(
        self,
        relay: Relay,
        redis_url: str,
        prefix: str,
        *,
        on_sync: Callable[[], None],
        on_stream_cancel: Callable[[int | None, str], object] | None = None,
    ) -> None:
        """``on_sync`` is called when another process changed providers or API keys;
        ``on_stream_cancel(owner, id)`` when one was asked to stop a resumable response
        (SPEC §18), which may run here."""
        self.relay = relay
        self.on_sync = on_sync
        self.on_stream_cancel = on_stream_cancel
        self.prefix = prefix
        self.instance = relay.instance
        self.layer: BaseChannelLayer = get_channel_layer()
        self.redis = aioredis.from_url(
            redis_url,
            socket_timeout=None,
            decode_responses=True,
            client_name=f"modelrelay:{self.instance}:control",
        )
        self.channel: str | None = None

    @property
    def _key(self) -> str:
        return f"{self.prefix}:instance:{self.instance}"

    async def run(self) -> None:
        """Owned by the runtime: listen for control messages and publish our workers,
        restarted after every failure for as long as the process runs."""
        delay = RETRY_SECS
        try:
            while True:
                started = asyncio.get_running_loop().time()
                try:
                    await self._session()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    level = logging.WARNING if isinstance(exc, TROUBLE) else logging.ERROR
                    logger.log(level, "cluster control loop failed (%s); restarting it", exc)
                stop_if_cancelled()
                if asyncio.get_running_loop().time() - started > 2 * PUBLISH_EVERY:
                    delay = RETRY_SECS  # it ran for a while: start over quickly
                await asyncio.sleep(delay)
                delay = min(delay * 2, PUBLISH_EVERY)
        finally:
            try:
                if self.channel is not None:
                    await self.layer.group_discard(GROUP, self.channel)
                await self.redis.delete(self._key)
            except Exception:
                logger.warning("could not deregister from Redis on shutdown")
            await self.redis.aclose()

    async def _session(self) -> None:
        if self.channel is None:
            self.channel = await self.layer.new_channel()
        await self.layer.group_add(GROUP, self.channel)
        publisher = asyncio.get_running_loop().create_task(self._publish())
        try:
            while not publisher.done():
                receive = asyncio.ensure_future(self.layer.receive(self.channel))
                try:
                    await asyncio.wait({receive, publisher}, return_when="FIRST_COMPLETED")
                finally:
                    if not receive.done():
                        receive.cancel()
                        await asyncio.wait({receive})
                if receive.cancelled():
                    break
                message = receive.result()  # raises what failed it
                try:
                    self.handle(message)
                except Exception:
                    logger.exception("control message %r failed", message.get("type"))
            publisher.result()
        finally:
            publisher.cancel()
            await asyncio.wait({publisher})

    def handle(self, message: dict[str, Any]) -> None:
        logger.debug("control message: %s", message)
        relay = self.relay
        match message.get("type"):
            case "relay.sync":
                self.on_sync()
            case "relay.drain":
                relay.drain_worker(
                    message["worker_id"],
                    timeout=message.get("timeout"),
                    reason=message.get("reason") or "maintenance",
                )
            case "relay.refresh":
                relay.refresh_models(
                    message["worker_id"], reason=message.get("reason") or "operator"
                )
            case "relay.disconnect_provider":
                close_workers_of(relay, message["provider"], message["reason"])
            case "relay.stream_cancel" if self.on_stream_cancel is not None:
                owner = message.get("owner")
                stream = message.get("stream")
                if (owner is None or isinstance(owner, int)) and isinstance(stream, str):
                    self.on_stream_cancel(owner, stream)

    async def _publish(self) -> None:
        """Publish our worker list every second and re-assert our group membership every
        few; a failure ends the session (and the next one starts over)."""
        loop = asyncio.get_running_loop()
        joined = loop.time()
        while True:
            document = {
                "instance": self.instance,
                "channel": self.channel,
                "workers": snapshot.workers(self.relay),
            }
            await self.redis.set(self._key, json.dumps(document), ex=PUBLISH_TTL)
            if loop.time() - joined >= REJOIN_EVERY:
                assert self.channel is not None
                await self.layer.group_add(GROUP, self.channel)
                joined = loop.time()
            await asyncio.sleep(PUBLISH_EVERY)

    async def instances(self) -> list[dict[str, Any]]:
        keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}:instance:*")]
        if not keys:
            return []
        return [json.loads(raw) for raw in await self.redis.mget(keys) if raw]

    async def workers(self) -> list[dict[str, Any]]:
        """Workers of every live process (ours fresh, others as last published); only
        ours while Redis cannot be reached (logged: ``/health`` says it)."""
        out = snapshot.workers(self.relay)
        for worker in out:
            worker["instance"] = self.instance
        try:
            documents = await self.instances()
        except TROUBLE as exc:
            logger.warning("listing the other processes' workers failed: %s", exc)
            return out
        for document in documents:
            if document["instance"] == self.instance:
                continue
            for worker in document["workers"]:
                worker["instance"] = document["instance"]
                out.append(worker)
        return out

    async def forward(self, kind: str, worker_id: str, **fields: Any) -> bool:
        """Send ``relay.<kind>`` to the process holding ``worker_id``; False if none does.
        Raises :class:`ClusterUnreachable` when Redis cannot be asked."""
        try:
            return await self._forward(kind, worker_id, fields)
        except TROUBLE as exc:
            raise ClusterUnreachable(str(exc) or exc.__class__.__name__) from exc

    async def _forward(self, kind: str, worker_id: str, fields: dict[str, Any]) -> bool:
        for document in await self.instances():
            if document["instance"] == self.instance or not document.get("channel"):
                continue
            if any(w["id"] == worker_id for w in document["workers"]):
                message = {"type": f"relay.{kind}", "worker_id": worker_id, **fields}
                await self.layer.send(document["channel"], message)
                return True
        return False

    async def broadcast_stream_cancel(self, owner: int | None, stream: str) -> None:
        """Tell every process to stop the resumable response ``stream`` of ``owner`` if it
        runs there (its log is marked too: the writer also stops at its next append)."""
        message = {"type": "relay.stream_cancel", "owner": owner, "stream": stream}
        await self.layer.group_send(GROUP, message)

    async def broadcast_sync(self) -> None:
        await self.layer.group_send(GROUP, {"type": "relay.sync"})

    async def disconnect_provider(self, provider: str, reason: str) -> int:
        """Tell every process to close its workers of ``provider``.

        A broadcast rather than a message per listed worker: a worker that joined another
        process since its last publication is closed too. Returns how many workers the
        other processes list for ``provider``.
        """
        listed = sum(
            1
            for document in await self.instances()
            if document["instance"] != self.instance
            for worker in document["workers"]
            if worker.get("provider") == provider
        )
        message = {"type": "relay.disconnect_provider", "provider": provider, "reason": reason}
        await self.layer.group_send(GROUP, message)
        return listed


def close_workers_of(relay: Relay, provider: str, reason: str) -> int:
    """Close this process's workers of ``provider`` with 1008 and ``reason``; how many.

    Workers with a credential of their own (SPEC §22) were not let in with the provider's
    secret and stay."""
    workers = [w for w in relay.registry.of_provider(provider) if w.identity is None]
    for worker in workers:
        relay.close_worker(worker, 1008, reason)
    return len(workers)
