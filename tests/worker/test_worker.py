"""``worker.py`` against a scripted fake relay (``websockets.serve``) and a fake upstream.

The worker runs in-process (``Worker(config).run()``) except where a real process is
the point (signals, the no-Django import check). Timings are shrunk through the
worker's hidden tuning flags; tests wait on events with bounded timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as HandshakeRequest
from websockets.http11 import Response as HandshakeResponse

import worker
from relay.wire.protocol import (
    BACKEND_HEALTH,
    FLOW_CONTROL,
    WORKER_DRAINING,
    Cancel,
    Error,
    GracefulShutdown,
    ModelsRefresh,
    ModelsUpdate,
    Pause,
    Ping,
    Pong,
    Register,
    RegisterAck,
    Request,
    ResponseChunk,
    ResponseComplete,
    Resume,
    ServerMessage,
    TokenCounts,
    WorkerMessage,
    decode_worker_message,
    encode,
)
from relay.worker.config import Config, parse_config
from relay.worker.session import MAX_SILENCE_SECS, MIN_SILENCE_SECS, silence_limit
from tests.upstream import FakeUpstream, Recorded, unused_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = "mrw_worker-test-secret"
FAST = [
    "--backoff-min-secs",
    "0.01",
    "--backoff-max-secs",
    "0.05",
    "--fatal-retry-secs",
    "0.4",
    "--healthy-session-secs",
    "0.2",
    "--no-backend-metrics",  # tests/worker/test_sampler.py covers the metrics frames
]
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
M = TypeVar("M")


# --------------------------------------------------------------------------- fake relay


class RelaySide:
    """The relay's end of one worker connection, scripted by a test.

    Its ``register_ack`` accepts ``features`` (None: all the worker announced) and
    announces ``heartbeat`` as the ping period (None: says nothing, like older relays);
    the relay never pings by itself.
    """

    def __init__(
        self,
        ws: ServerConnection,
        auto_ack: bool,
        features: list[str] | None = None,
        heartbeat: float | None = None,
    ) -> None:
        self.ws = ws
        self.auto_ack = auto_ack
        self.features = features
        self.heartbeat = heartbeat
        self.received: list[WorkerMessage] = []
        self.register: Register | None = None
        self.registered = asyncio.Event()
        self.closed = asyncio.Event()
        self._changed = asyncio.Event()
        self._taken: set[int] = set()

    async def pump(self) -> None:
        try:
            async for raw in self.ws:
                message = decode_worker_message(raw)
                if isinstance(message, Register) and self.register is None:
                    self.register = message
                    if self.auto_ack:
                        ack = RegisterAck(
                            worker_id="w-test",
                            models=message.models,
                            features=message.features if self.features is None else self.features,
                            heartbeat_interval_secs=self.heartbeat,
                        )
                        await self.send(ack)
                    self.registered.set()
                self.received.append(message)
                self._changed.set()
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()
            self._changed.set()

    async def send(self, message: ServerMessage) -> None:
        await self.ws.send(encode(message))

    async def wait_for(
        self, kind: type[M], where: Callable[[M], bool] = lambda _: True, timeout: float = 5.0
    ) -> M:
        """The first not yet taken message of ``kind`` matching ``where``."""
        async with asyncio.timeout(timeout):
            while True:
                for message in self.received:
                    taken = id(message) in self._taken
                    if isinstance(message, kind) and not taken and where(message):
                        self._taken.add(id(message))
                        return message
                if self.closed.is_set():
                    raise AssertionError(f"connection closed before a {kind.__name__} arrived")
                self._changed.clear()
                await self._changed.wait()

    async def request(
        self,
        rid: str,
        path: str = CHAT,
        *,
        stream: bool = False,
        mock: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Assign a request to the worker; returns the raw body sent."""
        document: dict[str, Any] = {"model": "mock-model", "stream": stream, **(extra or {})}
        if path == MESSAGES:
            document.setdefault("max_tokens", 16)
        if mock:
            document["mock"] = mock
        body = json.dumps(document, separators=(", ", ": "))
        headers = {"content-type": "application/json", "authorization": "Bearer sk-client"}
        await self.send(
            Request(
                request_id=rid,
                model="mock-model",
                endpoint_path=path,
                is_streaming=stream,
                body=body,
                headers=headers,
            )
        )
        return body

    async def complete(self, rid: str, timeout: float = 5.0) -> ResponseComplete:
        return await self.wait_for(ResponseComplete, lambda m: m.request_id == rid, timeout)

    def chunks(self, rid: str) -> list[str]:
        return [
            m.chunk for m in self.received if isinstance(m, ResponseChunk) and m.request_id == rid
        ]

    async def ping(self, stamp: int) -> Pong:
        await self.send(Ping(timestamp_unix_ms=stamp))
        return await self.wait_for(Pong, lambda p: p.timestamp_unix_ms == stamp)


class FakeRelay:
    """Accepts workers on ``127.0.0.1:0``; ``refuse`` closes each with that code after accept.

    ``features`` and ``heartbeat`` shape every ``register_ack`` (see :class:`RelaySide`).
    """

    def __init__(
        self,
        *,
        auto_ack: bool = True,
        refuse: tuple[int, str] | None = None,
        reject_status: int | None = None,
        features: list[str] | None = None,
        heartbeat: float | None = None,
    ) -> None:
        self.auto_ack = auto_ack
        self.features = features
        self.heartbeat = heartbeat
        self.refuse = refuse
        self.reject_status = reject_status
        self.sides: list[RelaySide] = []
        self.handshakes: list[float] = []
        self.closes: list[float] = []
        self.url = ""
        self._changed = asyncio.Event()
        self._server: Server | None = None

    async def __aenter__(self) -> FakeRelay:
        self._server = await serve(
            self._handle,
            "127.0.0.1",
            0,
            compression=None,
            max_size=64 * 1024 * 1024,
            process_request=self._process_request,
        )
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def _process_request(
        self, connection: ServerConnection, request: HandshakeRequest
    ) -> HandshakeResponse | None:
        self.handshakes.append(time.monotonic())
        self._changed.set()
        if self.reject_status is not None:
            return connection.respond(HTTPStatus(self.reject_status), "no worker route here\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        side = RelaySide(ws, self.auto_ack, self.features, self.heartbeat)
        self.sides.append(side)
        self._changed.set()
        try:
            if self.refuse is not None:
                await ws.close(*self.refuse)
                return
            await side.pump()
        finally:
            self.closes.append(time.monotonic())
            self._changed.set()

    async def _until(self, check: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                self._changed.clear()
                await self._changed.wait()

    async def connection(self, index: int = 0, timeout: float = 5.0) -> RelaySide:
        await self._until(lambda: len(self.sides) > index, timeout)
        return self.sides[index]

    async def registered(self, index: int = 0, timeout: float = 5.0) -> RelaySide:
        side = await self.connection(index, timeout)
        async with asyncio.timeout(timeout):
            await side.registered.wait()
        return side

    async def wait_handshakes(self, count: int, timeout: float = 5.0) -> None:
        await self._until(lambda: len(self.handshakes) >= count, timeout)


# --------------------------------------------------------------------------- helpers


def config(relay_url: str, backend_url: str, *flags: str, **env: str) -> Config:
    argv = [
        "--proxy-url",
        relay_url,
        "--worker-secret",
        SECRET,
        "--backend-url",
        backend_url,
        "--worker-name",
        "box-1",
        *FAST,
        *flags,
    ]
    return parse_config(argv, env)


def config_for(backend_url: str, *flags: str) -> Callable[[str], Config]:
    """:func:`config` once the relay's URL is known."""
    return lambda relay_url: config(relay_url, backend_url, *flags)


@contextlib.asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[asyncio.Task[int]]:
    """Run a worker in this event loop; always cancelled and awaited at the end."""
    instance = worker.Worker(cfg)
    task = asyncio.create_task(instance.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait([task])


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as up:
        yield up


@pytest.fixture
async def relay() -> AsyncIterator[FakeRelay]:
    async with FakeRelay() as fake:
        yield fake


@pytest.fixture
async def connected(
    relay: FakeRelay, upstream: FakeUpstream
) -> AsyncIterator[tuple[RelaySide, FakeUpstream]]:
    """A registered worker serving ``mock-model`` from the fake upstream."""
    async with running(config(relay.url, upstream.url)):
        yield await relay.registered(), upstream


async def direct(up: FakeUpstream, path: str, body: str) -> bytes:
    """What the upstream answers to ``body`` when asked directly."""
    async with httpx.AsyncClient() as client:
        response = await client.post(up.url + path, content=body)
        return response.content


class WorkerProcess:
    """``worker.py`` as a real process whose log lines the test can wait for."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._pump = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, *argv: str) -> WorkerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "worker.py"),
            *argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))
            self._changed.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    async def wait_log(self, needle: str, timeout: float = 5.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not any(needle in line for line in self.lines):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{needle!r} not in worker log:\n{self.log}") from None

    async def wait(self, timeout: float = 5.0) -> int:
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            await self._pump
            return code

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await asyncio.wait([self._pump], timeout=5)


@contextlib.asynccontextmanager
async def worker_process(*argv: str) -> AsyncIterator[WorkerProcess]:
    process = await WorkerProcess.start(*argv)
    try:
        yield process
    finally:
        await process.stop()


# --------------------------------------------------------------------------- the program


def test_worker_imports_no_django() -> None:
    check = (
        "import worker, sys; "
        "assert not any(m == 'django' or m.startswith('django.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('django'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr


def test_help_explains_every_flag_and_its_env_variable() -> None:
    result = subprocess.run(
        [sys.executable, "worker.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for flag, env in [
        ("--proxy-url", "PROXY_URL"),
        ("--worker-secret", "WORKER_SECRET"),
        ("--provider", "PROVIDER_NAME"),
        ("--worker-name", "WORKER_NAME"),
        ("--backend-url", "BACKEND_URL"),
        ("--models", "MODELS"),
        ("--max-concurrent", "MAX_CONCURRENT"),
        ("--model-refresh-secs", "MODEL_REFRESH_SECS"),
        ("--max-message-bytes", "MAX_MESSAGE_BYTES"),
        ("--log-level", "LOG_LEVEL"),
    ]:
        assert flag in text and f"env {env}" in text, flag
    assert "--backoff-min-secs" not in text  # tuning knobs stay out of the help


def test_backoff_doubles_to_its_cap_with_bounded_jitter_and_resets() -> None:
    backoff = worker.Backoff(1.0, 30.0)
    delays = [backoff.next() for _ in range(8)]
    for delay, base in zip(delays, [1, 2, 4, 8, 16, 30, 30, 30], strict=True):
        assert base <= delay <= base * 1.25
    backoff.reset()
    assert backoff.next() <= 1.25


# --------------------------------------------------------------------------- registration


async def test_it_registers_with_its_name_models_capacity_and_secret(
    upstream: FakeUpstream,
) -> None:
    async with (
        FakeRelay() as relay,
        running(config(relay.url, upstream.url, "--provider", "gpu-pool", "--max-concurrent", "3")),
    ):
        side = await relay.registered()
        assert side.register == Register(
            worker_name="box-1",
            models=["mock-model"],
            max_concurrent=3,
            protocol_version="1",
            current_load=0,
            features=[FLOW_CONTROL, BACKEND_HEALTH],
        )
        assert side.ws.request is not None
        assert side.ws.request.path == "/v1/worker/connect?provider=gpu-pool"
        assert side.ws.request.headers["X-Worker-Secret"] == SECRET
        assert upstream.requests_to("/props") == []  # capacity was given


async def test_it_discovers_models_from_v1_models_and_slots_from_props(relay: FakeRelay) -> None:
    async with FakeUpstream(models=["qwen-7b", "llama3-8b"], total_slots=4) as up:
        async with running(config(relay.url, up.url)):
            side = await relay.registered()
        assert side.register is not None
        assert side.register.models == ["qwen-7b", "llama3-8b"]
        assert side.register.max_concurrent == 4


async def test_it_falls_back_to_ollama_tags_and_one_slot(relay: FakeRelay) -> None:
    async with FakeUpstream(models=["llama3:8b"], ollama=True) as up:
        async with running(config(relay.url, up.url)):
            side = await relay.registered()
        assert side.register is not None
        assert side.register.models == ["llama3:8b"]
        assert side.register.max_concurrent == 1
        assert [r.path for r in up.requests[:2]] == ["/v1/models", "/api/tags"]


async def test_it_waits_for_the_backend_before_registering(relay: FakeRelay) -> None:
    async with FakeUpstream(models=["late-model"]) as up:
        up.discovery_status = 503  # llama-server while it loads a model
        async with running(config(relay.url, up.url)):
            await up.wait_requests(3, path="/v1/models")  # it keeps retrying
            assert relay.handshakes == []
            up.discovery_status = 200
            side = await relay.registered()
        assert side.register is not None and side.register.models == ["late-model"]


# --------------------------------------------------------------------------- requests


async def test_a_non_streaming_request_comes_back_complete_with_tokens(
    connected: tuple[RelaySide, FakeUpstream],
) -> None:
    side, up = connected
    body = await side.request("r-1", CHAT)
    complete = await side.complete("r-1")
    assert complete.status_code == 200
    assert complete.body is not None
    assert complete.body.encode() == await direct(up, CHAT, body)
    assert complete.headers["content-type"] == "application/json"
    assert complete.headers["x-mock-upstream"] == "1"
    assert "content-length" not in complete.headers
    assert complete.token_counts == TokenCounts(7, 5, 12)
    assert side.chunks("r-1") == []
    seen = up.requests_to(CHAT)[0]
    assert seen.body == body.encode()  # forwarded unmodified
    assert seen.headers["authorization"] == "Bearer sk-client"
    assert seen.headers["accept-encoding"] == "identity"


@pytest.mark.parametrize("framing", ["chunked", "close"])
@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
async def test_streamed_chunks_arrive_in_order_and_byte_exact(
    connected: tuple[RelaySide, FakeUpstream], path: str, framing: str
) -> None:
    side, up = connected
    mock = {"split_utf8": True, "tokens": 20, "framing": framing}
    body = await side.request("r-s", path, stream=True, mock=mock)
    complete = await side.complete("r-s")
    assert complete.status_code == 200
    assert complete.body is None
    assert complete.headers["content-type"] == "text/event-stream"
    assert "transfer-encoding" not in complete.headers
    streamed = "".join(side.chunks("r-s"))
    assert streamed.encode() == await direct(up, path, body)
    assert "\ufffd" not in streamed


async def test_chunks_are_sent_as_soon_as_read_and_split_characters_stay_whole(
    connected: tuple[RelaySide, FakeUpstream],
) -> None:
    side, up = connected
    await side.request("r-x", CHAT, stream=True, mock={"stepped": True, "split_utf8": True})
    await up.wait_requests(1, path=CHAT)

    async def next_chunk(count: int) -> str:
        async with asyncio.timeout(5):
            while len(side.chunks("r-x")) < count:
                await side.wait_for(ResponseChunk)
        return side.chunks("r-x")[count - 1]

    up.release()  # the role chunk
    first = await next_chunk(1)
    assert first.startswith("data: ") and first.endswith("\n\n")
    up.release()  # the first token, cut inside the euro sign's three bytes
    head = await next_chunk(2)
    assert head.endswith(" t0") and "\ufffd" not in head
    up.release()  # the rest of that character and event
    tail = await next_chunk(3)
    assert tail.startswith("€")
    up.release(100)
    assert (await side.complete("r-x")).status_code == 200


async def test_cancel_aborts_exactly_that_backend_request(
    connected: tuple[RelaySide, FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelrelay.worker")
    side, up = connected
    for rid in ("r-a", "r-b"):
        await side.request(rid, CHAT, stream=True, mock={"stepped": True}, extra={"user": rid})
    seen = {r.json()["user"]: r for r in await up.wait_requests(2, path=CHAT)}
    await side.send(Cancel(request_id="r-a", reason="client_disconnect"))
    await asyncio.wait_for(seen["r-a"].disconnected.wait(), 5)
    up.release(100)
    assert (await side.complete("r-b")).status_code == 200
    assert seen["r-b"].finished.is_set() and not seen["r-b"].disconnected.is_set()
    assert not seen["r-a"].finished.is_set()
    assert not any(isinstance(m, ResponseComplete) and m.request_id == "r-a" for m in side.received)
    assert "cancelled request r-a (client_disconnect)" in caplog.text


@pytest.mark.parametrize("reason", ["stream_limit", "slow_client", "a_reason_from_a_newer_server"])
async def test_any_cancel_reason_aborts_that_backend_request_and_is_logged(
    connected: tuple[RelaySide, FakeUpstream], caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    caplog.set_level(logging.INFO, logger="modelrelay.worker")
    side, up = connected
    await side.request("r-c", CHAT, stream=True, mock={"stepped": True})
    (seen,) = await up.wait_requests(1, path=CHAT)
    await side.send(Cancel(request_id="r-c", reason=reason))
    await asyncio.wait_for(seen.disconnected.wait(), 5)
    assert (await side.ping(1)).current_load == 0
    assert not any(isinstance(m, ResponseComplete) for m in side.received)
    assert f"cancelled request r-c ({reason})" in caplog.text


async def test_pong_reports_live_load_and_echoes_the_timestamp(
    connected: tuple[RelaySide, FakeUpstream],
) -> None:
    side, up = connected
    assert (await side.ping(1)).current_load == 0
    await side.request("r-1", CHAT, stream=True, mock={"stepped": True})
    await side.request("r-2", CHAT, stream=True, mock={"stepped": True})
    await up.wait_requests(2, path=CHAT)
    assert (await side.ping(2)).current_load == 2  # answered while both stream
    await side.send(Cancel(request_id="r-1", reason="timeout"))
    assert (await side.ping(3)).current_load == 1
    up.release(100)
    await side.complete("r-2")
    assert (await side.ping(4)) == Pong(current_load=0, timestamp_unix_ms=4)


@pytest.mark.parametrize(
    ("path", "stream"),
    [(p, s) for p in (CHAT, RESPONSES, MESSAGES) for s in (False, True)],
)
async def test_token_counts_are_read_from_every_api(
    connected: tuple[RelaySide, FakeUpstream], path: str, stream: bool
) -> None:
    side, _ = connected
    await side.request("r-t", path, stream=stream, mock={"tokens": 3, "prompt_tokens": 11})
    complete = await side.complete("r-t")
    assert complete.status_code == 200
    counts = complete.token_counts
    assert counts is not None and counts.cached_tokens in (None, 0)
    assert (counts.prompt_tokens, counts.completion_tokens, counts.total_tokens) == (11, 3, 14)


async def test_a_stream_that_declined_usage_is_still_charged_without_seeing_it(
    connected: tuple[RelaySide, FakeUpstream],
) -> None:
    side, _ = connected
    extra = {"stream_options": {"include_usage": False}}
    await side.request("r-n", CHAT, stream=True, extra=extra)
    complete = await side.complete("r-n")
    assert complete.status_code == 200 and complete.token_counts == TokenCounts(7, 5, 12)
    assert '"usage"' not in "".join(side.chunks("r-n"))


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_error_statuses_pass_through_with_their_body(
    connected: tuple[RelaySide, FakeUpstream], stream: bool
) -> None:
    side, _ = connected
    error = {"error": {"message": "context too long", "type": "invalid_request_error"}}
    await side.request("r-e", CHAT, stream=stream, mock={"status": 400, "error_body": error})
    complete = await side.complete("r-e")
    assert complete.status_code == 400
    assert complete.body is not None and json.loads(complete.body) == error
    assert side.chunks("r-e") == []


@pytest.mark.parametrize(
    ("path", "envelope"),
    [
        (CHAT, lambda d: d["error"]["type"] == "server_error" and d["error"]["message"]),
        (RESPONSES, lambda d: d["error"]["code"] == "worker_error"),
        (MESSAGES, lambda d: d["type"] == "error" and d["error"]["type"] == "api_error"),
    ],
)
async def test_an_unreachable_backend_is_a_502_for_a_relay_without_backend_health(
    caplog: pytest.LogCaptureFixture, path: str, envelope: Callable[[Any], Any]
) -> None:
    # (Relays that accept backend_health get the request back to requeue it instead:
    # tests/worker/test_backend_health.py.)
    caplog.set_level(logging.WARNING, logger="modelrelay.worker")
    backend = f"http://127.0.0.1:{unused_port()}"
    cfg = config_for(backend, "--models", "m", "--max-concurrent", "2")
    async with FakeRelay(features=[FLOW_CONTROL]) as relay, running(cfg(relay.url)):
        side = await relay.registered()
        await side.request("r-1", path)
        await side.request("r-2", path, stream=True)
        for rid in ("r-1", "r-2"):
            complete = await side.complete(rid)
            assert complete.status_code == 502
            assert complete.body is not None and envelope(json.loads(complete.body))
        assert (await side.ping(7)).current_load == 0
        assert len(relay.sides) == 1 and not side.closed.is_set()
    assert "backend did not take request r-1" in caplog.text


@pytest.mark.parametrize(("path", "marker"), [(CHAT, 'data: {"error"'), (MESSAGES, "event: error")])
async def test_a_stream_that_breaks_ends_with_an_error_event(
    connected: tuple[RelaySide, FakeUpstream], path: str, marker: str
) -> None:
    side, _ = connected
    await side.request("r-b", path, stream=True, mock={"break_after": 2, "tokens": 10})
    complete = await side.complete("r-b")
    assert complete.status_code == 502
    chunks = side.chunks("r-b")
    assert len(chunks) >= 2
    assert chunks[-1].startswith(marker) and chunks[-1].endswith("\n\n")


async def test_a_backend_that_stops_answering_times_out_into_a_502(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    cfg = config(relay.url, upstream.url, "--backend-read-timeout", "0.2")
    async with running(cfg):
        side = await relay.registered()
        await side.request("r-slow", CHAT, mock={"first_byte_delay": 30})
        complete = await side.complete("r-slow")
        assert complete.status_code == 502
        assert complete.body is not None and "ReadTimeout" in complete.body
        await asyncio.wait_for(upstream.requests_to(CHAT)[0].disconnected.wait(), 5)


async def test_a_response_too_large_for_one_message_is_a_502(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url, "--max-message-bytes", "4096")):
        side = await relay.registered()
        await side.request("r-big", CHAT, mock={"tokens": 1000})
        complete = await side.complete("r-big")
        assert complete.status_code == 502
        assert complete.body is not None and "too large" in complete.body
        await side.request("r-small", CHAT, mock={"tokens": 2})
        assert (await side.complete("r-small")).status_code == 200


# --------------------------------------------------------------------------- flow control

#: A stream far larger than every socket buffer between the upstream and the worker.
FLOOD = {"stepped": True, "tokens": 512, "padding": 64 * 1024}
#: What a paused request may still forward: the one read already under way
#: (httpcore reads 64 KiB at a time), never the rest of the stream.
READ_AHEAD = 2 * 64 * 1024


def relayed(side: RelaySide, rid: str) -> int:
    return sum(len(chunk) for chunk in side.chunks(rid))


async def settled(value: Callable[[], int], timeout: float = 5.0) -> int:
    """``value()`` once it stopped changing: the same at ten looks 30 ms apart.

    300 ms outlasts a delayed TCP acknowledgement (Linux waits at most 200 ms), so a
    window update still on its way cannot move the value afterwards.
    """
    async with asyncio.timeout(timeout):
        last, same = value(), 0
        while same < 10:
            await asyncio.sleep(0.03)
            now = value()
            same, last = (same + 1 if now == last else 0), now
        return last


async def paused_mid_flood(
    side: RelaySide, up: FakeUpstream, rid: str
) -> tuple[str, Recorded, int]:
    """Start a big stream, pause it after two events, let the upstream write all it can.

    Returns the request body, the upstream's record once its writes stopped, and how
    many characters had been relayed when the pause took effect.
    """
    body = await side.request(rid, CHAT, stream=True, mock=FLOOD)
    seen = (await up.wait_requests(1, path=CHAT))[-1]
    up.release(2)
    async with asyncio.timeout(5):
        while len(side.chunks(rid)) < 2:
            await side.wait_for(ResponseChunk)
    await side.send(Pause(request_id=rid))
    await side.ping(100)  # frames are handled in order: the pause is in effect
    at_pause = relayed(side, rid)
    up.release(100_000)  # every write the stream has, and then some
    await settled(lambda: seen.bytes_written)
    return body, seen, at_pause


@pytest.fixture
async def flow_upstream() -> AsyncIterator[FakeUpstream]:
    # A small fixed send buffer keeps what the kernel queues for a stalled reader
    # predictable (self-tuning can reach megabytes on loopback).
    async with FakeUpstream(send_buffer=256 * 1024) as up:
        yield up


async def test_pause_stops_reading_that_backend_response_until_resume(
    relay: FakeRelay, flow_upstream: FakeUpstream
) -> None:
    up = flow_upstream
    async with running(config(relay.url, up.url)):
        side = await relay.registered()
        assert side.register is not None and FLOW_CONTROL in side.register.features
        body, seen, at_pause = await paused_mid_flood(side, up, "r-p")
        held = seen.bytes_written
        assert relayed(side, "r-p") - at_pause <= READ_AHEAD
        # Another request on the same connection is not held up...
        await side.request("r-other", CHAT, stream=True, mock={"tokens": 50})
        assert (await side.complete("r-other")).status_code == 200
        # ...and meanwhile the paused one read nothing, so its backend wrote nothing.
        assert seen.bytes_written == held
        paused_at = relayed(side, "r-p")
        await side.ping(101)
        assert relayed(side, "r-p") == paused_at
        assert not seen.finished.is_set()

        await side.send(Resume(request_id="r-p"))
        complete = await side.complete("r-p", timeout=30)
        assert complete.status_code == 200
        assert complete.token_counts == TokenCounts(7, 512, 519)
        total = seen.bytes_written
        assert held < total // 4  # the backend really was held back
        assert "".join(side.chunks("r-p")).encode() == await direct(up, CHAT, body)


async def test_a_cancel_while_paused_aborts_the_backend_request_at_once(
    relay: FakeRelay, flow_upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, flow_upstream.url)):
        side = await relay.registered()
        _, seen, _ = await paused_mid_flood(side, flow_upstream, "r-p")
        await side.send(Cancel(request_id="r-p", reason="slow_client"))
        await asyncio.wait_for(seen.disconnected.wait(), 5)
        assert (await side.ping(1)).current_load == 0
        assert not any(isinstance(m, ResponseComplete) for m in side.received)


async def test_pause_and_resume_for_requests_not_in_flight_are_ignored(
    connected: tuple[RelaySide, FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="modelrelay.worker")
    side, _ = connected
    await side.request("r-done", CHAT, stream=True)
    assert (await side.complete("r-done")).status_code == 200
    for rid in ("r-unknown", "r-done"):
        await side.send(Pause(request_id=rid))
        await side.send(Resume(request_id=rid))
    assert (await side.ping(1)).current_load == 0
    await side.request("r-next", CHAT, stream=True)
    assert (await side.complete("r-next")).status_code == 200
    assert not side.closed.is_set()
    assert "pause for r-unknown ignored: not in flight here" in caplog.text
    assert "resume for r-unknown ignored: not in flight here" in caplog.text


async def test_pause_is_ignored_when_the_relay_did_not_accept_flow_control(
    upstream: FakeUpstream,
) -> None:
    async with FakeRelay(features=[]) as relay, running(config(relay.url, upstream.url)):
        side = await relay.registered()
        await side.request("r-p", CHAT, stream=True, mock={"stepped": True})
        await upstream.wait_requests(1, path=CHAT)
        await side.send(Pause(request_id="r-p"))
        await side.ping(1)
        upstream.release(100)
        assert (await side.complete("r-p")).status_code == 200  # no resume needed


# --------------------------------------------------------------------------- models


async def test_models_refresh_is_always_answered(connected: tuple[RelaySide, FakeUpstream]) -> None:
    side, _ = connected
    await side.send(ModelsRefresh(reason="operator"))
    update = await side.wait_for(ModelsUpdate)
    assert update == ModelsUpdate(models=["mock-model"], current_load=0)


async def test_periodic_refresh_reports_only_changes(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url, "--model-refresh-secs", "0.02")):
        side = await relay.registered()
        seen = len(upstream.requests_to("/v1/models"))
        await upstream.wait_requests(seen + 3, path="/v1/models")
        assert not any(isinstance(m, ModelsUpdate) for m in side.received)
        upstream.models = ["mock-model", "new-model"]
        update = await side.wait_for(ModelsUpdate)
        assert update.models == ["mock-model", "new-model"]
        seen = len(upstream.requests_to("/v1/models"))
        await upstream.wait_requests(seen + 3, path="/v1/models")
        assert sum(isinstance(m, ModelsUpdate) for m in side.received) == 1


# --------------------------------------------------------------------------- connection


async def test_it_reconnects_after_a_server_restart_close(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url)):
        first = await relay.registered(0)
        await first.ws.close(1012, "server restarting")
        second = await relay.registered(1)
        assert second.register == first.register
        assert (await second.ping(5)).current_load == 0


async def test_it_reconnects_after_the_connection_is_lost(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url)):
        first = await relay.registered(0)
        await side_request_in_flight(first, upstream)
        first.ws.transport.abort()
        second = await relay.registered(1)
        assert second.register is not None and second.register.current_load == 0
        # The orphaned backend request was aborted with the connection.
        await asyncio.wait_for(upstream.requests_to(CHAT)[0].disconnected.wait(), 5)


async def side_request_in_flight(side: RelaySide, up: FakeUpstream) -> None:
    await side.request("r-orphan", CHAT, stream=True, mock={"stepped": True})
    await up.wait_requests(1, path=CHAT)


def test_the_silence_limit_is_three_server_pings_within_bounds() -> None:
    assert silence_limit(0, 15) == 45
    assert silence_limit(0, 0.05) == MIN_SILENCE_SECS  # never a hair trigger by default
    assert silence_limit(0, 1e300) == MAX_SILENCE_SECS
    assert silence_limit(0.3, 0.05) == 0.3  # --server-silence-secs wins
    assert silence_limit(120, 15) == 120
    # No usable ping period announced (older servers): never.
    for period in (None, 0.0, -1.0, float("nan"), float("inf")):
        assert silence_limit(0, period) is None
        assert silence_limit(0.3, period) is None


async def test_it_reconnects_when_the_server_goes_silent(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelrelay.worker")
    # This relay announces pings every 50 ms and then sends nothing at all, while its
    # TCP connection stays open and its WebSocket library answers pings and closes.
    async with (
        FakeRelay(heartbeat=0.05) as relay,
        running(config(relay.url, upstream.url, "--server-silence-secs", "0.3")),
    ):
        first = await relay.registered(0)
        await side_request_in_flight(first, upstream)
        second = await relay.registered(1)
        assert second.register is not None and second.register.current_load == 0
        assert first.closed.is_set() and first.ws.close_code == 1001
        # The request in flight was aborted with the connection, as on any loss.
        await asyncio.wait_for(upstream.requests_to(CHAT)[0].disconnected.wait(), 5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no message from the proxy" in w and "pings every 0.05s" in w for w in warnings)


async def test_server_pings_keep_a_quiet_connection_open(upstream: FakeUpstream) -> None:
    async with (
        FakeRelay(heartbeat=0.05) as relay,
        running(config(relay.url, upstream.url, "--server-silence-secs", "0.8")),
    ):
        side = await relay.registered()
        loop = asyncio.get_running_loop()
        until, stamp = loop.time() + 1.2, 0  # longer than the silence limit
        while loop.time() < until:
            stamp += 1
            await side.ping(stamp)
            await asyncio.sleep(0.05)
        assert len(relay.sides) == 1 and not side.closed.is_set()


async def test_a_silent_server_that_announced_no_ping_period_is_not_dropped(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url, "--server-silence-secs", "0.05")):
        side = await relay.registered()
        await asyncio.sleep(0.3)  # six times the setting, which needs a period to apply
        assert (await side.ping(1)).current_load == 0
        assert len(relay.sides) == 1 and not side.closed.is_set()


async def test_a_policy_close_is_logged_clearly_and_retried_slowly(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelrelay.worker")
    async with (
        FakeRelay(refuse=(1008, "invalid worker secret")) as relay,
        running(config(relay.url, upstream.url)),
    ):
        await relay.wait_handshakes(2, timeout=5)
        gap = relay.handshakes[1] - relay.closes[0]
        assert gap >= 0.3  # --fatal-retry-secs 0.4 (minus jitter-free slack), not 0.01-0.05
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "invalid worker secret" in errors[0].getMessage()
    assert "refused" in errors[0].getMessage()


async def test_a_rejected_handshake_is_logged_and_retried_slowly(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelrelay.worker")
    async with FakeRelay(reject_status=403) as relay, running(config(relay.url, upstream.url)):
        await relay.wait_handshakes(2, timeout=5)
        assert relay.handshakes[1] - relay.handshakes[0] >= 0.3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "403" in errors[0]


async def test_frames_it_cannot_parse_are_ignored(
    connected: tuple[RelaySide, FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="modelrelay.worker")
    side, _ = connected
    for junk in ("not json", '{"type": "bogus"}', '{"type": "request"}', "[1, 2]", b"\xff\x00"):
        await side.ws.send(junk)
    assert (await side.ping(9)).current_load == 0
    await side.request("r-ok", CHAT)
    assert (await side.complete("r-ok")).status_code == 200
    assert caplog.text.count("cannot parse") == 5


# --------------------------------------------------------------------------- draining


async def test_graceful_shutdown_finishes_in_flight_work_then_exits_0(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url)) as task:
        side = await relay.registered()
        await side.request("r-1", CHAT, stream=True, mock={"stepped": True})
        await upstream.wait_requests(1, path=CHAT)
        await side.send(GracefulShutdown(reason="maintenance", drain_timeout_secs=30))
        await side.request("r-late", MESSAGES)
        assert await side.wait_for(Error) == draining_refusal("r-late")
        assert not side.closed.is_set()
        upstream.release(100)
        assert (await side.complete("r-1")).status_code == 200
        assert await asyncio.wait_for(task, 5) == 0
        assert side.closed.is_set()
    assert len(relay.sides) == 1  # it did not reconnect
    assert upstream.requests_to(MESSAGES) == []
    assert not any(
        isinstance(m, ResponseComplete) and m.request_id == "r-late" for m in side.received
    )


def draining_refusal(rid: str) -> Error:
    """The frame a shutting-down worker refuses ``rid`` with, so the relay requeues it."""
    return Error(request_id=rid, code=WORKER_DRAINING, message="worker is shutting down")


async def test_the_server_closing_a_drained_worker_counts_as_done(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    async with running(config(relay.url, upstream.url)) as task:
        side = await relay.registered()
        await side.send(GracefulShutdown(reason="maintenance", drain_timeout_secs=30))
        await side.ws.close(1000, "worker drained")
        assert await asyncio.wait_for(task, 5) == 0
    assert len(relay.sides) == 1


async def test_sigterm_drains_in_flight_work_and_exits_0(
    relay: FakeRelay, upstream: FakeUpstream
) -> None:
    argv = config_argv(relay.url, upstream.url)
    async with worker_process(*argv) as proc:
        side = await relay.registered(timeout=15)
        await side.request("r-1", CHAT, stream=True, mock={"stepped": True})
        await upstream.wait_requests(1, path=CHAT)
        proc.proc.send_signal(signal.SIGTERM)
        assert (await side.wait_for(ModelsUpdate)).models == []
        await side.request("r-late", CHAT)
        assert await side.wait_for(Error) == draining_refusal("r-late")
        upstream.release(100)
        complete = await side.complete("r-1")
        assert complete.status_code == 200
        assert await proc.wait() == 0
        assert "graceful shutdown" in proc.log
        assert "refusing request r-late: the worker is shutting down" in proc.log
    assert len(relay.sides) == 1
    assert len(upstream.requests_to(CHAT)) == 1
    assert not any(
        isinstance(m, ResponseComplete) and m.request_id == "r-late" for m in side.received
    )


async def test_a_second_sigterm_exits_at_once(relay: FakeRelay, upstream: FakeUpstream) -> None:
    async with worker_process(*config_argv(relay.url, upstream.url)) as proc:
        side = await relay.registered(timeout=15)
        await side.request("r-1", CHAT, stream=True, mock={"hang": True})
        (seen,) = await upstream.wait_requests(1, path=CHAT)
        proc.proc.send_signal(signal.SIGTERM)
        await side.wait_for(ModelsUpdate)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait() != 0
        await asyncio.wait_for(seen.disconnected.wait(), 5)


async def test_sigterm_while_not_connected_exits_0(upstream: FakeUpstream) -> None:
    argv = config_argv(f"http://127.0.0.1:{unused_port()}", upstream.url)
    async with worker_process(*argv) as proc:
        await proc.wait_log("cannot reach the proxy", timeout=15)
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


def config_argv(relay_url: str, backend_url: str) -> list[str]:
    return [
        "--proxy-url",
        relay_url,
        "--worker-secret",
        SECRET,
        "--backend-url",
        backend_url,
        "--log-level",
        "debug",
        *FAST,
    ]
