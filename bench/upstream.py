"""A lean fake OpenAI-compatible upstream for the benchmarks, run in its own process.

``tests/upstream.py`` records every request and reads through asyncio streams, which
is right for tests but costs more per request than a benchmark can spare on the rig's
core. This one is an :class:`asyncio.Protocol` with precomputed answers:

- ``POST /v1/chat/completions`` without ``"stream": true``: one small chat completion
  (``--tokens`` tokens of text, usage included), one write (``--service-time`` seconds
  after the request arrived: a backend's fixed service time, for (i));
- with ``"stream": true``: server-sent events in OpenAI's shape — a role chunk at once,
  then one token chunk every ``1/--token-rate`` seconds on an absolute schedule (no
  drift), then the finish chunk, a usage chunk and ``data: [DONE]`` right after the
  last token. The request's ``max_tokens`` sets the token count (default ``--tokens``).
  Token ``i``'s text is `` t<i>@<µs>``: its index, for the client's "every token, in
  order" check, and ``CLOCK_MONOTONIC`` in microseconds at the moment it was written,
  so a client on the same machine measures each chunk's delivery delay through any
  relay, including those that re-encode chunks (LiteLLM keeps the text);
- ``GET /v1/models``: ``bench-model``.

Prints ``upstream listening on http://127.0.0.1:<port>`` once it accepts connections.
Clients must not pipeline (none of the relays do).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import msgspec

CREATED = 1_700_000_000
MODEL = "bench-model"
_json = msgspec.json.Encoder()


class _Head(msgspec.Struct):
    stream: bool = False
    max_tokens: int | None = None


_head = msgspec.json.Decoder(_Head)


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def completion_body(tokens: int) -> bytes:
    text = "".join(f" t{i}" for i in range(tokens))
    return _json.encode(
        {
            "id": "chatcmpl-bench",
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
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": tokens,
                "total_tokens": 8 + tokens,
            },
        }
    )


_CHUNK_BASE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED}
_CHUNK_BASE["model"] = MODEL


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + _json.encode(_CHUNK_BASE | {"choices": [choice]}) + b"\n\n"


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_ROLE = _http_chunk(_event({"role": "assistant", "content": ""}))
_TOKEN_PREFIX = _event({"content": "@@"}).split(b"@@")


def _tail(tokens: int) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    events = [
        _event({}, "stop"),
        b"data: " + _json.encode(_CHUNK_BASE | {"choices": [], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    return b"".join(_http_chunk(e) for e in events) + b"0\r\n\r\n"


def _token(index: int) -> bytes:
    text = b" t%d@%d" % (index, time.monotonic_ns() // 1000)
    return _http_chunk(_TOKEN_PREFIX[0] + text + _TOKEN_PREFIX[1])


class Upstream:
    def __init__(self, tokens: int, token_rate: float, service_time: float = 0.0) -> None:
        self.tokens = tokens
        self.service_time = service_time
        self.interval = 1.0 / token_rate
        self.completion = _response("200 OK", b"application/json", completion_body(tokens))
        self.models = _response(
            "200 OK",
            b"application/json",
            _json.encode(
                {
                    "object": "list",
                    "data": [{"id": MODEL, "object": "model", "created": CREATED, "owned_by": "b"}],
                }
            ),
        )
        self.not_found = _response("404 Not Found", b"application/json", b'{"error":"no"}')
        self.tails: dict[int, bytes] = {}

    def tail(self, tokens: int) -> bytes:
        tail = self.tails.get(tokens)
        if tail is None:
            tail = self.tails[tokens] = _tail(tokens)
        return tail


class _Connection(asyncio.Protocol):
    def __init__(self, up: Upstream) -> None:
        self.up = up
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()  # the client left mid-stream
            self.timer = None
        self.transport = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            length = 0
            at = head.lower().find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            if len(buf) < end + 4 + length:
                break
            body = buf[end + 4 : end + 4 + length]
            buf = buf[end + 4 + length :]
            self.handle(head, body)
        self.buf = buf

    def handle(self, head: bytes, body: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        up = self.up
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method == b"GET":
            transport.write(up.models if path == b"/v1/models" else up.not_found)
            return
        if path != b"/v1/chat/completions":
            transport.write(up.not_found)
            return
        stream, tokens = False, up.tokens
        if b'"stream"' in body or b'"max_tokens"' in body:
            parsed = _head.decode(body)
            stream = parsed.stream
            tokens = parsed.max_tokens or up.tokens
        if not stream:
            if up.service_time > 0:
                loop = asyncio.get_running_loop()
                self.timer = loop.call_later(up.service_time, self._answer)
            else:
                transport.write(up.completion)
            return
        transport.write(_STREAM_HEAD + _ROLE)
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.timer = loop.call_at(start + up.interval, self._next, start, 0, tokens)

    def _answer(self) -> None:
        self.timer = None
        if self.transport is not None:
            self.transport.write(self.up.completion)

    def _next(self, start: float, index: int, tokens: int) -> None:
        transport = self.transport
        if transport is None:
            return
        if index + 1 >= tokens:
            self.timer = None
            transport.write(_token(index) + self.up.tail(tokens))
            return
        transport.write(_token(index))
        when = start + (index + 2) * self.up.interval
        self.timer = asyncio.get_running_loop().call_at(when, self._next, start, index + 1, tokens)


async def serve(port: int, tokens: int, token_rate: float, service_time: float = 0.0) -> None:
    up = Upstream(tokens, token_rate, service_time)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(up), "127.0.0.1", port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"upstream listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    print(flush=True)
    try:
        await stop.wait()
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=16, help="tokens per completion")
    p.add_argument("--token-rate", type=float, default=20.0, help="streamed tokens per second")
    p.add_argument(
        "--service-time", type=float, default=0.0, help="seconds before a completion is written"
    )
    a = p.parse_args()
    asyncio.run(serve(a.port, a.tokens, a.token_rate, a.service_time))


if __name__ == "__main__":
    main()
