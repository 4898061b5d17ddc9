"""A small, fast fake of an OpenAI-compatible inference server (llama-server, vLLM, Ollama).

Plain asyncio HTTP/1.1 on ``127.0.0.1:0`` with keep-alive and Content-Length request
bodies; no framework, so it costs little per request and can stand behind a
benchmark as well as tests. Output is deterministic (fixed ids and timestamps), so
a response relayed through ModelRelay can be compared byte for byte with the same
request sent here directly.

Endpoints:

- ``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/messages``,
  ``/v1/completions``: JSON with usage, or with ``"stream": true`` server-sent events
  in each API's real shape, usage included (chat and completions: a final
  ``choices: []`` chunk, then ``data: [DONE]``, when ``stream_options.include_usage``
  asks for it, see ``stream_usage``);
- ``POST /v1/embeddings`` (a 4-dimensional vector per input), ``/v1/messages/count_tokens``,
  ``/v1/rerank`` and ``/v1/score`` (llama-server / vLLM shapes), ``/v1/audio/speech``
  (a few bytes of ``audio/mpeg``, for operator-added routes);
- ``in_flight`` / ``max_in_flight``: POSTs being answered now, and the peak;
- ``GET /v1/models`` (OpenAI list), ``GET /props`` (llama-server ``total_slots``),
  ``GET /api/tags`` (Ollama), ``GET /metrics`` (``metrics_text``, when set).

Behaviour is set by attributes (defaults for every request) or per request by a
``"mock": {...}`` object in the JSON body, whose keys are :class:`Mock`'s fields:
forced status and error body, delays before the first byte and per token,
``stepped`` (each write waits for :meth:`FakeUpstream.release`), a multi-byte
UTF-8 character split across two writes, chunked or close-delimited framing, a
stream whose body ends a while after its last event (``end_delay``, ``hold_end``), a
stream broken off mid-way, ``hang`` (answer nothing until the client leaves), or
``padding`` (a large SSE comment before every event: a big stream in few writes),
``line_ending`` (LF, CRLF or CR throughout a stream) and ``blank_apart`` (each event's
closing blank line in a write of its own).

Every request is recorded (:class:`Recorded`) with an :class:`asyncio.Event` for
"the response was fully written" and one for "the client disconnected first", so
tests wait on events, never on time; ``bytes_written`` counts a stream's body bytes
as they are written, so a test sees a client that stopped reading hold the stream
up. Clients must not pipeline requests (httpx, the SDKs and the worker never do).

Use ``async with FakeUpstream() as up: up.url`` inside a test's event loop, or
``with upstream_in_thread() as up:`` for synchronous tests (its own loop in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec

T = TypeVar("T")
Framing = Literal["chunked", "close"]
LineEnding = Literal["lf", "crlf", "cr"]
_LINE_ENDINGS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
#: ``llama``: as llama-server, usage when asked, and its ``timings`` on the last chunk
#: with choices, or on the usage chunk when usage was asked for.
StreamUsage = Literal["when_asked", "openai", "unless_declined", "never", "llama"]

CREATED = 1_700_000_000
#: Every token carries this 3-byte character; ``split_utf8`` cuts it between writes.
EURO = "€"
_EURO = EURO.encode()
_json = msgspec.json.Encoder()
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class Mock(msgspec.Struct, forbid_unknown_fields=True):
    """Per-request overrides (the ``"mock"`` object of a request body)."""

    status: int | None = None
    error_body: Any = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    first_byte_delay: float | None = None
    token_delay: float | None = None
    framing: Framing | None = None
    split_utf8: bool = False
    stepped: bool = False
    break_after: int | None = None
    hang: bool = False
    #: Bytes of an SSE comment (``: ---…``, ignored by SSE clients) before each event.
    padding: int = 0
    #: The line ending of a stream's events (SSE allows each of LF, CRLF and CR).
    line_ending: LineEnding = "lf"
    #: Each event's closing blank line is a write of its own (after the event's last
    #: line and its ending); with ``stepped``, each waits for its own release.
    blank_apart: bool = False
    #: A stream's body ends this long after its last event (the worker's completion
    #: comes that much later), or, with ``hold_end``, once :meth:`FakeUpstream.release`
    #: lets it.
    end_delay: float = 0.0
    hold_end: bool = False


class _Body(msgspec.Struct):
    model: str = "mock-model"
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    mock: Mock = msgspec.field(default_factory=Mock)


_body_decoder = msgspec.json.Decoder(_Body)


@dataclass(eq=False)
class Recorded:
    """One request as the upstream received it, and how its response ended."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    #: Body bytes of a streamed response written so far (excluding chunked framing).
    #: Writes wait for the socket to drain, so this stops growing while the client
    #: reads nothing, once the socket buffers between them are full.
    bytes_written: int = 0
    #: The query string of the request target (after ``?``).
    query: str = ""

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


def unused_port() -> int:
    """A loopback port nothing listens on (a backend that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def token_text(index: int) -> str:
    return f" t{index}{EURO}"


def expected_text(tokens: int) -> str:
    """The assistant text a completion of ``tokens`` tokens carries."""
    return "".join(token_text(i) for i in range(tokens))


class _ClientGone(Exception):
    pass


class FakeUpstream:
    def __init__(
        self,
        *,
        models: list[str] | None = None,
        total_slots: int | None = None,
        ollama: bool = False,
        tokens: int = 5,
        prompt_tokens: int = 7,
        first_byte_delay: float = 0.0,
        token_delay: float = 0.0,
        tokens_per_sec: float | None = None,
        framing: Framing = "chunked",
        record: bool = True,
        send_buffer: int | None = None,
        stream_usage: StreamUsage = "when_asked",
    ) -> None:
        self.models = ["mock-model"] if models is None else models
        #: ``None``: ``GET /props`` answers 404 (vLLM, Ollama).
        self.total_slots = total_slots
        #: Ollama: ``GET /v1/models`` answers 404 and ``GET /api/tags`` lists the models.
        self.ollama = ollama
        #: Anything but 200 makes every GET answer it (llama-server answers 503 while loading).
        self.discovery_status = 200
        #: What ``GET /metrics`` answers (Prometheus text, like llama-server ``--metrics``);
        #: None: 404, like a backend started without metrics.
        self.metrics_text: str | None = None
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.first_byte_delay = first_byte_delay
        #: Seconds between two token events (``tokens_per_sec`` sets it as a rate).
        self.token_delay = 1 / tokens_per_sec if tokens_per_sec else token_delay
        self.framing: Framing = framing
        self.record = record
        #: SO_SNDBUF of every accepted socket (None: the kernel's self-tuning default,
        #: which may buffer megabytes on loopback): bounds what a stalled client leaves
        #: queued in this process's kernel.
        self.send_buffer = send_buffer
        #: When chat/completions streams end with a usage chunk: ``when_asked`` (only when
        #: ``stream_options.include_usage`` is true: llama-server), ``openai`` (the same,
        #: and then ``"usage":null`` in every other chunk: OpenAI and vLLM),
        #: ``unless_declined`` (unless it is false), or ``never`` (a backend that
        #: ignores the option).
        self.stream_usage: StreamUsage = stream_usage
        self.requests: list[Recorded] = []
        #: POSTs being answered now, and the most there ever were at once.
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._steps = asyncio.Semaphore(0)
        self._arrived = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    # -- lifecycle --------------------------------------------------------------

    async def start(self, port: int = 0) -> FakeUpstream:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", port)
        sock = self._server.sockets[0]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Aborting (not cancelling) ends each handler through its normal EOF path.
        for writer in self._connections.values():
            writer.transport.abort()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FakeUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- test controls ------------------------------------------------------------

    def release(self, writes: int = 1) -> None:
        """Let ``writes`` more writes of ``stepped`` responses happen."""
        for _ in range(writes):
            self._steps.release()

    def requests_to(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.path == path]

    async def wait_requests(
        self, count: int, path: str | None = None, timeout: float = 5.0
    ) -> list[Recorded]:
        """Wait until ``count`` requests (to ``path``, if given) have arrived."""
        async with asyncio.timeout(timeout):
            while True:
                seen = self.requests if path is None else self.requests_to(path)
                if len(seen) >= count:
                    return seen
                self._arrived.clear()
                await self._arrived.wait()

    # -- HTTP ---------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        if self.send_buffer is not None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                line, *lines = head[:-4].decode("latin-1").split("\r\n")
                method, target, _ = line.split(" ", 2)
                headers = {}
                for raw in lines:
                    name, _, value = raw.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                path, _, query = target.partition("?")
                rec = Recorded(method, path, headers, body, query=query)
                # A backend without metrics (the default here) is still asked for them
                # by the worker's sampler: those asks are not requests a test counts.
                scrape = rec.path == "/metrics" and self.metrics_text is None
                if self.record and not scrape:
                    self.requests.append(rec)
                    self._arrived.set()
                keep_alive = headers.get("connection", "").lower() != "close"
                if not await self._respond(rec, reader, writer) or not keep_alive:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            del self._connections[task]
            writer.close()

    async def _respond(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection must not be reused."""
        if rec.method == "GET":
            return await self._answer(rec, reader, writer)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(rec, reader, writer)
        finally:
            self.in_flight -= 1

    async def _answer(
        self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if rec.method == "GET" and rec.path == "/metrics" and self.metrics_text is not None:
            self._write_json(
                writer, 200, self.metrics_text.encode(), content_type="text/plain; version=0.0.4"
            )
            rec.finished.set()
            return True
        if rec.method == "GET":
            status, document = self._get(rec.path)
            self._write_json(writer, status, document)
            rec.finished.set()
            return True
        if rec.path in _ONE_SHOT:
            status, content_type, answer = _ONE_SHOT[rec.path](rec.body)
            self._write_json(writer, status, answer, content_type=content_type)
            rec.finished.set()
            return True
        if rec.path not in _GENERATING:
            self._write_json(writer, 404, {"error": {"message": "not found", "type": "x"}})
            rec.finished.set()
            return True
        try:
            req = _body_decoder.decode(rec.body)
        except msgspec.DecodeError as exc:
            self._write_json(writer, 400, {"error": {"message": str(exc), "type": "bad"}})
            rec.finished.set()
            return True
        mock = req.mock
        delay = self.first_byte_delay if mock.first_byte_delay is None else mock.first_byte_delay
        slow = req.stream or mock.hang or mock.stepped or delay > 0
        if not slow:  # the hot path: no watcher task, one write
            self._write_answer(writer, rec.path, req)
            rec.finished.set()
            return True
        # Slow answers race the client: EOF on the socket means it went away.
        produce = asyncio.ensure_future(self._slow_answer(writer, rec.path, req, delay, rec))
        watch = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({produce, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (produce, watch):
                task.cancel()
            await asyncio.wait({produce, watch})
        if produce.cancelled() or produce.exception() is not None:
            rec.disconnected.set()
            return False
        rec.finished.set()
        return produce.result()

    def _get(self, path: str) -> tuple[int, Any]:
        if self.discovery_status != 200:
            return self.discovery_status, {"error": {"message": "unavailable", "type": "mock"}}
        if path == "/v1/models" and not self.ollama:
            data = [
                {"id": m, "object": "model", "created": CREATED, "owned_by": "mock"}
                for m in self.models
            ]
            return 200, {"object": "list", "data": data}
        if path == "/api/tags" and self.ollama:
            return 200, {"models": [{"name": m, "model": m, "size": 1} for m in self.models]}
        if path == "/props" and self.total_slots is not None:
            return 200, {"total_slots": self.total_slots, "model_path": "/models/mock.gguf"}
        return 404, {"error": {"message": f"no route for {path}", "type": "not_found"}}

    def _write_json(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        document: Any,
        *,
        close: bool = False,
        content_type: str = "application/json",
    ) -> None:
        body = document if isinstance(document, bytes) else _json.encode(document)
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            f"x-mock-upstream: 1\r\n"
        )
        if close:
            head += "connection: close\r\n"
        writer.write(head.encode() + b"\r\n" + body)

    def _write_answer(self, writer: asyncio.StreamWriter, path: str, req: _Body) -> None:
        mock = req.mock
        if mock.status is not None and mock.status >= 400:
            body = mock.error_body if mock.error_body is not None else _error_document(path)
            if isinstance(body, str):
                body = body.encode()
            self._write_json(writer, mock.status, body)
            return
        tokens = self.tokens if mock.tokens is None else mock.tokens
        prompt = self.prompt_tokens if mock.prompt_tokens is None else mock.prompt_tokens
        self._write_json(writer, mock.status or 200, _document(path, req.model, tokens, prompt))

    async def _slow_answer(
        self,
        writer: asyncio.StreamWriter,
        path: str,
        req: _Body,
        delay: float,
        rec: Recorded | None = None,
    ) -> bool:
        mock = req.mock
        if mock.hang:
            await asyncio.Future()  # until the client leaves
        if delay > 0:
            await asyncio.sleep(delay)
        if not req.stream or (mock.status is not None and mock.status >= 400):
            if mock.stepped:
                await self._steps.acquire()
            self._write_answer(writer, path, req)
            await writer.drain()
            return True
        tokens = self.tokens if mock.tokens is None else mock.tokens
        prompt = self.prompt_tokens if mock.prompt_tokens is None else mock.prompt_tokens
        token_delay = self.token_delay if mock.token_delay is None else mock.token_delay
        framing = mock.framing or self.framing
        head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        head += "x-mock-upstream: 1\r\n"
        head += (
            "transfer-encoding: chunked\r\n\r\n"
            if framing == "chunked"
            else "connection: close\r\n\r\n"
        )
        writer.write(head.encode())
        asked = (req.stream_options or {}).get("include_usage")
        usage = self.stream_usage
        include_usage = asked is not False if usage == "unless_declined" else asked is True
        if usage == "never":
            include_usage = False
        events = _events(path, req.model, tokens, prompt, include_usage)
        if usage == "openai" and include_usage:
            events = [_null_usage(e) for e in events]
        if usage == "llama" and path in ("/v1/chat/completions", "/v1/completions"):
            events = _llama_timings(events, prompt, tokens, include_usage)
        for index, event in enumerate(events):
            if mock.break_after is not None and index > mock.break_after:
                writer.transport.abort()  # a broken stream: no terminating chunk
                raise _ClientGone()
            if mock.padding > 0 and b'"choices":[],"usage"' not in event:
                # (Not before a usage chunk: a stream is the same with it or without.)
                event = b": " + b"-" * mock.padding + b"\n\n" + event
            eol = _LINE_ENDINGS[mock.line_ending]
            if eol != b"\n":
                event = event.replace(b"\n", eol)  # (JSON text holds no raw newline)
            pieces = [event]
            if mock.split_utf8 and _EURO in event:
                cut = event.index(_EURO) + 1
                pieces = [event[:cut], event[cut:]]
            if mock.blank_apart:
                pieces[-1:] = [pieces[-1][: -len(eol)], eol]
            for piece in pieces:
                if mock.stepped:
                    await self._steps.acquire()
                if writer.transport.is_closing():
                    raise _ClientGone()
                writer.write(
                    b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece
                )
                if rec is not None:
                    rec.bytes_written += len(piece)
                await writer.drain()
            if token_delay > 0 and index < len(events) - 1:
                await asyncio.sleep(token_delay)
        if mock.hold_end:
            await self._steps.acquire()
        if mock.end_delay > 0:
            await asyncio.sleep(mock.end_delay)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        await writer.drain()
        return False  # close-delimited: the end of the body is the end of the connection


_GENERATING = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions")


class _Inputs(msgspec.Struct):
    model: str = "mock-model"
    input: Any = None
    query: str = ""
    documents: list[Any] = []
    text_1: Any = None
    text_2: Any = None
    messages: list[Any] = []


_inputs_decoder = msgspec.json.Decoder(_Inputs)


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _embeddings(body: bytes) -> tuple[int, str, Any]:
    req = _inputs_decoder.decode(body)
    inputs = _as_list(req.input)
    data = [
        {"object": "embedding", "index": i, "embedding": [0.25 * (i + 1), 0.5, -0.5, 1.0]}
        for i in range(len(inputs))
    ]
    usage = {"prompt_tokens": 3 * len(inputs), "total_tokens": 3 * len(inputs)}
    return (
        200,
        "application/json",
        {"object": "list", "data": data, "model": req.model, "usage": usage},
    )


def _count_tokens(body: bytes) -> tuple[int, str, Any]:
    req = _inputs_decoder.decode(body)
    return 200, "application/json", {"input_tokens": 7 * max(1, len(req.messages))}


def _rerank(body: bytes) -> tuple[int, str, Any]:
    req = _inputs_decoder.decode(body)
    results = [
        {"index": i, "relevance_score": 1.0 / (i + 1), "document": {"text": str(doc)}}
        for i, doc in enumerate(req.documents)
    ]
    return (
        200,
        "application/json",
        {"model": req.model, "results": results, "usage": {"total_tokens": 5 * len(results)}},
    )


def _score(body: bytes) -> tuple[int, str, Any]:
    req = _inputs_decoder.decode(body)
    pairs = _as_list(req.text_2)
    data = [{"index": i, "object": "score", "score": 0.5} for i in range(len(pairs))]
    return 200, "application/json", {"object": "list", "model": req.model, "data": data}


def _speech(body: bytes) -> tuple[int, str, Any]:
    return 200, "audio/mpeg", b"ID3\x04mock-audio"


#: Endpoints answered in one write, never streamed: path -> answer(body).
_ONE_SHOT: dict[str, Callable[[bytes], tuple[int, str, Any]]] = {
    "/v1/embeddings": _embeddings,
    "/v1/messages/count_tokens": _count_tokens,
    "/v1/rerank": _rerank,
    "/v1/score": _score,
    "/v1/audio/speech": _speech,
}


def _error_document(path: str) -> Any:
    if path == "/v1/messages":
        return {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "mock error"},
        }
    return {"error": {"message": "mock error", "type": "invalid_request_error", "code": None}}


def _document(path: str, model: str, tokens: int, prompt: int) -> dict[str, Any]:
    text = expected_text(tokens)
    if path == "/v1/messages":
        return {
            "id": "msg_mock",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": tokens},
        }
    if path == "/v1/responses":
        return _response_object(model, "completed", [_message_item(text)], prompt, tokens)
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    if path == "/v1/completions":
        return {
            "id": "cmpl-mock",
            "object": "text_completion",
            "created": CREATED,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
            "usage": usage,
        }
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
        },
    }


def _message_item(text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "type": "message",
        "id": "msg_mock",
        "status": "completed" if text is not None else "in_progress",
        "role": "assistant",
        "content": content,
    }


def _response_object(
    model: str, status: str, output: list[Any], prompt: int | None, tokens: int | None
) -> dict[str, Any]:
    usage = None
    if prompt is not None and tokens is not None:
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + tokens,
        }
    return {
        "id": "resp_mock",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _null_usage(event: bytes) -> bytes:
    """A chunk as OpenAI sends it once usage was asked for: ``"usage":null`` added."""
    if event.startswith(b"data: {") and b'"usage"' not in event:
        return event[: event.rindex(b"}")] + b',"usage":null}' + b"\n\n"
    return event


def _llama_timings(events: list[bytes], prompt: int, tokens: int, asked: bool) -> list[bytes]:
    """``timings`` where llama-server puts them: the usage chunk when usage was asked
    for, else the last chunk with choices."""
    timings = b',"timings":{"cache_n":0,"prompt_n":%d,"predicted_n":%d,"prompt_ms":1.5}}' % (
        prompt,
        tokens,
    )
    marker = b'"choices":[],' if asked else b'"finish_reason":"'
    at = max(i for i, event in enumerate(events) if marker in event)
    event = events[at]
    events[at] = event[: event.rindex(b"}")] + timings + b"\n\n"
    return events


def _sse(data: Any, event: str | None = None) -> bytes:
    prefix = b"event: " + event.encode() + b"\n" if event else b""
    return prefix + b"data: " + _json.encode(data) + b"\n\n"


def _events(path: str, model: str, tokens: int, prompt: int, include_usage: bool) -> list[bytes]:
    """The whole stream as a list of SSE events, one write each."""
    if path == "/v1/messages":
        return _anthropic_events(model, tokens, prompt)
    if path == "/v1/responses":
        return _responses_events(model, tokens, prompt)
    if path == "/v1/completions":
        base = {"id": "cmpl-mock", "object": "text_completion", "created": CREATED}
        base["model"] = model

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None}
            return _sse(base | {"choices": [choice | {"finish_reason": finish}]})

        events = []
    else:
        base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": CREATED}
        base["model"] = model

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return _sse(base | {"choices": [choice]})

        events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": token_text(i)}) for i in range(tokens)]
    events.append(chunk({}, "stop"))
    if include_usage:
        usage = {"prompt_tokens": prompt, "completion_tokens": tokens}
        usage["total_tokens"] = prompt + tokens
        events.append(_sse(base | {"choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return events


def _anthropic_events(model: str, tokens: int, prompt: int) -> list[bytes]:
    message: dict[str, Any] = {
        "id": "msg_mock",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1},
    }
    events = [
        _sse({"type": "message_start", "message": message}, "message_start"),
        _sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
        _sse({"type": "ping"}, "ping"),
    ]
    for i in range(tokens):
        delta = {"type": "text_delta", "text": token_text(i)}
        events.append(
            _sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
        )
    events += [
        _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        _sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": tokens},
            },
            "message_delta",
        ),
        _sse({"type": "message_stop"}, "message_stop"),
    ]
    return events


def _responses_events(model: str, tokens: int, prompt: int) -> list[bytes]:
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    text = expected_text(tokens)
    where = {"item_id": "msg_mock", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    events = [
        event("response.created", response=_response_object(model, "in_progress", [], None, None)),
        event("response.output_item.added", output_index=0, item=_message_item(None)),
        event("response.content_part.added", part=part, **where),
    ]
    events += [
        event("response.output_text.delta", delta=token_text(i), **where) for i in range(tokens)
    ]
    done_part = part | {"text": text}
    events += [
        event("response.output_text.done", text=text, **where),
        event("response.content_part.done", part=done_part, **where),
        event("response.output_item.done", output_index=0, item=_message_item(text)),
        event(
            "response.completed",
            response=_response_object(model, "completed", [_message_item(text)], prompt, tokens),
        ),
    ]
    return events


# --------------------------------------------------------------------------- threads


class ThreadedUpstream:
    """A :class:`FakeUpstream` on its own event loop in a daemon thread."""

    def __init__(self, port: int = 0, **options: Any) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._options = options
        self.upstream: FakeUpstream

    @property
    def url(self) -> str:
        return self.upstream.url

    @property
    def requests(self) -> list[Recorded]:
        return self.upstream.requests

    def requests_to(self, path: str) -> list[Recorded]:
        return self.upstream.requests_to(path)

    def call(self, factory: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
        """Run ``factory()`` on the upstream's loop and wait for its result."""

        async def run() -> T:
            return await factory()

        future: Future[T] = asyncio.run_coroutine_threadsafe(run(), self.loop)
        return future.result(timeout)

    def start(self) -> ThreadedUpstream:
        self._thread.start()

        async def make() -> FakeUpstream:  # Events and locks belong to this loop
            return await FakeUpstream(**self._options).start(self.port)

        self.upstream = self.call(make)
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.upstream.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    def wait_requests(
        self, count: int, path: str | None = None, timeout: float = 5.0
    ) -> list[Recorded]:
        return self.call(lambda: self.upstream.wait_requests(count, path, timeout), timeout + 1)

    def wait_event(self, event: asyncio.Event, timeout: float = 5.0) -> None:
        """Block until ``event`` (e.g. ``Recorded.disconnected``) is set; raises on timeout."""

        async def waiter() -> None:
            async with asyncio.timeout(timeout):
                await event.wait()

        self.call(waiter, timeout + 1)

    def release(self, writes: int = 1) -> None:
        self.loop.call_soon_threadsafe(self.upstream.release, writes)


@contextlib.contextmanager
def upstream_in_thread(port: int = 0, **options: Any) -> Iterator[ThreadedUpstream]:
    """``with upstream_in_thread(tokens=3) as up: httpx.post(up.url + ...)``"""
    threaded = ThreadedUpstream(port, **options).start()
    try:
        yield threaded
    finally:
        threaded.stop()
