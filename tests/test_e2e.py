"""End to end: a live server (``manage.py serve``), the real ``worker.py`` process and
the fake upstream, driven by httpx and the official ``openai`` and ``anthropic`` SDKs.

Everything runs on 127.0.0.1. The upstream runs on its own loop in a thread so these
tests can stay synchronous, like the SDKs they exercise.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live import ROOT, LiveServer, live_server
from tests.upstream import (
    Recorded,
    ThreadedUpstream,
    expected_text,
    unused_port,
    upstream_in_thread,
)

pytestmark = pytest.mark.live

MODEL = "mock-model"
#: What every client library sends with a JSON body (the relay requires it).
JSON = {"content-type": "application/json"}
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
FAST = [
    "--backoff-min-secs",
    "0.05",
    "--backoff-max-secs",
    "0.2",
    "--fatal-retry-secs",
    "1",
    "--log-level",
    "debug",
]


class WorkerProcess:
    """The real ``worker.py``, its log collected line by line."""

    def __init__(
        self, server: LiveServer, backend_url: str, *flags: str, env: dict[str, str] | None = None
    ) -> None:
        argv = [
            sys.executable,
            "worker.py",
            "--proxy-url",
            server.url,
            "--worker-secret",
            server.secret,
            "--backend-url",
            backend_url,
            "--worker-name",
            "e2e-box",
            *FAST,
            *flags,
        ]
        self.process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> None:
        with self._changed:
            found = self._changed.wait_for(lambda: needle in self.log, timeout)
        assert found, f"{needle!r} not in the worker log:\n{self.log}"

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._pump.join(5)


@contextmanager
def running_worker(
    server: LiveServer, backend_url: str, *flags: str, env: dict[str, str] | None = None
) -> Iterator[WorkerProcess]:
    """The real worker.py (``env``: its whole environment; None: this process's)."""
    worker = WorkerProcess(server, backend_url, *flags, env=env)
    try:
        yield worker
    finally:
        worker.stop()


def poll(check: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Re-check ``check()`` every 20 ms until it is true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def workers_connected(server: LiveServer) -> int:
    try:
        return int(httpx.get(server.url + "/health", timeout=2).json()["workers_connected"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def routable(server: LiveServer, model: str = MODEL) -> bool:
    models = httpx.get(server.url + "/v1/models", timeout=2).json()["data"]
    return any(m["id"] == model for m in models)


def body_for(path: str, *, stream: bool = False, **mock: Any) -> bytes:
    document: dict[str, Any] = {"model": MODEL, "stream": stream}
    if path == MESSAGES:
        document.update(max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    elif path == CHAT:
        document["messages"] = [{"role": "user", "content": "hi"}]
    else:
        document["input"] = "hi"
    if mock:
        document["mock"] = mock
    return json.dumps(document).encode()


def direct(up: ThreadedUpstream, path: str, body: bytes) -> httpx.Response:
    return httpx.post(up.url + path, content=body, timeout=10)


def token_metrics(server: LiveServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^modelrelay_tokens_total\{([^}]*)\} (\S+)$", text, re.M):
        parsed = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if parsed.get("model") == MODEL:
            counts[parsed["kind"]] = float(value)
    return counts


@dataclass
class Stack:
    server: LiveServer
    upstream: ThreadedUpstream
    worker: WorkerProcess
    client: httpx.Client


@contextmanager
def serving(server: LiveServer, upstream: ThreadedUpstream) -> Iterator[Stack]:
    with (
        running_worker(server, upstream.url) as worker,
        httpx.Client(base_url=server.url, timeout=15, headers=JSON) as client,
    ):
        poll(lambda: routable(server), what="the worker to register")
        yield Stack(server, upstream, worker, client)


@pytest.fixture
def upstream() -> Iterator[ThreadedUpstream]:
    with upstream_in_thread(total_slots=4) as up:
        yield up


@pytest.fixture
def stack(relay_server: LiveServer, upstream: ThreadedUpstream) -> Iterator[Stack]:
    """Server, worker and upstream of one test, with ``mock-model`` routable."""
    with serving(relay_server, upstream) as own:
        yield own


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests that leave it as they found it (saves a server start each)."""
    with (
        upstream_in_thread(total_slots=4) as up,
        live_server(tmp_path_factory.mktemp("e2e") / "server") as server,
        serving(server, up) as stack,
    ):
        yield stack


# --------------------------------------------------------------------------- httpx


def test_answers_match_the_backend_on_every_endpoint(shared: Stack) -> None:
    for path in (CHAT, RESPONSES, MESSAGES):
        body = body_for(path)
        relayed = shared.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
        assert relayed.status_code == 200, relayed.text
        assert relayed.content == direct(shared.upstream, path, body).content
        assert relayed.headers["x-mock-upstream"] == "1"

        body = body_for(path, stream=True, tokens=30, split_utf8=True)
        with shared.client.stream("POST", path, content=body) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            received = b"".join(streamed.iter_raw())
        assert received == direct(shared.upstream, path, body).content


def test_upstream_errors_keep_their_status_and_body(shared: Stack) -> None:
    for path, stream, status in [(CHAT, False, 400), (CHAT, True, 503), (MESSAGES, True, 429)]:
        error = {"error": {"message": f"upstream said {status}", "type": "invalid_request_error"}}
        response = shared.client.post(
            path, content=body_for(path, stream=stream, status=status, error_body=error)
        )
        assert response.status_code == status
        assert response.json() == error


def test_a_client_disconnect_mid_stream_reaches_the_backend(shared: Stack) -> None:
    before = len(shared.upstream.upstream.requests_to(CHAT))
    body = body_for(CHAT, stream=True, tokens=500, token_delay=0.02)
    with shared.client.stream("POST", CHAT, content=body) as streamed:
        first = next(streamed.iter_raw())
        assert first.startswith(b"data: ")
    seen = shared.upstream.wait_requests(before + 1, path=CHAT)[-1]
    shared.upstream.wait_event(seen.disconnected, timeout=10)
    assert not seen.finished.is_set()
    shared.worker.wait_for_log("(client_disconnect)")


def test_token_counts_reach_the_relay(shared: Stack) -> None:
    before = token_metrics(shared.server)
    chat = body_for(CHAT, tokens=4, prompt_tokens=9)
    assert shared.client.post(CHAT, content=chat).status_code == 200
    body = body_for(MESSAGES, stream=True, tokens=3, prompt_tokens=11)
    with shared.client.stream("POST", MESSAGES, content=body) as streamed:
        streamed.read()
    shared.worker.wait_for_log("tokens prompt=9 completion=4 total=13")
    shared.worker.wait_for_log("tokens prompt=11 completion=3 total=14")
    expected = {
        "prompt": before.get("prompt", 0) + 20,
        "completion": before.get("completion", 0) + 7,
    }
    poll(lambda: token_metrics(shared.server) == expected, what="token counters in /metrics")


# --------------------------------------------------------------------------- lifecycle


def test_sigterm_lets_the_in_flight_request_finish_and_the_worker_exits_0(stack: Stack) -> None:
    body = body_for(CHAT, stream=True, tokens=25, token_delay=0.02)
    with stack.client.stream("POST", CHAT, content=body) as streamed:
        chunks = streamed.iter_raw()
        received = next(chunks)
        stack.worker.signal(signal.SIGTERM)
        received += b"".join(chunks)
    assert received == direct(stack.upstream, CHAT, body).content
    assert stack.worker.wait(10) == 0
    assert "graceful shutdown" in stack.worker.log
    poll(lambda: workers_connected(stack.server) == 0, what="the worker to leave")


def test_the_worker_reregisters_after_the_server_restarts(stack: Stack) -> None:
    stack.server.kill()
    # It keeps retrying (with backoff) while nothing listens.
    stack.worker.wait_for_log("cannot reach the proxy")
    stack.server.start()
    poll(lambda: workers_connected(stack.server) == 1, what="the worker to re-register")
    poll(lambda: routable(stack.server), what="the model to be routable again")
    response = httpx.post(stack.server.url + CHAT, content=body_for(CHAT), headers=JSON, timeout=10)
    assert response.status_code == 200
    assert stack.worker.log.count("registered as worker") == 2


def test_an_operator_drain_lets_the_request_finish_and_the_worker_exits_0(
    relay_server_factory: Any, upstream: ThreadedUpstream
) -> None:
    admin = {"authorization": "Bearer admin-token"}
    with (
        relay_server_factory(MODELRELAY_ADMIN_TOKEN="admin-token") as server,
        running_worker(server, upstream.url) as worker,
        httpx.Client(base_url=server.url, timeout=15, headers=JSON) as client,
    ):
        poll(lambda: routable(server), what="the worker to register")
        (listed,) = client.get("/admin/workers", headers=admin).json()
        body = body_for(CHAT, stream=True, tokens=25, token_delay=0.02)
        with client.stream("POST", CHAT, content=body) as streamed:
            chunks = streamed.iter_raw()
            received = next(chunks)
            drain = client.post(f"/admin/workers/{listed['id']}/drain", headers=admin, json={})
            assert drain.status_code == 202
            received += b"".join(chunks)
        assert received == direct(upstream, CHAT, body).content
        assert worker.wait(10) == 0
        assert "graceful shutdown requested by the proxy" in worker.log
        assert worker.log.count("connected to proxy") == 1  # it did not come back


def test_a_dead_backend_withdraws_the_worker_and_its_requests_wait_for_another(
    relay_server_factory: Any,
) -> None:
    backend = f"http://127.0.0.1:{unused_port()}"
    flags = ("--models", MODEL, "--max-concurrent", "2")
    with (
        relay_server_factory(QUEUE_TIMEOUT_SECS="0.5") as server,
        running_worker(server, backend, *flags) as worker,
    ):
        poll(lambda: routable(server), what="the worker to register")
        chat = httpx.post(server.url + CHAT, content=body_for(CHAT), headers=JSON, timeout=10)
        # Handed back, requeued, no other worker: the client's queue timeout, not a 502.
        assert chat.status_code == 504
        assert chat.json()["error"]["message"] == "Request timed out waiting for worker"
        messages = httpx.post(
            server.url + MESSAGES,
            content=body_for(MESSAGES, stream=True),
            headers=JSON,
            timeout=10,
        )
        assert messages.status_code == 504
        assert messages.json()["type"] == "error"
        assert workers_connected(server) == 1
        assert "withdrawing the models until it answers" in worker.log
        assert worker.process.poll() is None


# --------------------------------------------------------------------------- the end of a stream


@pytest.fixture(scope="module")
def ending(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose request log is written at once, for the tests that read it."""
    with (
        upstream_in_thread(total_slots=4) as up,
        live_server(
            tmp_path_factory.mktemp("ending") / "server", REQUEST_LOG_FLUSH_SECS="0.05"
        ) as server,
        serving(server, up) as stack,
    ):
        yield stack


def logged_rows(server: LiveServer) -> list[tuple[Any, ...]]:
    """(endpoint, status, outcome, cancel reason, prompt, completion tokens) of every
    request in the request log, oldest first."""
    url = server.env["DATABASE_URL"]
    sql = (
        "SELECT endpoint, status, outcome, cancel_reason, prompt_tokens, completion_tokens "
        "FROM workers_app_requestlog ORDER BY id"
    )
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
            return [tuple(r) for r in db.execute(sql)]
    import psycopg

    with psycopg.connect(url) as db:
        return [tuple(r) for r in db.execute(sql)]


def new_rows(server: LiveServer, before: int, count: int) -> list[tuple[Any, ...]]:
    poll(lambda: len(logged_rows(server)) >= before + count, what=f"{count} request log rows")
    return logged_rows(server)[before:]


def metric(server: LiveServer, name: str, **labels: str) -> float:
    """The sum of a metric's samples in /metrics with these labels (0 when none)."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    total = 0.0
    for found, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def read_until(server: LiveServer, path: str, body: bytes, end: bytes) -> socket.socket:
    """A raw HTTP/1.1 client that sent ``body`` and has read up to ``end`` (inclusive)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while end not in seen:
        data = sock.recv(65536)
        assert data, f"the stream ended before {end!r}: {seen!r}"
        seen += data
    return sock


def went(server: LiveServer, seen: Recorded, left: float) -> bool:
    """The backend request was cancelled, or the relay counts ``left`` streams whose
    client left after the end."""
    return (
        seen.disconnected.is_set()
        or metric(server, "modelrelay_streams_left_after_end_total") == left
    )


#: Each API's last event, as read to its end by a client that then hangs up.
LAST_EVENTS = [
    (CHAT, b"data: [DONE]\n\n"),
    (MESSAGES, b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
    (RESPONSES, b"event: response.completed\n"),
]


def test_a_client_that_hangs_up_after_the_last_event_is_logged_ok_and_charged(
    ending: Stack,
) -> None:
    server, up = ending.server, ending.upstream
    rows, tokens = len(logged_rows(server)), token_metrics(server)
    cancels = metric(server, "modelrelay_cancels_total")
    left = metric(server, "modelrelay_streams_left_after_end_total")
    for n, (path, last) in enumerate(LAST_EVENTS, start=1):
        arrived = len(up.requests_to(path))
        # The backend's body (so the worker's completion) ends only when released.
        body = body_for(path, stream=True, tokens=3, prompt_tokens=9, hold_end=True)
        sock = read_until(server, path, body, last)
        sock.close()
        (seen,) = up.wait_requests(arrived + 1, path=path)[arrived:]
        gone_or_left = functools.partial(went, server, seen, left + n)
        poll(gone_or_left, what="the relay to see the client go")
        assert not seen.disconnected.is_set(), f"{path}: the backend request was cancelled"
        up.release()
        up.wait_event(seen.finished)
    assert new_rows(server, rows, 3) == [(p, 200, "ok", "", 9, 3) for p, _ in LAST_EVENTS]
    expected = {
        "prompt": tokens.get("prompt", 0) + 27,
        "completion": tokens.get("completion", 0) + 9,
    }
    poll(lambda: token_metrics(server) == expected, what="the tokens in /metrics")
    assert metric(server, "modelrelay_cancels_total") == cancels


def test_a_client_that_hangs_up_mid_stream_still_cancels_the_backend(ending: Stack) -> None:
    server, up = ending.server, ending.upstream
    rows = len(logged_rows(server))
    left = metric(server, "modelrelay_streams_left_after_end_total")
    arrived = len(up.requests_to(CHAT))
    body = body_for(CHAT, stream=True, tokens=500, token_delay=0.02)
    read_until(server, CHAT, body, b"data: ").close()
    (seen,) = up.wait_requests(arrived + 1, path=CHAT)[arrived:]
    up.wait_event(seen.disconnected, timeout=10)
    assert not seen.finished.is_set()
    assert new_rows(server, rows, 1) == [(CHAT, 499, "cancelled", "client_disconnect", None, None)]
    assert metric(server, "modelrelay_streams_left_after_end_total") == left


def test_openai_sdk_streams_read_to_the_end_are_all_logged_ok_and_charged(ending: Stack) -> None:
    """The SDK closes the connection as soon as it reads [DONE]; here the worker's
    completion always comes after that, as it does now and then with a real backend."""
    server = ending.server
    rows = len(logged_rows(server))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    streams = 20
    for _ in range(streams):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"mock": {"tokens": 3, "end_delay": 0.2}},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
            expected_text(3)
        )
    assert new_rows(server, rows, streams) == [(CHAT, 200, "ok", "", 7, 3)] * streams


# --------------------------------------------------------------------------- SDKs


def test_the_openai_sdk_works_through_the_relay(shared: Stack) -> None:
    client = openai.OpenAI(base_url=shared.server.url + "/v1", api_key="sk-test", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    completion = client.chat.completions.create(model=MODEL, messages=messages)
    assert completion.choices[0].message.content == expected_text(5)
    assert completion.usage is not None and completion.usage.total_tokens == 12

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    parts, usage = [], None
    for chunk in stream:
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == expected_text(5)
    assert usage is not None and usage.completion_tokens == 5

    response = client.responses.create(model=MODEL, input="hi")
    assert response.output_text == expected_text(5)
    assert response.usage is not None and response.usage.output_tokens == 5

    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        expected_text(5)
    )


def test_the_anthropic_sdk_works_through_the_relay(shared: Stack) -> None:
    client = anthropic.Anthropic(base_url=shared.server.url, api_key="sk-ant-test", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=messages)
    assert message.content[0].type == "text" and message.content[0].text == expected_text(5)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 5)

    with client.messages.stream(model=MODEL, max_tokens=64, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected_text(5)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 5)


def test_the_sdks_raise_not_found_for_an_unknown_model(shared: Stack) -> None:
    oa = openai.OpenAI(base_url=shared.server.url + "/v1", api_key="sk-test", max_retries=0)
    with pytest.raises(openai.NotFoundError) as oa_error:
        oa.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert "no-such-model" in str(oa_error.value)
    an = anthropic.Anthropic(base_url=shared.server.url, api_key="sk-ant", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(
            model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )


def test_the_sdks_raise_rate_limit_errors_when_the_busy_worker_cannot_queue(
    relay_server_factory: Any, upstream: ThreadedUpstream
) -> None:
    with (
        relay_server_factory(MAX_QUEUE_LEN="0") as server,
        running_worker(server, upstream.url, "--max-concurrent", "1"),
    ):
        poll(lambda: routable(server), what="the worker to register")
        held: list[httpx.Response] = []
        blocker = threading.Thread(
            target=lambda: held.append(
                httpx.post(
                    server.url + CHAT,
                    content=body_for(CHAT, stepped=True),
                    headers=JSON,
                    timeout=30,
                )
            )
        )
        blocker.start()
        try:
            upstream.wait_requests(1, path=CHAT)  # the worker's only slot is taken
            oa = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            an = anthropic.Anthropic(base_url=server.url, api_key="sk-ant", max_retries=0)
            with pytest.raises(anthropic.RateLimitError):
                an.messages.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
                )
        finally:
            upstream.release()
            blocker.join(15)
        assert held and held[0].status_code == 200
