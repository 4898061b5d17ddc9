"""A fake OpenAI-compatible backend with a prompt cache, for cache-aware routing (SPEC §14).

Each :class:`CachingUpstream` models one GPU box's backend: it renders the chat prompt
as text (system, tools, then each message's role and content, as a chat template
would), counts one token per 4 characters, and keeps an LRU of prefix blocks of 16
tokens (like vLLM's prefix cache). A request reuses the leading blocks it finds and
then fills the cache with all of its own. Time to first token is ``cost_per_token``
seconds per prompt token it did *not* reuse, so the effect of routing shows on a
machine of two cores (the wait is a sleep, not work).

It answers ``POST /v1/chat/completions`` (JSON, or SSE with ``"stream": true``) with a
deterministic reply, and reports what it reused as OpenAI does
(``usage.prompt_tokens_details.cached_tokens``) or, with ``report="llama"``, as
llama-server does (``timings.cache_n``, ``prompt_ms``, ``predicted_ms``, no ``usage`` in
a stream). ``GET /v1/models`` lists ``model``. Every request is recorded (:class:`Served`):
its raw body, prompt and reused tokens, how many requests each upstream of its ``pool``
was running when it arrived, and when its first byte left.

Speed-aware routing (SPEC §21) needs boxes of different speeds: ``serial_prefill`` makes
the backend process one prompt at a time (a GPU's compute: the prompts sent together
queue for it), ``decode_per_token`` streams the reply a token per event at that pace,
and ``stall_every`` / ``stall_secs`` hold every n-th request that long before its first
byte (a box whose GPU is busy with something else now and then). Every attribute may
be changed while it runs (:meth:`UpstreamPool.set`); :func:`caching_upstreams` takes
``speeds``, one factor per upstream dividing its times.

``with caching_upstreams(2) as ups:`` runs them on one loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
_json = msgspec.json.Encoder()


@dataclass
class Served:
    path: str
    body: bytes
    prompt_tokens: int
    cached_tokens: int
    #: Requests each upstream of the pool was running when this one arrived (this
    #: upstream's count includes it).
    loads: list[int]
    index: int
    arrived: float
    #: When its first byte was written (``time.monotonic``; 0: none yet).
    first_byte: float = 0.0
    stalled: bool = False


def render(doc: dict[str, Any]) -> str:
    """The prompt text a chat template would make of a request body."""
    parts = []
    for key in ("system", "instructions"):
        value = doc.get(key)
        if value:
            text = value if isinstance(value, str) else _json.encode(value).decode()
            parts.append(f"<{key}>{text}")
    if doc.get("tools"):
        parts.append("<tools>" + _json.encode(doc["tools"]).decode())
    messages = doc.get("messages") or []
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            content = message.get("content")
            text = content if isinstance(content, str) else _json.encode(content).decode()
            parts.append(f"<{message.get('role')}>{text}")
    if isinstance(doc.get("prompt"), str):
        parts.append(doc["prompt"])
    return "\n".join(parts)


class PrefixCache:
    """An LRU of prefix blocks: block *i* names the whole prompt up to its end."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, text: str) -> tuple[int, int]:
        """``(prompt tokens, tokens reused)``; the prompt's blocks are cached after."""
        tokens = max(1, -(-len(text) // CHARS_PER_TOKEN))
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        chain = []
        h = 0
        for start in range(0, len(text) - size + 1, size):
            h = hash((h, text[start : start + size]))
            chain.append(h)
        reused = 0
        for block in chain:
            if block not in self.blocks:
                break
            reused += 1
        for block in reversed(chain):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        # A backend always computes the last token itself.
        return tokens, min(reused * BLOCK_TOKENS, tokens - 1)


class CachingUpstream:
    def __init__(
        self,
        *,
        model: str = "mock-model",
        capacity_blocks: int = 4096,
        cost_per_token: float = 0.0,
        report: str = "openai",
        reply_tokens: int = 8,
        serial_prefill: bool = False,
        decode_per_token: float = 0.0,
        stall_every: int = 0,
        stall_secs: float = 0.0,
    ) -> None:
        self.model = model
        self.cache = PrefixCache(capacity_blocks)
        self.cost_per_token = cost_per_token
        self.report = report
        self.reply_tokens = reply_tokens
        self.serial_prefill = serial_prefill
        self.decode_per_token = decode_per_token
        self.stall_every = stall_every
        self.stall_secs = stall_secs
        self._prefilling = asyncio.Lock()
        self._count = 0
        self.served: list[Served] = []
        self.in_flight = 0
        self.pool: list[CachingUpstream] = [self]
        #: While set and not released, answers wait (requests pile up in flight).
        self.gate: asyncio.Event | None = None
        self.index = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> CachingUpstream:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if method == "GET" and path == "/v1/models":
                    document = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                    await self._write(writer, 200, _json.encode(document))
                elif method == "POST" and path == "/v1/chat/completions":
                    await self._chat(writer, body)
                else:
                    await self._write(writer, 404, b'{"error": {"message": "not here"}}')
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _chat(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        doc = msgspec.json.decode(body)
        prompt, cached = self.cache.serve(render(doc))
        self.in_flight += 1
        loads = [up.in_flight for up in self.pool]
        record = Served(
            "/v1/chat/completions", body, prompt, cached, loads, self.index, time.monotonic()
        )
        self.served.append(record)
        self._count += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.stall_every and self._count % self.stall_every == 0:
                record.stalled = True
                await asyncio.sleep(self.stall_secs)
            started = time.monotonic()
            delay = self.cost_per_token * (prompt - cached)
            if delay > 0 and self.serial_prefill:
                async with self._prefilling:
                    started = time.monotonic()
                    await asyncio.sleep(delay)
            elif delay > 0:
                await asyncio.sleep(delay)
            prompt_ms = 1000 * (time.monotonic() - started)
            turn = sum(1 for m in doc.get("messages", []) if m.get("role") == "user")
            text = f"Reply {turn} from upstream {self.index}. " + "ok " * self.reply_tokens
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self.reply_tokens,
                "total_tokens": prompt + self.reply_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            decode_ms = 1000 * self.decode_per_token * self.reply_tokens
            timings = {
                "cache_n": cached,
                "prompt_n": prompt - cached,
                "prompt_ms": round(prompt_ms, 3),
                "predicted_n": self.reply_tokens,
                "predicted_ms": round(decode_ms, 3),
            }
            base = {"id": "chatcmpl-1", "created": 1_700_000_000, "model": doc.get("model")}
            if not doc.get("stream"):
                document: dict[str, Any] = base | {
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                }
                if self.report == "llama":
                    document["timings"] = timings
                else:
                    document["usage"] = usage
                if decode_ms:
                    await asyncio.sleep(decode_ms / 1000)
                record.first_byte = time.monotonic()
                await self._write(writer, 200, _json.encode(document))
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            chunk = base | {"object": "chat.completion.chunk"}
            # Paced: the first event carries the reply's head, then a token each.
            pieces = [text] if not self.decode_per_token else text.split("ok ")
            if self.decode_per_token:
                pieces = [pieces[0]] + ["ok "] * (len(pieces) - 1)
            events = [
                chunk
                | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": piece}}]}
                for piece in pieces
            ]
            events.append(
                chunk
                | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                | ({"timings": timings} if self.report == "llama" else {})
            )
            if self.report != "llama":
                events.append(chunk | {"choices": [], "usage": usage})
            for i, event in enumerate(events):
                if i and i < len(pieces) and self.decode_per_token:
                    await asyncio.sleep(self.decode_per_token)
                data = b"data: " + _json.encode(event) + b"\n\n"
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                if not i:
                    record.first_byte = time.monotonic()
                await writer.drain()
            done = b"data: [DONE]\n\n"
            writer.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
            await writer.drain()
        finally:
            self.in_flight -= 1


class UpstreamPool:
    """Several caching upstreams on one event loop in a thread (synchronous callers);
    ``speeds``: one factor per upstream, dividing its prefill and decode times."""

    def __init__(self, count: int, speeds: list[float] | None = None, **options: Any) -> None:
        self.count = count
        self.options = options
        self.speeds = speeds or [1.0] * count
        self.upstreams: list[CachingUpstream] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> UpstreamPool:
        self._thread.start()

        async def make() -> list[CachingUpstream]:
            ups = []
            for i in range(self.count):
                options = dict(self.options)
                for name in ("cost_per_token", "decode_per_token"):
                    if name in options:
                        options[name] = options[name] / self.speeds[i]
                ups.append(await CachingUpstream(**options).start())
            for i, up in enumerate(ups):
                up.pool, up.index = ups, i
            return ups

        self.upstreams = asyncio.run_coroutine_threadsafe(make(), self.loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            for up in self.upstreams:
                await up.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def hold(self) -> None:
        """Answers wait from now until :meth:`release`."""

        def close() -> None:
            gate = asyncio.Event()
            for up in self.upstreams:
                up.gate = gate

        self._call(close)

    def release(self) -> None:
        def open_() -> None:
            for up in self.upstreams:
                if up.gate is not None:
                    up.gate.set()
                up.gate = None

        self._call(open_)

    def set(self, index: int, **attributes: Any) -> None:
        """Change upstream ``index`` while it runs (a box that slows down, or stalls)."""

        def apply() -> None:
            for name, value in attributes.items():
                setattr(self.upstreams[index], name, value)

        self._call(apply)

    def _call(self, fn: Any) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def in_flight(self) -> int:
        return sum(up.in_flight for up in self.upstreams)

    @property
    def served(self) -> list[Served]:
        return sorted((s for up in self.upstreams for s in up.served), key=lambda s: s.arrived)


@contextlib.contextmanager
def caching_upstreams(count: int, **options: Any) -> Iterator[UpstreamPool]:
    pool = UpstreamPool(count, **options).start()
    try:
        yield pool
    finally:
        pool.stop()
