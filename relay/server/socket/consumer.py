"""The worker WebSocket endpoint (``/v1/worker/connect``).

A thin translator between frames and relay-core calls. Handlers return fast:
Channels processes one message at a time per connection, so anything slow here
would delay this worker's pongs and cancels. Outbound frames go through
:class:`ConsumerLink`, an ordered outbox with one writer task owned by the consumer.
Audit rows are written once when the worker registers and once when it leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from channels.db import aclose_old_connections
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.utils import timezone

from relay.core.ratelimit import client_address
from relay.core.relay import Relay
from relay.core.state import Worker
from relay.server import runtime
from relay.server.identities import Hold, Refused
from relay.wire.errors import ProtocolError, describe
from relay.wire.protocol import (
    Error,
    MetricsSample,
    ModelResult,
    ModelStates,
    ModelsUpdate,
    Pong,
    Register,
    ResponseChunk,
    ResponseComplete,
    ServerMessage,
    decode_worker_message,
    encode,
)

if TYPE_CHECKING:
    from workers_app.models import Provider

logger = logging.getLogger("relay.worker_socket")

_MAX_REASON = 120  # a close reason must fit in 123 bytes

# Closes the WebSocket layer itself performs (RFC 6455 §7.4.1) on a worker's bad frames.
_TRANSPORT_FAILURES = {
    1007: "invalid UTF-8 in a text frame",
    1009: "frame larger than MAX_MESSAGE_BYTES",
}


def _reason(text: str) -> str:
    return text.encode()[:_MAX_REASON].decode(errors="ignore")


def consumer_label(consumer: WorkerConsumer) -> str:
    worker = consumer.worker
    return f"{worker.name!r} ({worker.id})" if worker else f"(unregistered, peer {consumer.peer})"


class ConsumerLink:
    """:class:`relay.core.state.WorkerLink` over a consumer; never blocks the caller.

    One writer task drains the outbox in order. If a send fails (the socket library
    refused the frame, or the socket is already closing), the link stops for good:
    ``on_failure`` detaches the worker at once, so its requests follow the disconnect
    rules instead of waiting for a heartbeat timeout, and the socket is closed.
    """

    def __init__(self, consumer: WorkerConsumer, on_failure: Callable[[str], None]) -> None:
        self._consumer = consumer
        self._on_failure = on_failure
        self._outbox: deque[str | tuple[int, str]] = deque()
        self._wake = asyncio.Event()
        self.closed_with: tuple[int, str] | None = None
        self._task = asyncio.get_running_loop().create_task(self._write())

    def send(self, message: ServerMessage) -> None:
        if self.closed_with is None:
            self._outbox.append(encode(message))
            self._wake.set()

    def close(self, code: int, reason: str) -> None:
        if self.closed_with is None:
            self.closed_with = (code, _reason(reason))
            self._outbox.append(self.closed_with)
            self._wake.set()

    async def _write(self) -> None:
        consumer = self._consumer
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    item = self._outbox.popleft()
                    if isinstance(item, tuple):
                        await consumer.close(code=item[0], reason=item[1])
                        return
                    await consumer.send(text_data=item)
        except Exception as exc:
            await self._failed(exc)

    async def _failed(self, exc: Exception) -> None:
        self._outbox.clear()
        closing = self.closed_with is not None
        if not closing:
            self.closed_with = (1011, "could not send to the worker")
        logger.warning(
            "could not send to worker %s (%s); closing it",
            consumer_label(self._consumer),
            describe(exc),
        )
        self._on_failure("could not send to the worker")
        if not closing:
            try:
                await self._consumer.close(code=1011, reason=self.closed_with[1])  # type: ignore[index]
            except Exception:
                pass  # the socket is gone already; the worker reconnects

    async def aclose(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except BaseException:
            pass


class WorkerConsumer(AsyncWebsocketConsumer):
    relay: Relay
    link: ConsumerLink | None = None
    worker: Worker | None = None
    provider_name: str = ""
    peer: str = ""
    _register_timer: asyncio.TimerHandle | None = None
    _audit: asyncio.Task[Any] | None = None
    _secret_hash: str = ""
    _eviction: int = 0
    #: A worker with a credential of its own (SPEC §22): its identity's hold.
    hold: Hold | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Read and dispatch frames in a plain loop.

        The generic consumer loop spawns a task per message to also listen on a
        channel-layer channel, and closes stale DB connections (a thread hop) before
        every handler. A worker socket carries every token chunk, needs no channel of
        its own (cross-process control goes through :mod:`relay.server.cluster.control`) and touches
        the database only on connect and disconnect, so neither cost is paid here.
        """
        self.scope = scope
        self.channel_layer = None
        self.base_send = send
        try:
            while True:
                message = await receive()
                match message["type"]:
                    case "websocket.receive":
                        try:
                            await self.websocket_receive(message)
                        except Exception:
                            # Our bug, not the worker's: close only this worker, and
                            # let the disconnect below clean up as for any other close.
                            logger.exception(
                                "handling a frame from worker %s failed", consumer_label(self)
                            )
                            self._close(1011, "internal error")
                    case "websocket.connect":
                        await self.websocket_connect(message)
                    case "websocket.disconnect":
                        await self.websocket_disconnect(message)
        except StopConsumer:
            pass

    async def websocket_connect(self, message: dict[str, Any]) -> None:
        rt = runtime.current()
        self.relay = rt.relay
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.scope["headers"]
        }
        client = self.scope.get("client") or ("", 0)
        self.peer = client_address(client[0], headers.get("x-forwarded-for"), rt.trusted_proxies)
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.provider_name = (query.get("provider") or [settings.PROVIDER_NAME])[0]
        secret = headers.get("x-worker-secret") or (query.get("worker_secret") or [""])[0]

        if rt.relay.shutting_down:
            await self.accept()
            await self.close(code=1012, reason="server restarting")
            return
        wait = rt.throttle.blocked(self.peer)
        if wait:
            logger.warning("worker auth throttled: peer=%s (%.0fs left)", self.peer, wait)
            await self._refuse(f"too many failed authentication attempts; retry in {wait:.0f}s")
            return
        from relay.server.store import provider_policy
        from workers_app.models import Provider

        credential = headers.get("x-worker-credential")
        if credential is not None:
            wanted = query.get("provider")
            provider = await self._check_in(credential, wanted[0] if wanted else None)
            if provider is None:
                return
        else:
            provider = await Provider.objects.filter(name=self.provider_name).afirst()
            if provider is None or not secret or not provider.check_secret(secret):
                rt.throttle.failure(self.peer)
                problem = (
                    f"unknown provider '{self.provider_name}'"
                    if provider is None
                    else "invalid worker secret"
                )
                logger.warning(
                    "worker auth failed: peer=%s provider=%s: %s",
                    self.peer,
                    self.provider_name,
                    problem,
                )
                await self._refuse(problem)
                return
            self._secret_hash = provider.secret_hash
            self._eviction = provider.eviction
        rt.throttle.success(self.peer)
        if not provider.enabled:
            logger.warning("worker refused: provider %s is disabled", provider.name)
            await self._let_go()
            await self._refuse(f"provider '{provider.name}' is disabled")
            return
        rt.relay.set_provider(provider_policy(provider, rt.config))
        await self.accept()
        rt.socket_opened()
        self.link = ConsumerLink(self, self._send_failed)
        if self.hold is not None:
            rt.identities.track(self.hold, self)
        self._register_timer = asyncio.get_running_loop().call_later(
            rt.config.register_timeout,
            self._violation,
            f"no register message within {rt.config.register_timeout:g}s",
        )

    async def _check_in(self, credential: str, wanted: str | None) -> Provider | None:
        """A worker with its own credential (SPEC §22): its provider once its identity is
        held by this connection; None when refused (said, throttled, closed)."""
        rt = runtime.current()
        try:
            self.hold = await rt.identities.check_in(credential, wanted, self.peer)
        except Refused as exc:
            rt.throttle.failure(self.peer)
            logger.warning("worker auth failed: peer=%s: %s", self.peer, exc.reason)
            await self._refuse(exc.reason)
            return None
        self.provider_name = self.hold.provider.name
        return self.hold.provider

    async def _let_go(self) -> None:
        """Release this connection's hold on its identity, if it has one."""
        hold, self.hold = self.hold, None
        if hold is not None:
            await runtime.current().identities.release(hold)

    def close_for(self, reason: str) -> None:
        """Its identity was revoked, deleted or taken (:class:`relay.server.identities.
        Identities`): close it with 1008."""
        logger.warning("closing worker %s: %s", consumer_label(self), reason)
        self._close(1008, reason)

    async def _refuse(self, reason: str) -> None:
        # Accept first: closing before accept would give the worker a bare HTTP 403
        # instead of a close code and a reason it can log.
        await self.accept()
        await self.close(code=1008, reason=_reason(reason))

    async def websocket_receive(self, message: dict[str, Any]) -> None:
        link = self.link
        if link is None or link.closed_with is not None:
            return  # refused or closing: ignore whatever is still in flight
        text = message.get("text")
        if text is None:
            self._violation("binary frames are not supported")
            return
        try:
            msg = decode_worker_message(text)
        except ProtocolError as exc:
            self._violation(str(exc))
            return
        relay = self.relay
        worker = self.worker
        if worker is None:
            if isinstance(msg, Register):
                await self._register(msg)
            else:
                self._violation(f"expected register, got {type(msg).__name__}")
            return
        match msg:
            case ResponseChunk():
                relay.on_chunk(worker, msg.request_id, msg.chunk)
            case ResponseComplete():
                relay.on_complete(worker, msg)
            case Pong():
                relay.on_pong(worker, msg.current_load)
            case ModelsUpdate():
                updated = relay.on_models_update(
                    worker, msg.models, msg.current_load, msg.backend_error
                )
                for warning in updated:
                    logger.warning("worker %s models_update: %s", worker.name, warning)
            case Error():
                relay.on_worker_error(worker, msg)
            case MetricsSample():
                self._metrics(worker, msg)
            case ModelStates():
                relay.on_model_states(worker, msg)
            case ModelResult():
                relay.on_model_result(worker, msg)
            case Register():
                self._violation("duplicate register")

    def _metrics(self, worker: Worker, msg: MetricsSample) -> None:
        refused = runtime.current().federation.receive(worker.id, worker.name, worker.provider, msg)
        if refused is not None and worker.attached:
            logger.warning("worker %s: metrics sample dropped: %s", worker.name, refused.reason)
            worker.link.send(refused)

    async def _register(self, msg: Register) -> None:
        rt = runtime.current()
        if self._register_timer is not None:
            self._register_timer.cancel()
            self._register_timer = None
        if not await self._still_admitted():
            return
        version = msg.protocol_version
        if version is None and rt.config.require_protocol_version:
            self._violation("protocol_version is required")
            return
        if version is not None and version not in rt.config.accepted_protocol_versions:
            self._violation(f"unsupported protocol version {version[:40]!r}")
            return
        assert self.link is not None
        worker, ack = rt.relay.admit_worker(
            provider=self.provider_name,
            name=msg.worker_name,
            models=msg.models,
            max_concurrent=msg.max_concurrent,
            current_load=msg.current_load,
            link=self.link,
            peer=self.peer,
            protocol_version=version,
            features=msg.features,
            model_states=msg.model_states,
            model_capacity=msg.model_capacity,
        )
        if self.hold is not None:
            worker.identity = self.hold.identity  # a provider secret rotation spares it
        else:
            worker.eviction = self._eviction
        worker.backend_error = msg.backend_error
        if rt.placement is not None:
            # Known to every process before it is acked: no process may then answer
            # 404 for its models (SPEC §11). Frames wait meanwhile (one at a time).
            await rt.placement.join(worker)
            if self.link.closed_with is not None:
                return  # closed meanwhile (rotated, server stopping)
        rt.relay.start_worker(worker, ack)
        self.worker = worker
        for warning in ack.warnings:
            logger.warning("worker %s register: %s", worker.name, warning)
        self._audit = asyncio.get_running_loop().create_task(self._open_session(worker))

    async def _still_admitted(self) -> bool:
        """Check again, at register, that the secret this socket authenticated with is
        still the provider's: a rotate-and-disconnect that committed between the
        handshake and the register must not let this worker in after its sweep. A worker
        with its own credential: that it was not revoked, nor its identity taken."""
        from workers_app.models import Provider

        row = (
            await Provider.objects.filter(name=self.provider_name)
            .values_list("secret_hash", "enabled")
            .afirst()
        )
        problem = None
        if row is None:
            problem = f"unknown provider '{self.provider_name}'"
        elif self.hold is not None:
            problem = await runtime.current().identities.still_held(self.hold)
            if problem is None and not row[1]:
                problem = f"provider '{self.provider_name}' is disabled"
        elif row[0] != self._secret_hash:
            problem = "provider secret rotated"
        elif not row[1]:
            problem = f"provider '{self.provider_name}' is disabled"
        if problem is None:
            return True
        logger.warning("worker refused at register: %s: %s", consumer_label(self), problem)
        self._close(1008, problem)
        return False

    def _violation(self, reason: str) -> None:
        """Close only this worker with 1002; everyone else carries on."""
        logger.warning("protocol error from worker %s: %s", consumer_label(self), reason)
        self._close(1002, reason)

    def _close(self, code: int, reason: str) -> None:
        self._register_timer = None
        if self.worker is not None:
            runtime.current().relay.close_worker(self.worker, code, reason)
        elif self.link is not None:
            self.link.close(code, reason)

    def _send_failed(self, reason: str) -> None:
        if self.worker is not None:
            runtime.current().relay.detach_worker(self.worker, reason)

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        """The socket is gone: detach the worker, close its audit row. Never raises
        anything but :class:`StopConsumer`, whatever state the connection was left in."""
        if self._register_timer is not None:
            self._register_timer.cancel()
        link, worker = self.link, self.worker
        code = message.get("code")
        if link is not None and link.closed_with is not None:
            reason = link.closed_with[1]
        elif code in _TRANSPORT_FAILURES:
            reason = _TRANSPORT_FAILURES[code]
            logger.warning("worker %s closed: %s", consumer_label(self), reason)
        else:
            reason = f"connection closed by worker (code {code})"
        try:
            if worker is not None:
                runtime.current().relay.detach_worker(worker, reason)
                runtime.current().federation.forget(worker.id)
            if link is not None:
                await link.aclose()
        except Exception:
            logger.exception("detaching worker %s failed", consumer_label(self))
        finally:
            if link is not None:
                runtime.current().socket_closed()
        if worker is not None:
            await self._close_session(worker, reason)
        await self._let_go()
        try:
            await aclose_old_connections()
        except Exception:
            logger.exception("closing database connections failed")
        raise StopConsumer()

    async def _open_session(self, worker: Worker) -> None:
        from workers_app.models import Provider, WorkerSession

        try:
            provider = await Provider.objects.filter(name=worker.provider).afirst()
            await WorkerSession.objects.acreate(
                worker_id=worker.id,
                provider=provider,
                provider_name=worker.provider,
                worker_name=worker.name,
                model_names=list(worker.models),
                max_concurrent=worker.max_concurrent,
                peer_address=worker.peer[:64],
                protocol_version=(worker.protocol_version or "")[:64],
                connected_at=timezone.now(),
            )
        except Exception:
            logger.exception("could not write the session row for worker %s", worker.id)

    async def _close_session(self, worker: Worker, reason: str) -> None:
        from workers_app.models import WorkerSession

        if self._audit is not None:
            await asyncio.wait([self._audit])
        try:
            await WorkerSession.objects.filter(worker_id=worker.id).aupdate(
                disconnected_at=timezone.now(),
                disconnect_reason=reason[:200],
                requests_served=worker.requests_served,
                model_names=list(worker.models),
            )
        except Exception:
            logger.exception("could not close the session row for worker %s", worker.id)
