"""ModelRelay worker: puts one GPU box's inference server behind a ModelRelay relay.

It dials **out** to the relay over a WebSocket (no inbound port on the GPU box),
registers the models the local backend serves (llama-server, vLLM, Ollama, any
OpenAI-compatible server), and forwards each request the relay assigns to it.

Install on the GPU box (no Django needed)::

    pip install -r requirements-worker.txt      # websockets, httpx, msgspec

and keep the ``relay/`` package beside this file. The worker imports only its
Django-free modules: ``relay/__init__.py``, ``protocol.py`` (the wire messages
shared with the server), ``errors.py``, ``sse.py`` and ``headers.py``.

Run::

    python worker.py --proxy-url https://relay.example.com --worker-secret "$SECRET" \\
        --backend-url http://127.0.0.1:8080

Every flag has an environment variable (see ``--help`` and ``docs/WORKER.md``).

Guarantees (SPEC §7):

- one task per assigned request, kept by request id, so ``cancel`` aborts exactly
  that backend request (its HTTP connection is closed, the backend sees it);
- streamed bodies are forwarded byte for byte, as soon as they are read, with
  UTF-8 decoded incrementally so a character split across reads stays whole;
- a failing backend request ends in a 502 in the endpoint's error envelope and
  never affects other requests or the connection;
- connection loss and server restarts reconnect with exponential backoff and
  jitter; refusals (close 1008: bad secret, unknown or disabled provider) are
  logged at ERROR and retried slowly;
- SIGTERM/SIGINT drains: stop taking work, finish in-flight requests, exit 0;
  a second signal exits at once with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import logging
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote, urlsplit

import httpx
import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import process_exception as websockets_process_exception
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from relay import __version__
from relay.errors import Flavor, ProtocolError, ServiceUnavailable, WorkerFailed, error_body
from relay.headers import DROPPED_RESPONSE_HEADERS
from relay.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    GracefulShutdown,
    ModelsRefresh,
    ModelsUpdate,
    Ping,
    Pong,
    Register,
    RegisterAck,
    Request,
    ResponseChunk,
    ResponseComplete,
    TokenCounts,
    WorkerMessage,
    decode_server_message,
    encode,
)
from relay.sse import error_event

log = logging.getLogger("modelrelay.worker")

MIB = 1024 * 1024
#: Close codes after which reconnecting with the same settings cannot help.
REFUSAL_CODES = frozenset({1002, 1003, 1008})
#: Request headers never passed to the backend: httpx sets its own framing.
_HOP_BY_HOP_REQUEST = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade"}
)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class Config:
    """Every setting, built by :func:`parse_config` (defaults live in ``OPTIONS``)."""

    proxy_url: str
    worker_secret: str
    provider: str
    worker_name: str
    backend_url: str
    models: tuple[str, ...] | None  # None: discover from the backend
    max_concurrent: int | None  # None: ask the backend (llama-server /props), else 1
    model_refresh_secs: float
    max_message_bytes: int
    log_level: str
    backoff_min_secs: float
    backoff_max_secs: float
    fatal_retry_secs: float
    healthy_session_secs: float
    backend_connect_timeout: float
    backend_read_timeout: float | None
    discovery_timeout: float

    @property
    def connect_url(self) -> str:
        scheme, rest = self.proxy_url.split("://", 1)
        ws_scheme = {"http": "ws", "https": "wss"}.get(scheme.lower(), scheme.lower())
        return f"{ws_scheme}://{rest}/v1/worker/connect?provider={quote(self.provider)}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _url(*schemes: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        parts = urlsplit(text.strip())
        if parts.scheme.lower() not in schemes or not parts.netloc:
            raise argparse.ArgumentTypeError(f"expected a {'/'.join(schemes)} URL, got {text!r}")
        return text.strip().rstrip("/")

    return check


def _models(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))


def _level(text: str) -> str:
    if text.lower() not in ("debug", "info", "warning", "error"):
        raise argparse.ArgumentTypeError("use debug, info, warning or error")
    return text.lower()


#: flag, environment variable, default, parser, help (None: a tuning knob, hidden from
#: --help; tests shrink these instead of sleeping).
OPTIONS: list[tuple[str, str, str | None, Callable[[str], Any], str | None]] = [
    ("--proxy-url", "PROXY_URL", "http://127.0.0.1:8080", _url("http", "https", "ws", "wss"),
     "relay base URL; http becomes ws, https becomes wss"),
    ("--worker-secret", "WORKER_SECRET", None, str,
     "the provider's worker secret, sent as the X-Worker-Secret header; required"),
    ("--provider", "PROVIDER_NAME", "local", str, "provider (pool) to join"),
    ("--worker-name", "WORKER_NAME", socket.gethostname(), str,
     "name shown in the dashboard and logs"),
    ("--backend-url", "BACKEND_URL", "http://127.0.0.1:8000", _url("http", "https"),
     "the local OpenAI-compatible server requests are forwarded to"),
    ("--models", "MODELS", None, _models,
     "comma-separated models to serve; omitted: discovered from the backend's GET /v1/models "
     "(or Ollama's /api/tags) and refreshed periodically"),
    ("--max-concurrent", "MAX_CONCURRENT", None, _positive_int,
     "requests this box runs at once; omitted: llama-server's slot count (GET /props), else 1"),
    ("--model-refresh-secs", "MODEL_REFRESH_SECS", "60", _seconds,
     "how often discovered models are re-read"),
    ("--max-message-bytes", "MAX_MESSAGE_BYTES", str(64 * MIB), _positive_int,
     "largest WebSocket message; keep it equal to the relay's MAX_MESSAGE_BYTES"),
    ("--log-level", "LOG_LEVEL", "info", _level,
     "debug, info, warning or error; debug adds a line per request with its token counts"),
    ("--backoff-min-secs", "WORKER_BACKOFF_MIN_SECS", "1", _seconds, None),
    ("--backoff-max-secs", "WORKER_BACKOFF_MAX_SECS", "30", _seconds, None),
    ("--fatal-retry-secs", "WORKER_FATAL_RETRY_SECS", "60", _seconds, None),
    ("--healthy-session-secs", "WORKER_HEALTHY_SESSION_SECS", "10", _seconds, None),
    ("--backend-connect-timeout", "BACKEND_CONNECT_TIMEOUT_SECS", "10", _seconds, None),
    ("--backend-read-timeout", "BACKEND_READ_TIMEOUT_SECS", "600", _seconds, None),
    ("--discovery-timeout", "WORKER_DISCOVERY_TIMEOUT_SECS", "5", _seconds, None),
]  # fmt: skip


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Flags first, then the environment, then defaults; exits with status 2 on bad input."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="worker.py",
        description="Connect this GPU box's inference server to a ModelRelay relay. "
        "Every flag falls back to the environment variable named in its help.",
    )
    for flag, name, fallback, kind, text in OPTIONS:
        shown = f"env {name}, default {fallback}" if fallback else f"env {name}"
        parser.add_argument(
            flag,
            type=kind,
            metavar=name,
            default=env.get(name) or fallback,  # argparse parses string defaults with ``type``
            help=argparse.SUPPRESS if text is None else f"{text} ({shown})",
        )
    values = vars(parser.parse_args(argv))
    if not values["worker_secret"]:
        parser.error("a worker secret is required: --worker-secret or WORKER_SECRET")
    values["models"] = values["models"] or None
    values["backend_read_timeout"] = values["backend_read_timeout"] or None
    return Config(**values)


# --------------------------------------------------------------------------- helpers


class Backoff:
    """Exponential delays from ``base`` doubling up to ``cap``, each plus up to 25 % jitter."""

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.cap = max(cap, base)
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * 2 ** min(self.attempt, 32))
        self.attempt += 1
        return delay * (1 + 0.25 * random.random())

    def reset(self) -> None:
        self.attempt = 0


_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_MAX_PARTIAL_LINE = MIB


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


class UsageScanner:
    """Token usage as the backend reported it, from a JSON body or an SSE stream.

    Understands OpenAI chat (``usage.prompt_tokens``...), the Responses API
    (``response.usage.input_tokens``...) and Anthropic messages
    (``message.usage.input_tokens`` in ``message_start``, ``usage.output_tokens`` in
    ``message_delta``). Streams are fed in arbitrary pieces; only lines that can
    hold a usage object are JSON-decoded, and the fed bytes are never modified.
    """

    __slots__ = ("_partial", "completion", "prompt", "total")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None
        self.total: int | None = None
        self._partial = b""

    def feed(self, data: bytes) -> None:
        if self._partial:
            data = self._partial + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self._partial = data if len(data) <= _MAX_PARTIAL_LINE else b""
            return
        rest = data[cut + 1 :]
        self._partial = rest if len(rest) <= _MAX_PARTIAL_LINE else b""
        if _USAGE.search(data, 0, cut) is None:
            return
        for line in data[:cut].split(b"\n"):
            self._line(line)

    def finish(self) -> None:
        """The stream ended: a last line without a newline still counts."""
        partial, self._partial = self._partial, b""
        self._line(partial)

    def feed_document(self, body: bytes, content_type: str) -> None:
        if "event-stream" in content_type:
            self.feed(body)
            self.finish()
        elif _USAGE.search(body) is not None:
            self._json(body)

    def _line(self, line: bytes) -> None:
        if line.startswith(b"data:") and _USAGE.search(line) is not None:
            self._json(line[5:])

    def _json(self, raw: bytes) -> None:
        try:
            doc = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return
        if not isinstance(doc, dict):
            return
        usage = doc.get("usage")
        if not isinstance(usage, dict):
            for key in ("response", "message"):  # Responses API / Anthropic message_start
                inner = doc.get(key)
                if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
                    usage = inner["usage"]
                    break
            else:
                return
        prompt = _count(usage.get("prompt_tokens"))
        if prompt is None:
            prompt = _count(usage.get("input_tokens"))
        completion = _count(usage.get("completion_tokens"))
        if completion is None:
            completion = _count(usage.get("output_tokens"))
        total = _count(usage.get("total_tokens"))
        # Later events carry the final numbers (Anthropic's message_delta): overwrite.
        if prompt is not None:
            self.prompt = prompt
        if completion is not None:
            self.completion = completion
        if total is not None:
            self.total = total

    def counts(self) -> TokenCounts | None:
        if self.prompt is None and self.completion is None and self.total is None:
            return None
        total = self.total
        if total is None and self.prompt is not None and self.completion is not None:
            total = self.prompt + self.completion
        return TokenCounts(
            prompt_tokens=self.prompt, completion_tokens=self.completion, total_tokens=total
        )


def flavor_of(endpoint_path: str) -> Flavor:
    if endpoint_path.startswith("/v1/messages"):
        return "anthropic"
    if endpoint_path.startswith("/v1/responses"):
        return "responses"
    return "openai"


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    named_by_connection = {
        token.strip().lower() for token in headers.get("connection", "").split(",") if token
    }
    out: dict[str, str] = {}
    for name, value in headers.multi_items():
        name = name.lower()
        if name in DROPPED_RESPONSE_HEADERS or name in named_by_connection:
            continue
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _format_counts(counts: TokenCounts | None) -> str:
    if counts is None:
        return "none reported"
    return (
        f"prompt={counts.prompt_tokens} completion={counts.completion_tokens} "
        f"total={counts.total_tokens}"
    )


class BackendNotReady(Exception):
    """The backend did not answer a discovery request usefully (yet)."""


class _BodyTooLarge(Exception):
    pass


# --------------------------------------------------------------------------- session


class Session:
    """One WebSocket connection to the relay: register, serve frames, clean up.

    Owns every task it starts (one per request plus helpers); all are cancelled and
    awaited when the connection ends, which closes their backend connections.
    """

    def __init__(self, worker: Worker, ws: ClientConnection) -> None:
        self.worker = worker
        self.ws = ws
        self.requests: dict[str, asyncio.Task[None]] = {}
        self.children: set[asyncio.Task[Any]] = set()
        self.registered_at: float | None = None
        self.draining = False

    @property
    def load(self) -> int:
        return len(self.requests)

    async def send(self, message: WorkerMessage) -> None:
        await self.ws.send(encode(message))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.children.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self.children.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        # A send racing the connection's end is expected; anything else is a bug to see.
        if exc is not None and not isinstance(exc, ConnectionClosed):
            log.error("task %s failed", task.get_name(), exc_info=exc)

    async def run(self) -> None:
        worker = self.worker
        try:
            await self.send(
                Register(
                    worker_name=worker.config.worker_name,
                    models=worker.advertised(),
                    max_concurrent=worker.max_concurrent,
                    protocol_version=PROTOCOL_VERSION,
                    current_load=0,
                )
            )
            while True:
                await self.on_frame(await self.ws.recv())
        except ConnectionClosed:
            pass
        finally:
            children = list(self.children)
            for task in children:
                task.cancel()
            if children:
                await asyncio.wait(children)

    async def on_frame(self, raw: str | bytes) -> None:
        """Handle one frame quickly; anything slow runs in a task of its own."""
        try:
            message = decode_server_message(raw)
        except ProtocolError as exc:
            log.warning("ignoring a frame the worker cannot parse: %s", exc.message[:300])
            return
        match message:
            case Request():
                await self.on_request(message)
            case Cancel():
                self.on_cancel(message)
            case Ping():
                pong = Pong(current_load=self.load, timestamp_unix_ms=message.timestamp_unix_ms)
                await self.send(pong)
            case RegisterAck():
                self.on_ack(message)
            case ModelsRefresh():
                self.spawn(self.worker.refresh_models(self, always=True))
            case GracefulShutdown():
                log.info(
                    "graceful shutdown requested by the proxy (%s): finishing %d in-flight "
                    "request(s), then exiting",
                    message.reason or "no reason given",
                    self.load,
                )
                self.worker.draining = True
                self.drain(announce=False)

    def on_ack(self, ack: RegisterAck) -> None:
        self.registered_at = asyncio.get_running_loop().time()
        log.info(
            "registered as worker %s with models: %s",
            ack.worker_id,
            ", ".join(ack.models) or "(none)",
        )
        for warning in ack.warnings:
            log.warning("proxy warning on register: %s", warning)
        if self.worker.config.models is None and not self.draining:
            self.spawn(self._refresh_periodically(), name="model refresh")

    async def on_request(self, request: Request) -> None:
        rid = request.request_id
        if self.worker.draining:
            log.info("refusing request %s: the worker is shutting down", rid)
            err = ServiceUnavailable("The worker is shutting down, please retry")
            await self.send(
                ResponseComplete(
                    request_id=rid,
                    status_code=503,
                    headers={"content-type": "application/json", "retry-after": "1"},
                    body=error_body(err, flavor_of(request.endpoint_path)).decode(),
                )
            )
            return
        if rid in self.requests:
            log.warning("ignoring a second request with id %s", rid)
            return
        task = self.spawn(self.serve(request), name=f"request {rid}")
        self.requests[rid] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if self.requests.get(rid) is done:
                del self.requests[rid]

        task.add_done_callback(forget)

    def on_cancel(self, cancel: Cancel) -> None:
        # Popped at once: the relay freed the slot, so pongs must not count it.
        task = self.requests.pop(cancel.request_id, None)
        if task is None:
            log.debug("cancel for %s: not in flight here", cancel.request_id)
            return
        log.info("cancelled request %s (%s)", cancel.request_id, cancel.reason)
        task.cancel()

    def drain(self, *, announce: bool) -> None:
        """Stop taking work; close the connection once in-flight requests finished."""
        if self.draining:
            return
        self.draining = True
        if announce:
            self.spawn(self.send(ModelsUpdate(models=[], current_load=self.load)))
        self.spawn(self._close_when_idle(), name="drain")

    async def _close_when_idle(self) -> None:
        pending = list(self.requests.values())
        if pending:
            await asyncio.wait(pending)
        log.info("graceful shutdown: no requests in flight; closing the connection")
        await self.ws.close(1000, "worker drained")

    async def _refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.worker.config.model_refresh_secs)
            if not self.worker.draining:
                await self.worker.refresh_models(self, always=False)

    # -- one request -------------------------------------------------------------

    async def serve(self, request: Request) -> None:
        """Forward one request to the backend and report its outcome to the relay."""
        started = time.monotonic()
        log.info(
            "forwarding request %s: %s model=%s stream=%s",
            request.request_id,
            request.endpoint_path,
            request.model,
            request.is_streaming,
        )
        try:
            complete = await self._exchange(request)
            frame = encode(complete).encode()
            if len(frame) > self.worker.config.max_message_bytes:
                complete = self._failure(request, "the backend's response is too large to relay")
                frame = encode(complete).encode()
            await self.ws.send(frame, text=True)
            log.debug(
                "completed request %s: status %d in %.3fs, tokens %s",
                request.request_id,
                complete.status_code,
                time.monotonic() - started,
                _format_counts(complete.token_counts),
            )
        except asyncio.CancelledError:
            log.debug("request %s aborted; backend connection closed", request.request_id)
            raise
        except ConnectionClosed:
            pass  # the session is ending; the relay handles this request's fate

    async def _exchange(self, request: Request) -> ResponseComplete:
        worker = self.worker
        rid = request.request_id
        scanner = UsageScanner()
        streamed = False
        try:
            async with worker.http.stream(
                "POST",
                worker.config.backend_url + request.endpoint_path,
                content=request.body.encode(),
                headers=_backend_headers(request.headers),
            ) as resp:
                headers = _response_headers(resp.headers)
                content_type = resp.headers.get("content-type", "")
                is_json = "json" in content_type.lower()
                if request.is_streaming and resp.is_success and not is_json:
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    async for data in resp.aiter_bytes():
                        scanner.feed(data)
                        text = decoder.decode(data)
                        if text:  # sent at once: never wait for more bytes to coalesce
                            streamed = True
                            await self.send(ResponseChunk(request_id=rid, chunk=text))
                    text = decoder.decode(b"", final=True)
                    if text:
                        await self.send(ResponseChunk(request_id=rid, chunk=text))
                    scanner.finish()
                    return ResponseComplete(
                        request_id=rid,
                        status_code=resp.status_code,
                        headers=headers,
                        token_counts=scanner.counts(),
                    )
                body = await self._read_body(resp)
                scanner.feed_document(body, content_type)
                return ResponseComplete(
                    request_id=rid,
                    status_code=resp.status_code,
                    headers=headers,
                    body=body.decode("utf-8", "replace"),
                    token_counts=scanner.counts(),
                )
        except ConnectionClosed:
            raise
        except httpx.HTTPError as exc:
            problem = _describe(exc)
            log.warning("backend error on request %s: %s", rid, problem)
        except _BodyTooLarge:
            problem = "the backend's response is too large to relay"
            log.warning("backend error on request %s: %s", rid, problem)
        except Exception as exc:  # a bug here must not take other requests down
            problem = _describe(exc)
            log.exception("backend error on request %s (unexpected)", rid)
        if streamed:
            # The client already has part of the stream: end it with an error event.
            err = WorkerFailed(f"The backend failed mid-stream: {problem}")
            chunk = error_event(err, flavor_of(request.endpoint_path)).decode()
            await self.send(ResponseChunk(request_id=rid, chunk=chunk))
            return ResponseComplete(request_id=rid, status_code=502, token_counts=scanner.counts())
        return self._failure(request, problem)

    async def _read_body(self, resp: httpx.Response) -> bytes:
        limit = self.worker.config.max_message_bytes
        parts: list[bytes] = []
        size = 0
        async for data in resp.aiter_bytes():
            size += len(data)
            if size > limit:
                raise _BodyTooLarge()
            parts.append(data)
        return b"".join(parts)

    def _failure(self, request: Request, problem: str) -> ResponseComplete:
        err = WorkerFailed(f"The backend could not be reached or failed: {problem}")
        return ResponseComplete(
            request_id=request.request_id,
            status_code=502,
            headers={"content-type": "application/json"},
            body=error_body(err, flavor_of(request.endpoint_path)).decode(),
        )


def _backend_headers(forwarded: Mapping[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in forwarded.items() if k.lower() not in _HOP_BY_HOP_REQUEST}
    headers.setdefault("content-type", "application/json")
    # Compressed bodies would have to be decoded before relaying; ask for none.
    headers["accept-encoding"] = "identity"
    return headers


# --------------------------------------------------------------------------- worker


class Worker:
    """The worker's life: wait for the backend, connect, serve, reconnect, drain."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.models: list[str] = list(config.models or ())
        self.max_concurrent = config.max_concurrent or 1
        self.draining = False
        self.exit_code = 0
        self.backoff = Backoff(config.backoff_min_secs, config.backoff_max_secs)
        self._http: httpx.AsyncClient | None = None
        self._session: Session | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop_requested = False
        self._discovery = asyncio.Lock()

    @property
    def http(self) -> httpx.AsyncClient:
        assert self._http is not None, "Worker.run() creates the HTTP client"
        return self._http

    def advertised(self) -> list[str]:
        return [] if self.draining else list(self.models)

    async def run(self) -> int:
        """Serve until stopped; returns the process exit code (0 after a drain)."""
        c = self.config
        timeout = httpx.Timeout(
            connect=c.backend_connect_timeout, read=c.backend_read_timeout, write=60.0, pool=60.0
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
            self._http = http
            self._runner = asyncio.create_task(self._serve_forever(), name="worker")
            try:
                await self._runner
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # run() itself was cancelled, not just stopped
        return self.exit_code

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: the first drains gracefully, the second exits at once."""
        if self._stop_requested:
            log.warning("second stop signal: exiting now without finishing requests")
            self.exit_code = 1
            if self._runner is not None:
                self._runner.cancel()
            return
        self._stop_requested = True
        self.draining = True
        session = self._session
        if session is None:
            log.info("graceful shutdown: not connected, exiting")
            if self._runner is not None:
                self._runner.cancel()
            return
        log.info(
            "graceful shutdown: taking no new work, finishing %d in-flight request(s)",
            session.load,
        )
        session.drain(announce=True)

    async def _serve_forever(self) -> None:
        await self._wait_for_backend()
        c = self.config
        while True:
            connector = connect(
                c.connect_url,
                additional_headers={"X-Worker-Secret": c.worker_secret},
                user_agent_header=f"modelrelay-worker/{__version__}",
                max_size=c.max_message_bytes,
                compression=None,
                ping_interval=20,
                ping_timeout=20,
                close_timeout=5,
                process_exception=self._retryable,
                reconnect_delays=self._delays,
            )
            # aclosing: leaving the loop closes the generator now, not at garbage collection.
            connections = cast(AsyncGenerator[ClientConnection, None], connector.__aiter__())
            try:
                async with contextlib.aclosing(connections):
                    async for ws in connections:
                        delay = await self._session_over(ws)
                        if delay is None:
                            return
                        await asyncio.sleep(delay)
            except InvalidHandshake as exc:
                log.error(
                    "the proxy at %s rejected the WebSocket handshake (%s); check --proxy-url; "
                    "retrying in %.0fs",
                    c.proxy_url,
                    exc,
                    c.fatal_retry_secs,
                )
                await asyncio.sleep(c.fatal_retry_secs)
            except Exception:  # a bug must not kill a daemon on a remote box
                delay = self.backoff.next()
                log.exception("unexpected error in the connection loop; retrying in %.1fs", delay)
                await asyncio.sleep(delay)

    def _retryable(self, exc: Exception) -> Exception | None:
        verdict = websockets_process_exception(exc)
        if verdict is None:
            log.warning("cannot reach the proxy at %s: %s", self.config.proxy_url, _describe(exc))
        return verdict

    def _delays(self) -> Generator[float]:
        while True:
            yield self.backoff.next()

    async def _session_over(self, ws: ClientConnection) -> float | None:
        """Run one connection to its end; the delay before the next one, None to stop."""
        log.info("connected to proxy %s as %s", self.config.proxy_url, self.config.worker_name)
        session = self._session = Session(self, ws)
        try:
            await session.run()
        finally:
            self._session = None
        if self.draining:
            log.info("graceful shutdown complete")
            return None
        code, reason = ws.close_code, ws.close_reason or "no reason given"
        if code in REFUSAL_CODES:
            log.error(
                "the proxy refused this worker (close code %s: %s); check --worker-secret "
                "and --provider; retrying in %.0fs",
                code,
                reason,
                self.config.fatal_retry_secs,
            )
            return self.config.fatal_retry_secs
        loop = asyncio.get_running_loop()
        if (
            session.registered_at is not None
            and loop.time() - session.registered_at >= self.config.healthy_session_secs
        ):
            self.backoff.reset()
        delay = self.backoff.next()
        log.warning(
            "connection to the proxy closed (code %s: %s); reconnecting in %.1fs",
            code,
            reason,
            delay,
        )
        return delay

    # -- backend discovery ---------------------------------------------------------

    async def _wait_for_backend(self) -> None:
        """Learn models and slots from the backend, retrying until it answers."""
        c = self.config
        need_models, need_slots = c.models is None, c.max_concurrent is None
        delays = Backoff(c.backoff_min_secs, c.backoff_max_secs)
        while need_models or need_slots:
            try:
                if need_models:
                    self.models = await self.discover_models()
                    need_models = False
                if need_slots:
                    self.max_concurrent = await self.probe_slots()
                    need_slots = False
            except BackendNotReady as exc:
                delay = delays.next()
                log.warning(
                    "backend at %s is not ready (%s); retrying in %.1fs", c.backend_url, exc, delay
                )
                await asyncio.sleep(delay)
        log.info(
            "backend %s: models %s, max_concurrent %d",
            c.backend_url,
            ", ".join(self.models) or "(none)",
            self.max_concurrent,
        )

    async def discover_models(self) -> list[str]:
        """Models from ``GET /v1/models``, else Ollama's ``GET /api/tags``."""
        problems = []
        sources = (("/v1/models", "data", "id"), ("/api/tags", "models", "name"))
        for path, list_key, name_key in sources:
            try:
                resp = await self.http.get(
                    self.config.backend_url + path, timeout=self.config.discovery_timeout
                )
            except httpx.HTTPError as exc:
                problems.append(f"GET {path}: {_describe(exc)}")
                continue
            if not resp.is_success:
                problems.append(f"GET {path}: HTTP {resp.status_code}")
                continue
            try:
                entries = msgspec.json.decode(resp.content)[list_key]
                names = [e[name_key].strip() for e in entries]
            except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
                problems.append(f"GET {path}: not a model list")
                continue
            return list(dict.fromkeys(n for n in names if n))
        raise BackendNotReady("; ".join(problems))

    async def probe_slots(self) -> int:
        """llama-server's ``total_slots`` from ``GET /props``; 1 for backends without it."""
        try:
            resp = await self.http.get(
                self.config.backend_url + "/props", timeout=self.config.discovery_timeout
            )
        except httpx.HTTPError as exc:
            raise BackendNotReady(f"GET /props: {_describe(exc)}") from None
        if resp.status_code >= 500:  # llama-server answers 503 while loading a model
            raise BackendNotReady(f"GET /props: HTTP {resp.status_code}")
        try:
            slots = (
                msgspec.json.decode(resp.content).get("total_slots") if resp.is_success else None
            )
        except (msgspec.DecodeError, AttributeError):
            slots = None
        if type(slots) is int and slots >= 1:
            return slots
        log.info("the backend does not report its slots; max_concurrent 1 (see --max-concurrent)")
        return 1

    async def refresh_models(self, session: Session, *, always: bool) -> None:
        """Re-read the backend's models; tell the relay when they changed (or ``always``)."""
        changed = False
        if self.config.models is None:
            async with self._discovery:
                try:
                    models = await self.discover_models()
                except BackendNotReady as exc:
                    log.warning("model discovery failed (%s); keeping the last list", exc)
                    models = self.models
                changed, self.models = models != self.models, models
            if changed:
                log.info("backend models changed: %s", ", ".join(models) or "(none)")
        if always or (changed and not self.draining):
            await session.send(ModelsUpdate(models=self.advertised(), current_load=session.load))


# --------------------------------------------------------------------------- main


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Frame-by-frame and per-request lines from the libraries drown the worker's own.
    logging.getLogger("websockets").setLevel(max(logging.INFO, log.getEffectiveLevel()))
    logging.getLogger("asyncio").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


async def _main(config: Config) -> int:
    worker = Worker(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    return await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level)
    return asyncio.run(_main(config))


if __name__ == "__main__":
    sys.exit(main())
