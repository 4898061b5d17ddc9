"""Resumable responses run by this process, whatever becomes of their clients (SPEC §18).

:class:`StreamKeeper` is one per server process, owned by the runtime. For each
resumable request it runs a *pump*: a task of its own (not of the client's connection,
so no disconnect cancels it) that takes the request's events from the core as a
client's response loop would and writes them to the response's log
(:mod:`relay.core.streamlog`). Clients are readers of that log; none of them is needed
for the response to run to its end, its request timeout, or a cancel.

Where the log is written: by the process that holds the worker's socket. A request
whose worker is connected to another process (cluster mode) arrives there through the
cluster link, whose process runs the writing pump and also passes the bytes back on
the link (:class:`Tee`); the client's process runs a pump too, which keeps the request
(its key's slot, its deadlines, its record) and writes nothing unless the request ended
before any process claimed the log (queued, refused, timed out): then it ends the log
with that outcome.

A pump stops its request when the store says to (``cancel``: someone asked to; ``gone``:
the log was replaced or deleted; ``lost``: the log cannot be kept whole, its store having
failed over without its last records), and when the request ends. Cancels asked through any
process reach the pumps of every process (:meth:`StreamKeeper.cancel_here`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from relay.core.background import BackgroundEvents, error_of, event, queued_response
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, Event, RelayRequest
from relay.core.streamlog import Entry, LogWriter, StreamStore, Unary, Verdict
from relay.wire.errors import Flavor, RelayError, WorkerUnavailable, error_response
from relay.wire.sse import error_event

logger = logging.getLogger("relay.streams")

Key = tuple[int | None, str]
#: Why a pump stops its request, for the log line.
_STOPPED = {"cancel": "cancelled", "lost": "lost in a Redis failover (its log was ended)"}
Ending = tuple[str, list[bytes], Unary | None, bytes | None]


class Shape(Protocol):
    """How a kind of log is made of a request's events."""

    started: bool

    async def feed(self, data: bytes) -> tuple[list[bytes], bytes | None]:
        """Records (and the response object, when it changed) for streamed bytes."""

    async def ending(self, terminal: object) -> Ending:
        """``(outcome, last records, unary answer, final response object)``."""


class ReplayShape:
    """llama.cpp's protocol: the bytes as the client would have got them."""

    def __init__(self, flavor: Flavor) -> None:
        self.flavor: Flavor = flavor
        self.started = False

    async def feed(self, data: bytes) -> tuple[list[bytes], bytes | None]:
        self.started = True
        return [data], None

    async def ending(self, terminal: object) -> Ending:
        if isinstance(terminal, Completion):
            if self.started:
                return "ok", [terminal.body] if terminal.body else [], None, None
            unary = Unary(terminal.status, dict(terminal.headers), terminal.body)
            return ("ok" if terminal.status < 400 else "error"), [], unary, None
        if isinstance(terminal, RelayError):
            if self.started:
                return "error", [error_event(terminal, self.flavor)], None, None
            status, headers, body = error_response(terminal, self.flavor)
            named = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
            return "error", [], Unary(status, named, body), None
        return "cancelled", [], None, None


class BackgroundShape:
    """OpenAI Responses background mode: numbered events, the relay's response id."""

    def __init__(self, events: BackgroundEvents) -> None:
        self.events = events
        self.started = False

    async def feed(self, data: bytes) -> tuple[list[bytes], bytes | None]:
        self.started = True
        return await self.events.feed(data)

    async def ending(self, terminal: object) -> Ending:
        events = self.events
        if isinstance(terminal, Completion):
            if self.started:
                records = await events.rest()
                status = events.ended
                if status is None:
                    err = {"code": "stream_ended", "message": "The stream ended early"}
                    return "failed", records, None, events.final("failed", err)
                return status, records, None, events.final(status)
            if terminal.status < 400:
                return await self._answered(terminal.body)
            err = error_of(terminal.body, terminal.status)
            record = event("error", events.next_seq, param=None, **err)
            events.next_seq += 1
            return "failed", [record], None, events.final("failed", err)
        if isinstance(terminal, RelayError):
            records = await events.rest() if self.started else []
            records.append(events.error(terminal))
            err = {"code": terminal.code, "message": terminal.message}
            return "failed", records, None, events.final("failed", err)
        return "cancelled", [], None, events.final("cancelled")

    async def _answered(self, body: bytes) -> Ending:
        """A backend that answered with the whole response rather than a stream."""
        self.started = True
        records, response = await self.events.feed(
            b"event: response.completed\ndata: "
            + b'{"type":"response.completed","response":'
            + body
            + b"}\n\n"
        )
        status = self.events.ended or "completed"
        return status, records, None, response or self.events.final(status)


class Tee:
    """The bytes and end of a response, passed on to the process whose client asked
    for it while that process listens (a mailbox like a request's). Past ``limit``
    bytes not taken it gives up: the listener sees its exchange end, the log goes on."""

    __slots__ = ("_events", "_waiter", "closed", "limit", "pending")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        self.closed = False
        self._events: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Event) -> None:
        if self.closed:
            return
        if isinstance(item, bytes):
            self.pending += len(item)
            if self.pending > self.limit:
                self.close()
                return
        else:
            self.closed = True  # its end: nothing comes after it
        self._events.append(item)
        self._wake()

    def close(self) -> None:
        """No more: the listener sees its exchange end (unless it ended already)."""
        if self.closed:
            return
        self.closed = True
        self._events = [CANCELLED]
        self._wake()

    def taken(self, size: int) -> None:
        self.pending -= size

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_events(self) -> list[Event]:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events


@dataclass(slots=True)
class Counters:
    """What ``/admin/stats`` and ``/metrics`` show of resumable responses here."""

    started: int = 0
    reattaches: int = 0
    replayed_bytes: int = 0
    cancels: int = 0


class StreamKeeper:
    def __init__(
        self,
        relay: Relay,
        store: StreamStore,
        *,
        broadcast: Callable[[int | None, str], Awaitable[None]] | None = None,
    ) -> None:
        """``broadcast(owner, id)`` tells the other processes to stop a response (cluster
        mode); None in one process."""
        self.relay = relay
        self.store = store
        self.broadcast = broadcast
        self.counters = Counters()
        #: Requests of resumable responses running here (as the client's process or
        #: the worker's), by owner and id.
        self.running: dict[Key, RelayRequest] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def open(self, entry: Entry, *, replace: bool) -> None:
        """Keep a new resumable response before its request is submitted (raises
        :class:`~relay.wire.errors.StreamsExceeded` when its key holds too many).
        A background response's log starts with its ``response.queued`` event (number 0);
        a conversation's new stream stops and replaces its previous one."""
        records = []
        if entry.kind == "background":
            records.append(event("response.queued", 0, response=msgspec.Raw(entry.response)))
        if replace:
            previous = await self.store.get(entry.owner, entry.id)
            if previous is not None and not previous.done:
                await self.cancel(entry.owner, entry.id)
        await self.store.open(entry, replace=replace, records=records)

    async def forget(self, entry: Entry) -> None:
        """Drop a response opened for a request that was then refused."""
        await self.store.delete(entry.owner, entry.id)

    def start(
        self,
        request: RelayRequest,
        entry: Entry,
        *,
        tee: Tee | None = None,
    ) -> None:
        """Run ``request``'s pump from now on; it ends with the request."""
        shape: Shape
        if entry.kind == "background":
            queued = entry.response or queued_response(entry.id, request.model, int(entry.created))
            shape = BackgroundShape(BackgroundEvents(entry.id, queued))
        else:
            shape = ReplayShape(request.flavor)
        key = (entry.owner, entry.id)
        self.running[key] = request
        if tee is None:
            self.counters.started += 1
        pump = self._pump(request, self.store.writer(entry), shape, tee)
        task = self.relay.loop.create_task(pump)
        self._tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._tasks.discard(finished)
            if self.running.get(key) is request:
                del self.running[key]
            if not finished.cancelled() and finished.exception() is not None:
                logger.error("pump of %s failed", entry.id, exc_info=finished.exception())

        task.add_done_callback(done)

    async def _pump(
        self, request: RelayRequest, writer: LogWriter, shape: Shape, tee: Tee | None
    ) -> None:
        relay = self.relay
        claimed = False
        #: Whether this process writes the log: its worker is connected here. Known with
        #: the first bytes (none can come from anywhere else after them).
        writes: bool | None = None
        try:
            while True:
                events = await request.next_events()
                chunks: list[bytes] = []
                terminal: object = None
                for item in events:
                    if type(item) is bytes:
                        chunks.append(item)
                    else:
                        terminal = item
                if chunks:
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    if writes is None:
                        writes = request.relay_role != "origin"
                    if writes:
                        verdict: Verdict = "ok"
                        if not claimed:
                            verdict = await writer.claim(self._lifetime(request))
                            claimed = verdict != "gone"
                        records, response = await shape.feed(data)
                        if verdict != "gone":
                            verdict = await writer.append(records, response)
                        if verdict != "ok":
                            self._stop(request, verdict)
                    if tee is not None:
                        tee.put(data)
                    relay.delivered(request, len(data))
                if terminal is None:
                    continue
                # The log first: the other process, told of the end, may read it.
                await self._end(request, writer, shape, terminal, claimed, writes)
                if tee is not None:
                    tee.put(terminal)  # type: ignore[arg-type]
                return
        finally:
            relay.cancel(request, "client_disconnect")  # no-op once it ended
            relay.release(request)
            if tee is not None:
                tee.close()  # (after its end: the listener has it already)

    async def _end(
        self,
        request: RelayRequest,
        writer: LogWriter,
        shape: Shape,
        terminal: object,
        claimed: bool,
        writes: bool | None,
    ) -> None:
        """Write how the response ended, if this process is the one to."""
        if not claimed:
            if writes is False:
                return  # another process's worker wrote it: that process ends it
            if isinstance(terminal, WorkerUnavailable) and request.relay_role == "worker":
                return  # the client's process places it again
            # Nobody wrote a byte (it never ran, or ran here and answered at once): the
            # first process to get here ends it (an origin whose request went elsewhere
            # finds the log claimed and leaves it).
            if await writer.claim(self._lifetime(request)) == "gone":
                return
        outcome, records, unary, response = await shape.ending(terminal)
        await writer.end(outcome, records, unary=unary, response=response)

    def _lifetime(self, request: RelayRequest) -> float:
        return max(0.0, request.deadline - self.relay.loop.time())

    def _stop(self, request: RelayRequest, verdict: Verdict) -> None:
        logger.info(
            "stopping %s: its stream was %s",
            request.id,
            _STOPPED.get(verdict, "replaced or deleted"),
            extra={"request_id": request.id},
        )
        self.relay.cancel(request, "client_disconnect")

    def cancel_here(self, owner: int | None, stream_id: str) -> bool:
        """Stop the request of a resumable response if it runs here (told by another
        process, or asked here); True when it did."""
        request = self.running.get((owner, stream_id))
        if request is None or request.done:
            return False
        self.relay.cancel(request, "client_disconnect")
        return True

    async def cancel(
        self, owner: int | None, stream_id: str, *, delete: bool = False
    ) -> Entry | None:
        """Stop a resumable response wherever it runs and (``delete``) forget its log;
        the entry as it was, None when there is none for ``owner``."""
        if delete:
            entry = await self.store.delete(owner, stream_id)
        else:
            entry = await self.store.request_cancel(owner, stream_id)
        if entry is None:
            return None
        self.counters.cancels += not entry.done
        self.cancel_here(owner, stream_id)
        if not entry.done and self.broadcast is not None:
            # Its worker's process may be another (the log's mark reaches it too, at
            # its next append: this is only sooner).
            await self.broadcast(owner, stream_id)
        return entry

    def describe(self) -> dict[str, Any]:
        """This process's resumable responses (``/admin/stats``, ``/metrics``): those
        retained (in cluster mode: the logs this process wrote), their bytes, and what
        clients did with them here."""
        totals = self.store.totals()
        counters = self.counters
        return {
            "retained": totals.responses,
            "running": totals.running,
            "bytes": totals.bytes,
            "by_kind": totals.by_kind,
            "evicted": totals.evicted,
            "trimmed": totals.trimmed,
            "refused": totals.refused,
            "started": counters.started,
            "reattaches": counters.reattaches,
            "replayed_bytes": counters.replayed_bytes,
            "cancels": counters.cancels,
            "pumps": len(self._tasks),
            "bounds": {
                "retain_secs": self.store.bounds.retain_secs,
                "max_bytes": self.store.bounds.max_bytes,
                "total_bytes": self.store.bounds.total_bytes,
                "per_key": self.store.bounds.per_key,
            },
        }

    async def run(self, every: float) -> None:
        """Owned by the runtime: forget expired responses every ``every`` seconds."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.store.sweep()
            except Exception as exc:  # the next sweep tries again
                logger.warning("sweeping retained streams failed: %s", exc)

    async def aclose(self) -> None:
        """Stop every pump (the server is stopping: their requests are cancelled)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self.store.aclose()
