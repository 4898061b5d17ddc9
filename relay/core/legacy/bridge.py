"""One legacy node connection as a worker of the core.

:class:`NodeBridge` is the node's :class:`~relay.core.state.WorkerLink`: the core
dispatches, cancels and closes through it as for any worker, and it speaks the old
wire instead (see :mod:`relay.core.legacy.frames`):

- ``request`` becomes a task with a fresh 31-bit id (unique on this connection, never
  one still remembered as stopped), ``cancel`` becomes ``stop``, a close with 1000
  (drained) becomes 4000; pings, acks and model refreshes have no old equivalent
  and are dropped. A node never announces flow control, so it is never paused.
- Frames from the node come in through :meth:`on_binary` and :meth:`on_text`. Every
  frame proves the node alive (it has no pong). Text deltas are decoded per task
  with an incremental UTF-8 decoder (a character may be split across frames),
  rendered (:mod:`relay.core.legacy.render`) and handed to ``on_chunk``; the empty
  result frame ends the task with ``on_complete``.

Bad frames — text other than the empty heartbeat, binary shorter than a task id, for
an id this connection never gave out or that already finished, or not UTF-8 (with
any unfinished character before them) — are dropped and counted in the core's
``dropped_frames``; they never reach a client. The log gets one line for the first
and then at most one summary line per ``bad_frame_window``.
Late frames for a task the server stopped are expected (the node was mid-generation)
and dropped without blame. More than ``bad_frame_limit`` bad frames within
``bad_frame_window`` seconds close the node (1002).

Like the core, every method is synchronous and runs on the event loop.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from relay.core.legacy import frames
from relay.core.legacy.render import Rendering, estimate_tokens, rendering
from relay.core.legacy.tasks import (
    DEFAULT_MAX_NEW_TOKENS,
    ENDPOINTS,
    Untranslatable,
    refusal,
    translate,
)
from relay.core.relay import Relay
from relay.core.state import RelayRequest, Worker
from relay.wire import protocol

logger = logging.getLogger("relay.legacy")

#: Close code and reason for a node that floods bad frames.
FLOOD_CLOSE = (1002, "too many bad frames")


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    #: A node sending more bad frames than this within ``bad_frame_window`` is closed.
    bad_frame_limit: int = 100
    bad_frame_window: float = 10.0
    #: ``max_new_tokens`` of a task whose request set no token limit.
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    #: Stopped task ids remembered, so their late frames are dropped without blame.
    remembered_stops: int = 1024


class NodeTransport(Protocol):
    """The node's socket as the bridge uses it; never blocks the caller."""

    def send_text(self, text: str) -> None:
        """Queue one text frame; frames are delivered in call order."""

    def close(self, code: int, reason: str) -> None:
        """Close the socket after every frame queued before it."""


@dataclass(slots=True)
class _Task:
    task_id: int
    request_id: str
    rendering: Rendering
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")()
    )


class NodeBridge:
    """The :class:`~relay.core.state.WorkerLink` of one legacy node connection."""

    def __init__(
        self,
        relay: Relay,
        transport: NodeTransport,
        config: BridgeConfig,
        *,
        identity: tuple[str, str, str] = ("", "", ""),
    ) -> None:
        self.relay = relay
        self.transport = transport
        self.config = config
        #: (provider, name, model): a new connection with the same identity replaces this one.
        self.identity = identity
        #: Set by the edge once the core attached the node.
        self.worker: Worker | None = None
        self._tasks: dict[int, _Task] = {}
        self._by_request: dict[str, int] = {}
        self._stopped: OrderedDict[int, None] = OrderedDict()
        self._last_id = 0
        self._bad: deque[float] = deque(maxlen=config.bad_frame_limit + 1)
        #: Bad-frame logging (:meth:`_log_bad`): the pending summary, what it will say.
        self._summary: asyncio.TimerHandle | None = None
        self._unlogged = 0
        self._last_reason = ""

    @property
    def label(self) -> str:
        worker = self.worker
        return f"{worker.name!r} ({worker.id})" if worker else repr(self.identity[1])

    def refuses(self, request: RelayRequest) -> str | None:
        """:attr:`Worker.refuses` of a legacy node."""
        return refusal(request, default_max_new_tokens=self.config.default_max_new_tokens)

    # -- the core's side (WorkerLink) ---------------------------------------------

    def send(self, message: protocol.ServerMessage) -> None:
        match message:
            case protocol.Request():
                self._start(message)
            case protocol.Cancel():
                self._stop(message.request_id)
            case _:
                pass  # ping, ack, drain notice, models_refresh: nothing in the old protocol

    def close(self, code: int, reason: str) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._log_summary(again=False)  # what the node sent since the last line
        self.transport.close(frames.CLOSE_NORMAL if code == 1000 else code, reason)

    def _start(self, message: protocol.Request) -> None:
        try:
            spec = translate(
                message.endpoint_path,
                message.body,
                default_max_new_tokens=self.config.default_max_new_tokens,
            )
        except Untranslatable as exc:
            # Never happens for requests the core checked with refuses(); answer it
            # after the core finished assigning it, never from inside the assignment.
            self.relay.loop.call_soon(self._refuse, message.request_id, str(exc))
            return
        task_id = self._next_id()
        created = int(time.time())
        self._tasks[task_id] = _Task(
            task_id=task_id,
            request_id=message.request_id,
            rendering=rendering(
                ENDPOINTS[message.endpoint_path],
                message.is_streaming,
                request_id=message.request_id,
                model=message.model,
                created=created,
                prompt_tokens=estimate_tokens(spec.prompt_chars),
                include_usage=spec.include_usage,
            ),
        )
        self._by_request[message.request_id] = task_id
        task = frames.Task(
            id=task_id,
            system=spec.system,
            messages=[frames.Message(role=role, content=text) for role, text in spec.messages],
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            created_at=created,
        )
        self.transport.send_text(frames.encode_task(task))

    def _stop(self, request_id: str) -> None:
        task_id = self._by_request.pop(request_id, None)
        if task_id is None:
            return
        del self._tasks[task_id]
        self._stopped[task_id] = None
        while len(self._stopped) > self.config.remembered_stops:
            self._stopped.popitem(last=False)
        self.transport.send_text(frames.encode_stop(task_id))

    def _refuse(self, request_id: str, reason: str) -> None:
        if self.worker is not None:
            self.relay.on_worker_error(
                self.worker, protocol.Error(request_id=request_id, message=reason)
            )

    def _next_id(self) -> int:
        """The next free task id, wrapping at 31 bits (ids in use or recently stopped skipped)."""
        while True:
            self._last_id = self._last_id % frames.MAX_TASK_ID + 1
            if self._last_id not in self._tasks and self._last_id not in self._stopped:
                return self._last_id

    # -- the node's side -----------------------------------------------------------

    def on_text(self, text: str) -> None:
        """A text frame: the heartbeat when empty; anything else is a bad frame (the
        old protocol has nodes send only results, in binary frames)."""
        self._alive()
        if text:
            self._blame(f"a text frame ({len(text)} characters: {text[:80]!r})")

    def on_binary(self, data: bytes) -> None:
        """A result frame: a text delta for a task, or (payload empty) its end."""
        worker = self._alive()
        if worker is None:
            return
        try:
            task_id, payload = frames.split_result(data)
        except frames.ShortFrame as exc:
            self._blame(str(exc))
            return
        task = self._tasks.get(task_id)
        if task is None:
            if task_id in self._stopped:
                self.relay.stats.dropped_frames += 1  # late output of a stopped task
                if not payload:
                    del self._stopped[task_id]
                return
            self._blame(f"frame for task {task_id}, which is not running here")
            return
        if not payload:
            self._finish(worker, task)
            return
        try:
            text = task.decoder.decode(payload)
        except UnicodeDecodeError:
            # Start over with the next frame: a character left unfinished before
            # this one would otherwise make every later frame fail as well.
            task.decoder.reset()
            self._blame(f"frame for task {task_id} is not valid UTF-8")
            return
        piece = task.rendering.delta(text)
        if piece:
            self.relay.on_chunk(worker, task.request_id, piece)

    def _finish(self, worker: Worker, task: _Task) -> None:
        del self._tasks[task.task_id]
        self._by_request.pop(task.request_id, None)
        try:
            tail = task.decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            self._blame(f"task {task.task_id} ended inside a UTF-8 character")
            tail = ""
        piece = task.rendering.delta(tail)
        if piece:
            self.relay.on_chunk(worker, task.request_id, piece)
            if task.request_id not in worker.in_flight:
                return  # that last piece ended it (the stream ceiling)
        headers, body = task.rendering.end()
        self.relay.on_complete(
            worker,
            protocol.ResponseComplete(
                request_id=task.request_id,
                status_code=200,
                headers=headers,
                body=body,
                token_counts=task.rendering.token_counts(),
            ),
        )

    def _log_bad(self, reason: str) -> None:
        """One line for the first bad frame, then at most one summary line per
        ``bad_frame_window`` while they keep coming: a node cannot flood the log."""
        if self._summary is None:
            logger.info("dropped a frame from legacy node %s: %s", self.label, reason)
            self._summary = self.relay.loop.call_later(
                self.config.bad_frame_window, self._log_summary
            )
            return
        self._unlogged += 1
        self._last_reason = reason

    def _log_summary(self, *, again: bool = True) -> None:
        if not self._unlogged or not again:
            if self._unlogged:
                self._log_unlogged()
            self._summary = None  # quiet for a whole window: the next one gets its own line
            return
        self._log_unlogged()
        self._summary = self.relay.loop.call_later(self.config.bad_frame_window, self._log_summary)

    def _log_unlogged(self) -> None:
        logger.info(
            "dropped %d more bad frame(s) from legacy node %s within %gs (the last: %s)",
            self._unlogged,
            self.label,
            self.config.bad_frame_window,
            self._last_reason,
        )
        self._unlogged = 0

    def _alive(self) -> Worker | None:
        worker = self.worker
        if worker is not None and worker.attached:
            self.relay.on_pong(worker, len(worker.in_flight))
            return worker
        return None

    def _blame(self, reason: str) -> None:
        """Drop a bad frame: count it, log it (throttled), close a node that sends too many."""
        self.relay.stats.dropped_frames += 1
        self._log_bad(reason)
        now = self.relay.loop.time()
        bad = self._bad
        bad.append(now)
        if len(bad) > self.config.bad_frame_limit and now - bad[0] <= self.config.bad_frame_window:
            worker = self.worker
            logger.warning(
                "legacy node %s sent more than %d bad frames within %gs; closing it",
                self.label,
                self.config.bad_frame_limit,
                self.config.bad_frame_window,
            )
            if worker is not None:
                self.relay.close_worker(worker, *FLOOD_CLOSE)
            else:
                self.transport.close(*FLOOD_CLOSE)
