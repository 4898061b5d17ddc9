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
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from channels.layers import BaseChannelLayer, get_channel_layer

from relay.core import snapshot
from relay.core.relay import Relay

logger = logging.getLogger("relay.cluster")

GROUP = "modelrelay.control"
PUBLISH_EVERY = 1.0
PUBLISH_TTL = 5


class Cluster:
    def __init__(
        self, relay: Relay, redis_url: str, prefix: str, *, on_sync: Callable[[], None]
    ) -> None:
        """``on_sync`` is called when another process changed providers or API keys."""
        self.relay = relay
        self.on_sync = on_sync
        self.prefix = prefix
        self.instance = relay.instance
        self.layer: BaseChannelLayer = get_channel_layer()
        self.redis = aioredis.from_url(redis_url, socket_timeout=None, decode_responses=True)
        self.channel: str | None = None

    @property
    def _key(self) -> str:
        return f"{self.prefix}:instance:{self.instance}"

    async def run(self) -> None:
        """Owned by the runtime: listen for control messages and publish our workers."""
        self.channel = await self.layer.new_channel()
        await self.layer.group_add(GROUP, self.channel)
        publisher = asyncio.get_running_loop().create_task(self._publish())
        try:
            while True:
                message = await self.layer.receive(self.channel)
                try:
                    self.handle(message)
                except Exception:
                    logger.exception("control message %r failed", message.get("type"))
        finally:
            publisher.cancel()
            try:
                await publisher
            except asyncio.CancelledError:
                pass
            try:
                await self.layer.group_discard(GROUP, self.channel)
                await self.redis.delete(self._key)
                await self.redis.aclose()
            except Exception:
                logger.warning("could not deregister from Redis on shutdown")

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

    async def _publish(self) -> None:
        while True:
            try:
                document = {
                    "instance": self.instance,
                    "channel": self.channel,
                    "workers": snapshot.workers(self.relay),
                }
                await self.redis.set(self._key, json.dumps(document), ex=PUBLISH_TTL)
            except Exception:
                logger.warning("could not publish worker list to Redis", exc_info=True)
            await asyncio.sleep(PUBLISH_EVERY)

    async def instances(self) -> list[dict[str, Any]]:
        keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}:instance:*")]
        if not keys:
            return []
        return [json.loads(raw) for raw in await self.redis.mget(keys) if raw]

    async def workers(self) -> list[dict[str, Any]]:
        """Workers of every live process (ours fresh, others as last published)."""
        out = snapshot.workers(self.relay)
        for worker in out:
            worker["instance"] = self.instance
        for document in await self.instances():
            if document["instance"] == self.instance:
                continue
            for worker in document["workers"]:
                worker["instance"] = document["instance"]
                out.append(worker)
        return out

    async def forward(self, kind: str, worker_id: str, **fields: Any) -> bool:
        """Send ``relay.<kind>`` to the process holding ``worker_id``; False if none does."""
        for document in await self.instances():
            if document["instance"] == self.instance or not document.get("channel"):
                continue
            if any(w["id"] == worker_id for w in document["workers"]):
                message = {"type": f"relay.{kind}", "worker_id": worker_id, **fields}
                await self.layer.send(document["channel"], message)
                return True
        return False

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
    """Close this process's workers of ``provider`` with 1008 and ``reason``; how many."""
    workers = relay.registry.of_provider(provider)
    for worker in workers:
        relay.close_worker(worker, 1008, reason)
    return len(workers)
