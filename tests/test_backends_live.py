"""Behind real backends, end to end: a live server, real ``worker.py`` processes and the
fake upstream (llama-server's and OpenAI's stream shapes).

- a worker whose backend is down leaves rotation, its requests are served by the
  other worker, and it comes back when its backend does;
- token counting is answered while every generation slot of the model is busy;
- a stream is charged the same tokens whether or not its client asked for usage, and
  the client that did not ask receives no usage chunk.

One server for the module; each test has its own model and workers.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live import LiveServer, live_server
from tests.test_e2e import WorkerProcess, poll
from tests.upstream import ThreadedUpstream, unused_port, upstream_in_thread

pytestmark = pytest.mark.live

ADMIN = {"authorization": "Bearer admin-token"}
JSON = {"content-type": "application/json"}
CHAT, COUNT = "/v1/chat/completions", "/v1/messages/count_tokens"
PROBE = ("--backend-probe-min-secs", "0.05", "--backend-probe-max-secs", "0.2")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    env = {
        "MODELRELAY_ADMIN_TOKEN": "admin-token",
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "REQUEST_LOG_FLUSH_SECS": "0.05",
        "SYNC_SECS": "0.2",
    }
    with live_server(tmp_path_factory.mktemp("backends"), **env) as live:
        yield live


@pytest.fixture(scope="module")
def key(server: LiveServer) -> dict[str, str]:
    made = httpx.post(server.url + "/admin/keys", headers=ADMIN, json={"name": "backends"})
    return {**JSON, "authorization": f"Bearer {made.json()['secret']}"}


def worker(server: LiveServer, backend: str, name: str, model: str, slots: int) -> WorkerProcess:
    flags = ("--worker-name", name, "--models", model, "--max-concurrent", str(slots))
    return WorkerProcess(server, backend, *flags, *PROBE)


def listed(server: LiveServer, name: str) -> dict[str, Any]:
    rows = httpx.get(server.url + "/admin/workers", headers=ADMIN, timeout=5).json()
    found = [row for row in rows if row["name"] == name]
    return found[0] if found else {}


def chat(model: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]} | (
        extra
    )


# --------------------------------------------------------------------------- dead backend


def test_a_dead_backend_leaves_rotation_and_comes_back(
    server: LiveServer, key: dict[str, str]
) -> None:
    model, port = "hb-model", unused_port()
    with upstream_in_thread() as alive:
        ok = worker(server, alive.url, "ok-box", model, 2)
        dead = worker(server, f"http://127.0.0.1:{port}", "dead-box", model, 2)
        try:
            poll(lambda: listed(server, "dead-box").get("models") == [model], what="both up")
            poll(lambda: listed(server, "ok-box").get("models") == [model], what="both up")
            with httpx.Client(base_url=server.url, headers=key, timeout=15) as client:
                statuses = [
                    client.post(CHAT, json=chat(model, stream=i % 2 == 1)).status_code
                    for i in range(50)
                ]
                assert statuses == [200] * 50
                assert len(alive.requests_to(CHAT)) == 50
                row = listed(server, "dead-box")
                assert row["backend"] == "unreachable" and row["models"] == []
                assert "ConnectError" in row["backend_error"]
                metrics = client.get("/metrics").text
                up = f'worker="dead-box",worker_id="{row["id"]}"}} 0.0'
                assert up in metrics and 'worker="ok-box"' in metrics

                with upstream_in_thread(port) as revived:  # its backend is back
                    poll(lambda: listed(server, "dead-box").get("backend") == "ok", what="back")
                    assert listed(server, "dead-box")["models"] == [model]
                    for _ in range(6):
                        assert client.post(CHAT, json=chat(model)).status_code == 200
                    assert revived.requests_to(CHAT)  # in rotation again
            assert "withdrawing the models until it answers" in dead.log
            assert "answers again" in dead.log
        finally:
            ok.stop()
            dead.stop()


# --------------------------------------------------------------------------- count_tokens


def test_token_counting_is_answered_while_every_generation_slot_is_busy(
    server: LiveServer, key: dict[str, str]
) -> None:
    model = "ct-model"
    with upstream_in_thread() as up:
        box = worker(server, up.url, "ct-box", model, 2)
        try:
            poll(lambda: listed(server, "ct-box").get("models") == [model], what="registered")
            held: list[int] = []

            def hold_a_slot() -> None:
                body = chat(model, stream=True, mock={"stepped": True})
                with httpx.stream("POST", server.url + CHAT, json=body, headers=key) as r:
                    held.append(r.status_code)
                    r.read()

            streams = [threading.Thread(target=hold_a_slot) for _ in range(2)]
            for thread in streams:
                thread.start()
            generating = up.wait_requests(2, CHAT)
            poll(lambda: listed(server, "ct-box").get("load") == 2, what="both slots busy")
            counted = httpx.post(
                server.url + COUNT,
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                headers=key,
                timeout=5,
            )
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
            # Answered while both generation slots were still held.
            assert not any(r.finished.is_set() for r in generating)
            assert listed(server, "ct-box")["load"] == 2
            up.release(1000)
            for thread in streams:
                thread.join(15)
            assert held == [200, 200]
        finally:
            box.stop()


# --------------------------------------------------------------------------- usage


def request_log(server: LiveServer, model: str) -> list[tuple[Any, ...]]:
    url = server.env["DATABASE_URL"]
    sql = (
        "SELECT streamed, prompt_tokens, completion_tokens, tokens_estimated "
        "FROM workers_app_requestlog WHERE model = %s ORDER BY id"
    )
    if url.startswith("sqlite:///"):
        with sqlite3.connect(Path(url.removeprefix("sqlite:///"))) as db:
            return [tuple(r) for r in db.execute(sql.replace("%s", "?"), (model,))]
    import psycopg

    with psycopg.connect(url) as db:
        return [tuple(r) for r in db.execute(sql, (model,))]


def spent(server: LiveServer) -> tuple[int, int, int, int]:
    """The key's tokens as budgets see them (today, this month) and as its usage
    columns hold them (prompt, completion)."""
    stats = httpx.get(server.url + "/admin/stats", headers=ADMIN).json()
    rows = [k for k in stats["keys"] if k["name"] == "backends"]  # (listed once used)
    today, month = (rows[0]["tokens_today"], rows[0]["tokens_month"]) if rows else (0, 0)
    (usage,) = httpx.get(server.url + "/admin/keys", headers=ADMIN).json()
    return today, month, usage["prompt_tokens"], usage["completion_tokens"]


def tokens_metric(server: LiveServer, model: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("modelrelay_tokens_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_streams_are_charged_alike_with_or_without_include_usage(
    server: LiveServer, key: dict[str, str]
) -> None:
    model = "billing-model"
    upstream = ThreadedUpstream(stream_usage="openai", tokens=9, prompt_tokens=4).start()
    box = worker(server, upstream.url, "billing-box", model, 2)
    try:
        poll(lambda: listed(server, "billing-box").get("models") == [model], what="registered")
        before = spent(server)
        plain = chat(model, stream=True)
        relayed = httpx.post(server.url + CHAT, json=plain, headers=key, timeout=10).content
        direct = httpx.post(upstream.url + CHAT, json=plain, timeout=10).content
        assert relayed == direct and b"usage" not in relayed  # no chunk it did not ask for
        poll(lambda: len(request_log(server, model)) == 1, what="the request log row")
        poll(lambda: spent(server)[3] != before[3], what="the key's usage columns")
        after_plain = spent(server)
        metric_plain = tokens_metric(server, model)

        asked = chat(model, stream=True, stream_options={"include_usage": True})
        with_usage = httpx.post(server.url + CHAT, json=asked, headers=key, timeout=10).content
        assert b'"usage":{"prompt_tokens":4' in with_usage
        poll(lambda: len(request_log(server, model)) == 2, what="the request log row")
        poll(lambda: spent(server)[3] != after_plain[3], what="the key's usage columns")
        after_asked = spent(server)

        assert request_log(server, model) == [(True, 4, 9, False), (True, 4, 9, False)]
        plain_cost = [a - b for a, b in zip(after_plain, before, strict=True)]
        asked_cost = [a - b for a, b in zip(after_asked, after_plain, strict=True)]
        assert plain_cost == asked_cost == [13, 13, 4, 9]
        assert metric_plain == 13 and tokens_metric(server, model) == 26
    finally:
        box.stop()
        upstream.stop()
