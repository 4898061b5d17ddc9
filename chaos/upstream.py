"""The fake inference backend behind the chaos workers, run as its own process.

An :class:`asyncio.Protocol` HTTP/1.1 server (keep-alive, no pipelining, bodies
framed by ``content-length``) that answers like an OpenAI- or Anthropic-compatible
server, with numbered tokens so a client can check a relayed answer exactly:

- ``POST /v1/chat/completions`` and ``POST /v1/messages``: ``max_tokens`` tokens whose
  texts are `` t0``, `` t1``, … ; as one JSON document, or with ``"stream": true`` as
  server-sent events in that API's shape (chat: role chunk, token chunks, finish
  chunk, usage chunk, ``data: [DONE]``; messages: ``message_start`` …
  ``message_stop``). Every chunk carries the request's tag (chat: ``id`` is
  ``chatcmpl-<tag>``; messages: ``message_start``'s id is ``msg_<tag>`` and each delta
  has ``"chaos_tag"``), so an answer delivered to the wrong client is caught.
- The body's ``"chaos"`` object steers one request: ``tag``; ``hold`` (answer nothing
  until the harness calls ``/chaos/release``); ``delay`` (seconds before the first
  byte, first attempt only) and ``retry_delay`` (later attempts of the same tag,
  default 0); ``gap`` (seconds between streamed tokens).
- ``GET /chaos/stats``: what the backend saw: requests in progress (by tag), attempts
  per tag, tags whose client (the worker) left before the answer ended ("aborted").
- ``GET /chaos/release`` releases every held request and lets later ones through;
  ``GET /chaos/hold`` makes ``hold`` hold again.
- ``GET /v1/models``: the one model, ``chaos-model``.
- A path under ``/w/<name>`` is the same path, served to worker ``<name>`` (its
  ``--backend-url`` ends with it): ``/chaos/stats`` also counts each worker's requests
  in progress and the most it ever had at once (``peak``), to check that no worker was
  handed more than its ``max_concurrent``; a request whose ``chaos.key`` names an API
  key counts in ``key_peak`` the same way (per-key limits across processes).

Prints ``upstream listening on http://127.0.0.1:<port>`` once it accepts connections;
stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections import Counter
from typing import Any

MODEL = "chaos-model"
CREATED = 1_700_000_000

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _dump(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(data: object, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + (data if isinstance(data, bytes) else _dump(data)) + b"\n\n"


class Answer:
    """The bytes of one answer, built up front; :meth:`token` for streamed token ``i``."""

    def __init__(self, anthropic: bool, tag: str, tokens: int) -> None:
        self.anthropic = anthropic
        self.tag = tag
        self.tokens = tokens
        text = "".join(f" t{i}" for i in range(tokens))
        usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
        if anthropic:
            self.document = _dump(
                {
                    "id": f"msg_{tag}",
                    "type": "message",
                    "role": "assistant",
                    "model": MODEL,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn",
                    "usage": {"input_tokens": 8, "output_tokens": tokens},
                }
            )
        else:
            self.document = _dump(
                {
                    "id": f"chatcmpl-{tag}",
                    "object": "chat.completion",
                    "created": CREATED,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
        self._usage = usage

    def head(self) -> bytes:
        if self.anthropic:
            start = {
                "type": "message_start",
                "message": {
                    "id": f"msg_{self.tag}",
                    "type": "message",
                    "role": "assistant",
                    "model": MODEL,
                    "content": [],
                    "usage": {"input_tokens": 8, "output_tokens": 0},
                },
            }
            block = {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
            events = _sse(start, "message_start") + _sse(block, "content_block_start")
        else:
            events = _sse(self._chat({"role": "assistant", "content": ""}))
        return _STREAM_HEAD + _chunk(events)

    def token(self, index: int) -> bytes:
        text = f" t{index}"
        if self.anthropic:
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
                "chaos_tag": self.tag,
            }
            return _chunk(_sse(delta, "content_block_delta"))
        return _chunk(_sse(self._chat({"content": text})))

    def tail(self) -> bytes:
        if self.anthropic:
            events = (
                _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + _sse(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn"},
                        "usage": {"output_tokens": self.tokens},
                    },
                    "message_delta",
                )
                + _sse({"type": "message_stop"}, "message_stop")
            )
        else:
            final = {
                "id": f"chatcmpl-{self.tag}",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": MODEL,
                "choices": [],
                "usage": self._usage,
            }
            events = _sse(self._chat({}, "stop")) + _sse(final) + _sse(b"[DONE]")
        return _chunk(events) + b"0\r\n\r\n"

    def _chat(self, delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.tag}",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }


class Backend:
    """State shared by every connection: holds, attempts, what is in progress."""

    def __init__(self) -> None:
        self.holding = True
        self.released = asyncio.Event()
        self.attempts: Counter[str] = Counter()
        self.aborted: Counter[str] = Counter()
        self.active: Counter[str] = Counter()
        self.completed = 0
        #: Requests in progress per worker (``/w/<name>`` paths), and the most at once.
        self.in_flight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        #: The same per API key the calls name (``chaos.key``): per-key limits held.
        self.key_in_flight: Counter[str] = Counter()
        self.key_peak: Counter[str] = Counter()

    def stats(self) -> bytes:
        return _dump(
            {
                "active": sum(self.active.values()),
                "active_tags": sorted(t for t, n in self.active.items() if n),
                "requests": sum(self.attempts.values()),
                "completed": self.completed,
                "attempts": dict(self.attempts),
                "aborted": dict(self.aborted),
                "in_flight": dict(self.in_flight),
                "peak": dict(self.peak),
                "key_peak": dict(self.key_peak),
            }
        )

    def release(self) -> None:
        self.holding = False
        self.released.set()

    def hold(self) -> None:
        self.holding = True
        self.released = asyncio.Event()


class Connection(asyncio.Protocol):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is not None and not self.task.done():
            return  # no pipelining: the next request is read when this one is answered
        self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1")
        lines = head.split("\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        parts = lines[0].split(" ")
        method, path = parts[0], parts[1].split("?", 1)[0] if len(parts) > 1 else "/"
        self.task = asyncio.get_running_loop().create_task(self._serve(method, path, body))
        self.task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        if self.transport is not None and not task.cancelled():
            self._next()

    def _write(self, data: bytes) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client left")
        self.transport.write(data)

    async def _serve(self, method: str, path: str, body: bytes) -> None:
        worker = ""
        if path.startswith("/w/"):
            worker, _, rest = path[3:].partition("/")
            path = "/" + rest
        backend = self.backend
        if method == "GET":
            if path == "/chaos/stats":
                self._write(_response("200 OK", backend.stats()))
            elif path == "/chaos/release":
                backend.release()
                self._write(_response("200 OK", b"{}"))
            elif path == "/chaos/hold":
                backend.hold()
                self._write(_response("200 OK", b"{}"))
            elif path == "/v1/models":
                models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                self._write(_response("200 OK", _dump(models)))
            else:
                self._write(_response("404 Not Found", b'{"error":"not found"}'))
            return
        if path not in ("/v1/chat/completions", "/v1/messages"):
            self._write(_response("404 Not Found", b'{"error":"not found"}'))
            return
        try:
            request = json.loads(body)
            chaos = request.get("chaos") or {}
            tag = str(chaos.get("tag", "untagged"))
            tokens = int(request.get("max_tokens") or 8)
            stream = request.get("stream") is True
        except (ValueError, TypeError, AttributeError):
            self._write(_response("400 Bad Request", b'{"error":"bad request"}'))
            return
        backend.attempts[tag] += 1
        attempt = backend.attempts[tag]
        backend.active[tag] += 1
        if worker:
            backend.in_flight[worker] += 1
            backend.peak[worker] = max(backend.peak[worker], backend.in_flight[worker])
        key = str(chaos.get("key", ""))
        if key:
            backend.key_in_flight[key] += 1
            backend.key_peak[key] = max(backend.key_peak[key], backend.key_in_flight[key])
        finished = False
        try:
            if chaos.get("hold") and backend.holding:
                await backend.released.wait()
            delay = (
                float(chaos.get("delay", 0)) if attempt == 1 else float(chaos.get("retry_delay", 0))
            )
            if delay > 0:
                await asyncio.sleep(delay)
            answer = Answer(path == "/v1/messages", tag, tokens)
            if not stream:
                self._write(_response("200 OK", answer.document))
            else:
                gap = float(chaos.get("gap", 0))
                if gap <= 0:
                    self._write(
                        answer.head()
                        + b"".join(answer.token(i) for i in range(tokens))
                        + answer.tail()
                    )
                else:
                    self._write(answer.head())
                    loop = asyncio.get_running_loop()
                    start = loop.time()
                    for i in range(tokens):
                        # An absolute schedule: a late wake-up does not delay later tokens.
                        await asyncio.sleep(max(0.0, start + (i + 1) * gap - loop.time()))
                        self._write(answer.token(i))
                    self._write(answer.tail())
            finished = True
            backend.completed += 1
        except ConnectionResetError:
            pass  # the worker went away mid-answer (counted as aborted below)
        finally:
            backend.active[tag] -= 1
            if not backend.active[tag]:
                del backend.active[tag]
            if worker:
                backend.in_flight[worker] -= 1
            if key:
                backend.key_in_flight[key] -= 1
            if not finished:
                backend.aborted[tag] += 1


async def serve(port: int) -> None:
    backend = Backend()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Connection(backend), "127.0.0.1", port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"upstream listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True
    )
    try:
        await stop.wait()
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
