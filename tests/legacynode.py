"""A fake node of the older broker, speaking exactly its wire (SPEC §12), for live tests.

It dials ``ws://HOST/ws?name=&model=&token=&max_concurrency=`` like the old nodes
(``/ws`` appended to the server address), sends an empty text frame as heartbeat
every ``heartbeat`` seconds (10 by default, as the old nodes; tests pass a fraction
of a second), and answers each task with binary frames: the 4-byte big-endian task
id and a piece of UTF-8 text, then the 4 bytes alone when done. Like the old nodes
it stops generating on ``{"id":N,"stop":true}``, and ignores (and logs) a task it
cannot process (not pending, malformed, or beyond its capacity) and a stop for a
task it does not run.

What it answers is ``reply(task)`` (default: ``"echo: "`` and the last message),
cut into word pieces or, with ``piece_bytes``, into pieces of that many bytes (which
splits multi-byte characters across frames). ``stepped`` makes every piece wait for
:meth:`release`. Tests wait on what it saw (:meth:`wait_task`, :meth:`wait_stop`,
:meth:`wait_closed`), never on time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import websockets
from websockets.exceptions import ConnectionClosed

logger = logging.getLogger("tests.legacynode")


def echo(task: dict[str, Any]) -> str:
    return "echo: " + task["messages"][-1]["content"]


def words(text: str) -> list[bytes]:
    pieces = [word + " " for word in text.split(" ")]
    pieces[-1] = pieces[-1][:-1]
    return [piece.encode() for piece in pieces if piece]


class LegacyNode:
    def __init__(
        self,
        server_url: str,
        *,
        token: str,
        name: str = "old-box",
        model: str = "legacy-model",
        max_concurrency: int = 1,
        heartbeat: float = 10.0,
        path: str = "/ws",
        provider: str | None = None,
        params: dict[str, str] | None = None,
        reply: Callable[[dict[str, Any]], str] = echo,
        piece_bytes: int | None = None,
        stepped: bool = False,
    ) -> None:
        query = {"name": name, "model": model, "token": token, "max_concurrency": max_concurrency}
        if provider is not None:
            query["provider"] = provider
        if params is not None:  # exactly these parameters (tests of refusals)
            query = dict(params)
        host = server_url.split("://", 1)[1]
        self.url = f"ws://{host}{path}?{urlencode(query)}"
        self.name = name
        self.max_concurrency = max_concurrency
        self.heartbeat = heartbeat
        self.reply = reply
        self.piece_bytes = piece_bytes
        self.stepped = stepped
        self.tasks: list[dict[str, Any]] = []
        self.stops: list[int] = []
        self.finished: list[int] = []
        self.log: list[str] = []
        self.heartbeats = 0
        self.heartbeat_paused = False
        self.closed_with: tuple[int | None, str] | None = None
        self._running: dict[int, asyncio.Task[None]] = {}
        self._steps = asyncio.Semaphore(0)
        self._changed = asyncio.Event()
        self._ws: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------

    async def connect(self) -> LegacyNode:
        self._ws = await websockets.connect(self.url, max_size=None, open_timeout=10)
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._beat()),
        ]
        return self

    async def __aenter__(self) -> LegacyNode:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, code: int = 4000) -> None:
        """Leave normally (the old nodes close with 4000)."""
        if self._ws is not None and self.closed_with is None:
            try:
                await self._ws.close(code=code)
            except Exception:
                pass
        await self._stop_tasks()

    def kill(self) -> None:
        """Vanish without a close frame (a crashed node, a pulled cable)."""
        if self._ws is not None:
            self._ws.transport.abort()

    async def _stop_tasks(self) -> None:
        for task in [*self._tasks, *self._running.values()]:
            task.cancel()
        for task in [*self._tasks, *self._running.values()]:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    # -- test controls ----------------------------------------------------------------

    def release(self, pieces: int = 1) -> None:
        """Let ``pieces`` more pieces of ``stepped`` answers go out."""
        for _ in range(pieces):
            self._steps.release()

    def pause_heartbeat(self) -> None:
        self.heartbeat_paused = True

    async def send_raw(self, frame: bytes | str) -> None:
        await self._ws.send(frame)

    async def send_result(self, task_id: int, payload: bytes = b"") -> None:
        await self._ws.send(task_id.to_bytes(4, "big") + payload)

    async def _until(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            async with asyncio.timeout(timeout):
                while not (found := check()):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"node {self.name}: timed out waiting for {what}; log: {self.log}")
        return found

    async def wait_task(self, count: int = 1, timeout: float = 10.0) -> dict[str, Any]:
        """The ``count``-th task received (waiting for it)."""
        await self._until(lambda: len(self.tasks) >= count, timeout, f"task #{count}")
        return self.tasks[count - 1]

    async def wait_stop(self, task_id: int, timeout: float = 10.0) -> None:
        await self._until(lambda: task_id in self.stops, timeout, f"stop of task {task_id}")

    async def wait_finished(self, task_id: int, timeout: float = 10.0) -> None:
        await self._until(lambda: task_id in self.finished, timeout, f"end of task {task_id}")

    async def wait_heartbeats(self, count: int, timeout: float = 10.0) -> None:
        await self._until(lambda: self.heartbeats >= count, timeout, f"{count} heartbeats")

    async def wait_closed(self, timeout: float = 10.0) -> tuple[int | None, str]:
        return await self._until(lambda: self.closed_with, timeout, "the server to close")

    # -- the node ----------------------------------------------------------------------

    def _note(self, line: str) -> None:
        self.log.append(line)
        logger.info("node %s: %s", self.name, line)
        self._changed.set()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            if not self.heartbeat_paused:
                await self._ws.send("")
                self.heartbeats += 1
                self._changed.set()

    async def _receive(self) -> None:
        try:
            async for frame in self._ws:
                if isinstance(frame, bytes):
                    self._note(f"unexpected binary frame of {len(frame)} bytes")
                    continue
                self._on_text(frame)
        except ConnectionClosed:
            pass
        finally:
            received = self._ws.protocol.close_rcvd
            self.closed_with = (
                (received.code, received.reason) if received is not None else (None, "")
            )
            self._note(f"connection closed: {self.closed_with}")
            for running in self._running.values():
                running.cancel()

    def _on_text(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            self._note(f"ignored text that is not JSON: {text[:80]!r}")
            return
        task_id = message.get("id") if isinstance(message, dict) else None
        if not isinstance(task_id, int):
            self._note(f"ignored a message without an id: {text[:80]!r}")
        elif message.get("stop") is True:
            self.stops.append(task_id)
            running = self._running.pop(task_id, None)
            if running is None:
                self._note(f"stop for task {task_id}, which is not running")
            else:
                running.cancel()
                self._note(f"stopped task {task_id}")
        elif message.get("state") != 0 or not isinstance(message.get("messages"), list):
            self._note(f"cannot process task {task_id}: not a pending task")
        elif len(self._running) >= self.max_concurrency:
            self.tasks.append(message)
            self._note(f"cannot process task {task_id}: at capacity")
        else:
            self.tasks.append(message)
            self._running[task_id] = asyncio.create_task(self._generate(message))
            self._note(f"task {task_id} started")

    async def _generate(self, task: dict[str, Any]) -> None:
        task_id = task["id"]
        data = self.reply(task).encode()
        if self.piece_bytes:
            pieces = [data[i : i + self.piece_bytes] for i in range(0, len(data), self.piece_bytes)]
        else:
            pieces = words(data.decode())
        try:
            for piece in pieces:
                if self.stepped:
                    await self._steps.acquire()
                await self.send_result(task_id, piece)
            await self.send_result(task_id)
            self.finished.append(task_id)
            self._note(f"task {task_id} finished")
        except ConnectionClosed:
            self._note(f"task {task_id} lost with the connection")
        finally:
            self._running.pop(task_id, None)
