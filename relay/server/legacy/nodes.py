"""The legacy node endpoint (``/ws`` and ``/v1/worker/legacy``, SPEC §12).

Nodes of the older broker connect here unchanged: the connect URL carries their
name, model, token and capacity (:func:`relay.core.legacy.frames.parse_connect_query`).
The token is a provider's worker secret, checked exactly as for modern workers
(hashed, constant time, the same per-address throttle); ``provider=`` names the
provider, else the default one. Refusals use the old close codes: 4001 for a missing
or unusable parameter, 4002 for a bad token (and a throttled address, an unknown or
disabled provider). A node connecting with the same provider, name and model as a
connected one replaces it: the old connection is closed with 4003.

Once accepted, the node is attached to the core at once (it sends no register
frame) through a :class:`~relay.core.legacy.bridge.NodeBridge`, so it is a worker
like any other — selection, the queue, drain, the heartbeat, ``/admin/workers``, the
dashboard and the session audit rows (``protocol_version`` ``"legacy"``). This
consumer only authenticates and feeds frames to the bridge; the rest of its life
(disconnect, audit rows, send failures) is :class:`~relay.server.socket.consumer.WorkerConsumer`'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings

from relay.core.legacy import frames
from relay.core.legacy.bridge import BridgeConfig, NodeBridge
from relay.core.ratelimit import client_address
from relay.core.registry import sanitize_models
from relay.server import runtime
from relay.server.socket.consumer import ConsumerLink, WorkerConsumer

logger = logging.getLogger("relay.legacy")


class NodeOutbox(ConsumerLink):
    """The node's socket: raw text frames, in order, from one writer task."""

    def send_text(self, text: str) -> None:
        if self.closed_with is None:
            self._outbox.append(text)
            self._wake.set()


def bridge_config() -> BridgeConfig:
    return BridgeConfig(
        bad_frame_limit=settings.LEGACY_BAD_FRAME_LIMIT,
        bad_frame_window=settings.LEGACY_BAD_FRAME_WINDOW_SECS,
        default_max_new_tokens=settings.LEGACY_DEFAULT_MAX_NEW_TOKENS,
    )


class LegacyNodeConsumer(WorkerConsumer):
    bridge: NodeBridge | None = None

    async def websocket_connect(self, message: dict[str, Any]) -> None:
        rt = runtime.current()
        self.relay = rt.relay
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.scope["headers"]
        }
        client = self.scope.get("client") or ("", 0)
        self.peer = client_address(client[0], headers.get("x-forwarded-for"), rt.trusted_proxies)
        try:
            params = frames.parse_connect_query(
                self.scope.get("query_string", b"").decode("latin-1")
            )
            model = _model(params.model, rt.config.max_model_name_len)
        except frames.BadParameters as exc:
            logger.warning("legacy node refused: peer=%s: %s", self.peer, exc)
            await self._refuse_with(frames.CLOSE_MISSING_PARAMETER, str(exc))
            return
        self.provider_name = params.provider or settings.PROVIDER_NAME
        if rt.relay.shutting_down:
            await self._refuse_with(1012, "server restarting")
            return
        wait = rt.throttle.blocked(self.peer)
        if wait:
            logger.warning("legacy node auth throttled: peer=%s (%.0fs left)", self.peer, wait)
            await self._refuse_with(
                frames.CLOSE_BAD_TOKEN,
                f"too many failed authentication attempts; retry in {wait:.0f}s",
            )
            return
        from relay.server.store import provider_policy
        from workers_app.models import Provider

        provider = await Provider.objects.filter(name=self.provider_name).afirst()
        if provider is None or not provider.check_secret(params.token):
            rt.throttle.failure(self.peer)
            problem = (
                f"unknown provider '{self.provider_name}'" if provider is None else "invalid token"
            )
            logger.warning(
                "legacy node auth failed: peer=%s provider=%s name=%r: %s",
                self.peer,
                self.provider_name,
                params.name,
                problem,
            )
            await self._refuse_with(frames.CLOSE_BAD_TOKEN, problem)
            return
        rt.throttle.success(self.peer)
        if not provider.enabled:
            logger.warning("legacy node refused: provider %s is disabled", provider.name)
            await self._refuse_with(
                frames.CLOSE_BAD_TOKEN, f"provider '{provider.name}' is disabled"
            )
            return
        rt.relay.set_provider(provider_policy(provider, rt.config))
        await self.accept()
        rt.socket_opened()
        self._attach(params.name, model, params.max_concurrency)

    def _attach(self, name: str, model: str, max_concurrency: int) -> None:
        relay = self.relay
        identity = (self.provider_name, name[: relay.config.max_worker_name_len], model)
        for worker in list(relay.registry.workers.values()):
            if isinstance(worker.link, NodeBridge) and worker.link.identity == identity:
                logger.info("legacy node %r (%s) reconnected; replacing it", worker.name, worker.id)
                relay.close_worker(worker, frames.CLOSE_REPLACED, "replaced by a new connection")
        outbox = NodeOutbox(self, self._send_failed)
        self.link = outbox
        bridge = self.bridge = NodeBridge(relay, outbox, bridge_config(), identity=identity)
        worker, warnings = relay.attach_worker(
            provider=self.provider_name,
            name=name,
            models=[model],
            max_concurrent=max_concurrency,
            current_load=0,
            link=bridge,
            peer=self.peer,
            protocol_version=frames.LEGACY_PROTOCOL,
            refuses=bridge.refuses,
        )
        bridge.worker = self.worker = worker
        for warning in warnings:
            logger.warning("legacy node %s: %s", worker.name, warning)
        self._audit = asyncio.get_running_loop().create_task(self._open_session(worker))

    async def _refuse_with(self, code: int, reason: str) -> None:
        # Accept first: closing before accept would give the node a bare HTTP 403
        # instead of the close code the old protocol promises.
        await self.accept()
        await self.close(code=code, reason=reason.encode()[:120].decode(errors="ignore"))

    async def websocket_receive(self, message: dict[str, Any]) -> None:
        link, bridge = self.link, self.bridge
        if link is None or link.closed_with is not None or bridge is None:
            return  # refused or closing: ignore whatever is still in flight
        data = message.get("bytes")
        if data is not None:
            bridge.on_binary(data)
        else:
            bridge.on_text(message.get("text") or "")


def _model(raw: str, max_len: int) -> str:
    """The node's one model, sanitized like a modern worker's models."""
    accepted, _ = sanitize_models([raw], cap=1, max_len=max_len)
    if not accepted:
        raise frames.BadParameters(f"model name longer than {max_len} characters")
    return accepted[0]
