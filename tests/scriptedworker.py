"""A scripted worker for live-server tests that hold and answer requests at will.

Built on :mod:`tests.rawworker`: a reader task answers pings and files every
``request`` frame in a queue; the test takes them with :meth:`ScriptedWorker.next`
and answers each with :meth:`ScriptedWorker.answer` (an OpenAI chat completion the
SDKs accept, with the token counts the test chooses).
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType

from websockets.exceptions import ConnectionClosed

from relay.wire import protocol
from tests.live import LiveServer
from tests.rawworker import connect, register


def completion(text: str = "hi", prompt_tokens: int = 1, completion_tokens: int = 1) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


class ScriptedWorker:
    def __init__(self, server: LiveServer, models: list[str], max_concurrent: int = 4) -> None:
        self.server = server
        self.models = models
        self.max_concurrent = max_concurrent
        self.requests: asyncio.Queue[protocol.Request] = asyncio.Queue()
        #: Requests it holds now (received, neither answered nor cancelled), and the most
        #: it ever held at once: a relay must never hand it more than max_concurrent.
        self.holding: set[str] = set()
        self.peak = 0
        self._ws = None
        self._reader: asyncio.Task[None] | None = None
        #: The id the relay gave it (set once registered).
        self.worker_id = ""

    async def __aenter__(self) -> ScriptedWorker:
        self._ws = await connect(self.server)
        ack = await register(self._ws, models=self.models, max_concurrent=self.max_concurrent)
        self.worker_id = ack.worker_id
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._reader is not None and self._ws is not None
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass
        await self._ws.close()

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            while True:
                message = protocol.decode_server_message(await self._ws.recv())
                if isinstance(message, protocol.Ping):
                    await self._ws.send(protocol.encode(protocol.Pong(current_load=0)))
                elif isinstance(message, protocol.Request):
                    self.holding.add(message.request_id)
                    self.peak = max(self.peak, len(self.holding))
                    self.requests.put_nowait(message)
                elif isinstance(message, protocol.Cancel):
                    self.holding.discard(message.request_id)
        except ConnectionClosed:
            return

    async def next(self, timeout: float = 5.0) -> protocol.Request:
        async with asyncio.timeout(timeout):
            return await self.requests.get()

    async def answer(
        self, request: protocol.Request, prompt: int = 1, completion_: int = 1
    ) -> None:
        assert self._ws is not None
        self.holding.discard(request.request_id)
        message = protocol.ResponseComplete(
            request_id=request.request_id,
            status_code=200,
            headers={"content-type": "application/json"},
            body=completion(prompt_tokens=prompt, completion_tokens=completion_),
            token_counts=protocol.TokenCounts(
                prompt_tokens=prompt,
                completion_tokens=completion_,
                total_tokens=prompt + completion_,
            ),
        )
        await self._ws.send(protocol.encode(message))

    async def serve(self, count: int, prompt: int = 1, completion_: int = 1) -> None:
        """Answer the next ``count`` requests as they come."""
        for _ in range(count):
            await self.answer(await self.next(), prompt, completion_)


class AnyOf:
    """Several scripted workers as one (cluster mode: the placement picks the worker)."""

    def __init__(self, *workers: ScriptedWorker) -> None:
        self.workers = workers

    async def next(self, timeout: float = 5.0) -> tuple[ScriptedWorker, protocol.Request]:
        """The next request any of them received, with the worker that has it."""
        for worker in self.workers:
            if not worker.requests.empty():
                return worker, worker.requests.get_nowait()
        gets = {asyncio.ensure_future(w.requests.get()): w for w in self.workers}
        try:
            done, _ = await asyncio.wait(gets, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for get in gets:
                get.cancel()
        if not done:
            raise TimeoutError("no request reached any worker")
        first, *others = done
        for other in others:  # both got one at once: keep the other for later
            gets[other].requests.put_nowait(other.result())
        return gets[first], first.result()

    async def serve(self, count: int, prompt: int = 1, completion_: int = 1) -> None:
        """Answer the next ``count`` requests, whichever worker they reach."""
        for _ in range(count):
            worker, request = await self.next()
            await worker.answer(request, prompt, completion_)
