"""Requests this process's clients sent, served by a worker connected to another process.

When the placement reserves a slot on a worker of process B for a client of this
process (A), the dispatcher assigns the request to a stand-in :class:`~relay.core.state.Worker`
whose link is a :class:`ProxyLink`. The link forwards the request to B over plain
HTTP — B's own fast path, told by internal headers to put it on that worker under its
reservation — and feeds B's answer back into the core as if a worker connected here had
sent it: streamed bytes as they arrive, then the completion. Token chunks never cross
Redis (SPEC §11); everything else keeps working as in one process:

- a cancel (the client left, a deadline passed) closes the HTTP exchange, and B, seeing
  its client gone, cancels the worker's request and frees the slot;
- ``pause``/``resume`` stop and restart reading B's response, so TCP slows B down and
  B's own flow control pauses the worker;
- B answering that the worker could not take the request (or lost it before the first
  byte), or B being unreachable before answering, puts the request back in the queue;
  a stream broken mid-way ends with the SSE error event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable

from relay.core.relay import Relay
from relay.core.state import Completion, Worker
from relay.server.cluster.peerhttp import PeerClient, PeerError, PeerRefused
from relay.wire import protocol

logger = logging.getLogger("relay.cluster")

#: Headers of the internal request from the client's process to the worker's.
TOKEN_HEADER = "x-modelrelay-cluster"
LEASE_HEADER = "x-modelrelay-lease"
LIFETIME_HEADER = "x-modelrelay-lifetime"
KEY_HEADER = "x-modelrelay-key"
#: The request's priority class and how often it was preempted (for the request log).
CLASS_HEADER = "x-modelrelay-class"
#: A resumable response's log (SPEC §18): "<gen> <owner> <id>"; the worker's process
#: writes it and does not cancel the request when this exchange closes.
RESUME_HEADER = "x-modelrelay-resume"
#: The worker's process answers a request it could not start with this header:
#: "spend" (it counts as a requeue) or "free" (it does not).
REQUEUE_HEADER = "x-modelrelay-requeue"

#: The other process's headers the client should not see twice (we add our own).
_OURS = frozenset({"x-content-type-options", "date", "server", "content-length"})


def cluster_token(pepper: str) -> str:
    """The secret one process shows another: every process of a cluster shares the pepper."""
    return hmac.new(pepper.encode(), b"modelrelay cluster link v1", "sha256").hexdigest()


class ProxyPool:
    """The HTTP client to the other processes and the stand-ins for their workers."""

    def __init__(
        self,
        relay: Relay,
        token: str,
        release: Callable[[str, str | None], None],
        unreachable: Callable[[str], None],
    ) -> None:
        """``release(worker_id, lease)`` gives back a reservation whose request never
        reached the other process; ``unreachable(instance)`` reports a process that
        refused the connection (it is gone: nothing more is placed there)."""
        self.relay = relay
        self.token = token
        self.release = release
        self.unreachable = unreachable
        self.client = PeerClient()
        self.stand_ins: dict[str, Worker] = {}

    def stand_in(self, worker_id: str, owner: str, address: str, provider: str) -> Worker:
        worker = self.stand_ins.get(worker_id)
        if worker is None or worker.owner != owner:
            link = ProxyLink(self, worker_id, address, lambda: self.stand_ins.get(worker_id))
            worker = Worker(
                id=worker_id,
                provider=provider,
                name=f"{worker_id}@{owner}",
                models=(),
                max_concurrent=1 << 30,
                link=link,
                connected_at=time.monotonic(),
                last_pong=time.monotonic(),
                features=frozenset({protocol.FLOW_CONTROL}),
                remote=True,
                owner=owner,
            )
            self.stand_ins[worker_id] = worker
        return worker

    def prune(self) -> None:
        """Forget stand-ins with nothing in flight (their workers may be long gone)."""
        for worker_id in [w for w, s in self.stand_ins.items() if not s.in_flight]:
            del self.stand_ins[worker_id]

    async def aclose(self) -> None:
        for worker in list(self.stand_ins.values()):
            link = worker.link
            assert isinstance(link, ProxyLink)
            await link.aclose()
        await self.client.aclose()


class ProxyLink:
    """:class:`relay.core.state.WorkerLink` to a worker of another process, over HTTP."""

    def __init__(
        self, pool: ProxyPool, worker_id: str, address: str, worker: Callable[[], Worker | None]
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.address = address.rstrip("/")
        self._worker = worker
        self._calls: dict[str, asyncio.Task[None]] = {}
        self._valves: dict[str, asyncio.Event] = {}

    def send(self, message: protocol.ServerMessage) -> None:
        match message:
            case protocol.Request():
                self._start(message)
            case protocol.Cancel():
                call = self._calls.get(message.request_id)
                if call is not None:
                    call.cancel()
            case protocol.Pause():
                paused = self._valves.get(message.request_id)
                if paused is not None:
                    paused.clear()
            case protocol.Resume():
                resumed = self._valves.get(message.request_id)
                if resumed is not None:
                    resumed.set()
            case _:
                pass  # pings and the like are for real workers

    def _start(self, message: protocol.Request) -> None:
        request_id = message.request_id
        valve = asyncio.Event()
        valve.set()
        self._valves[request_id] = valve
        task = asyncio.get_running_loop().create_task(self._exchange(message, valve))
        self._calls[request_id] = task

        def forget(_: asyncio.Task[None]) -> None:
            self._forget(request_id)

        task.add_done_callback(forget)

    def close(self, code: int, reason: str) -> None:
        pass  # nothing to close: each exchange ends with its request

    def _forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)
        self._valves.pop(request_id, None)

    async def aclose(self) -> None:
        tasks = list(self._calls.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _exchange(self, message: protocol.Request, valve: asyncio.Event) -> None:
        relay = self.pool.relay
        worker = self._worker()
        request = worker.in_flight.get(message.request_id) if worker is not None else None
        if worker is None or request is None:
            return
        lifetime = max(0.0, request.deadline - relay.loop.time())
        headers = dict(message.headers)
        headers[TOKEN_HEADER] = self.pool.token
        headers[LEASE_HEADER] = f"{self.worker_id} {request.lease or ''}"
        headers[LIFETIME_HEADER] = f"{lifetime:.3f}"
        if request.key_id is not None:
            headers[KEY_HEADER] = str(request.key_id)
        headers[CLASS_HEADER] = f"{request.service_class} {request.preemptions}"
        if request.resume_key:
            headers[RESUME_HEADER] = request.resume_key
        headers.setdefault("content-type", "application/json")
        answered = False
        try:
            response = await self.pool.client.post(
                self.address, message.endpoint_path, headers, message.body.encode()
            )
            answered = True
            try:
                if response.has(REQUEUE_HEADER):
                    requeue = response.header(REQUEUE_HEADER)
                    await response.read()
                    relay.on_remote_lost(worker, message.request_id, spend=requeue == "spend")
                    return
                kept = {k: v for k, v in response.headers if k.lower() not in _OURS}
                streamed = (
                    message.is_streaming
                    and response.status == 200
                    and response.header("content-type").startswith("text/event-stream")
                )
                if not streamed:
                    body = await response.read()
                    completion = Completion(response.status, kept, body)
                    relay.on_remote_complete(worker, message.request_id, completion)
                    return
                async for data in response.chunks():
                    if not valve.is_set():
                        await valve.wait()
                    relay.on_remote_bytes(worker, message.request_id, data)
                relay.on_remote_complete(worker, message.request_id, Completion(200, kept, b""))
            finally:
                response.release()
        except asyncio.CancelledError:
            # Cancelled by the core: closing the exchange tells the other process. If it
            # never got the request, nobody else will give its reservation back.
            if not answered:
                self.pool.release(self.worker_id, request.lease)
            raise
        except (PeerError, OSError) as exc:
            logger.warning(
                "request %s to worker %s at %s failed: %s",
                message.request_id,
                self.worker_id,
                self.address,
                exc.__class__.__name__,
                extra={"request_id": message.request_id},
            )
            refused = isinstance(exc, PeerRefused)
            if refused:
                self.pool.unreachable(worker.owner)
            if not answered:
                self.pool.release(self.worker_id, request.lease)
            # A request that never left this process did not use up an attempt.
            relay.on_remote_lost(worker, message.request_id, spend=not refused)
