"""Batches end to end (SPEC §16): a live server (``manage.py serve``), the real
``worker.py`` and the fake upstream, driven by the official ``openai`` and ``anthropic``
SDKs; a server killed mid-batch; two server processes sharing one PostgreSQL database;
an upload refused before its body on a raw socket.

Timings are shrunk through the server's settings; every wait is on a condition.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import socket
import sqlite3
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any, Final

import anthropic
import httpx
import openai
import pytest

from tests.conftest import REDIS_URL, require_redis, require_service
from tests.live import LiveServer, _scratch_postgres_database, live_server
from tests.test_e2e import MODEL, poll, routable, running_worker
from tests.upstream import ThreadedUpstream, upstream_in_thread

pytestmark = pytest.mark.live

CHAT: Final = "/v1/chat/completions"
#: The engine's timings, shrunk: look for work often, let a dead process's claims lapse soon.
FAST = {"BATCH_POLL_SECS": "0.05", "BATCH_FLUSH_SECS": "0.05", "BATCH_CLAIM_SECS": "1"}


def lines(count: int, prefix: str = "req", **mock: Any) -> bytes:
    """An OpenAI batch input: each line's message is its custom_id (the upstream sees it)."""
    out = []
    for index in range(count):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{prefix}-{index}"}],
        }
        if mock:
            body["mock"] = mock
        out.append({"custom_id": f"{prefix}-{index}", "method": "POST", "url": CHAT, "body": body})
    return b"".join(json.dumps(line).encode() + b"\n" for line in out)


def asked(upstream: ThreadedUpstream) -> Counter[str]:
    """How often the upstream was asked for each line (by the line's custom_id)."""
    return Counter(
        json.loads(r.body)["messages"][0]["content"] for r in upstream.requests if r.path == CHAT
    )


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_status(client: openai.OpenAI, batch_id: str, *statuses: str, timeout: float = 30):
    found: dict[str, Any] = {}

    def check() -> bool:
        found["batch"] = client.batches.retrieve(batch_id)
        return found["batch"].status in statuses

    poll(check, timeout=timeout, what=f"batch {batch_id} to be {statuses}")
    return found["batch"]


def output_ids(client: openai.OpenAI, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line)["custom_id"] for line in text.splitlines()]


@pytest.fixture
def upstream():
    with upstream_in_thread(total_slots=4) as up:
        yield up


def test_the_openai_sdk_runs_a_batch_end_to_end(relay_server_factory, upstream):
    with (
        relay_server_factory(**FAST) as server,
        running_worker(server, upstream.url),
    ):
        poll(lambda: routable(server), what="the worker to register")
        client = openai_client(server)
        data = lines(12) + lines(1, prefix="refused", status=400)
        uploaded = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
        assert uploaded.bytes == len(data) and uploaded.purpose == "batch"
        assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"run": "e2e"},
        )
        assert batch.status == "validating" and batch.metadata == {"run": "e2e"}
        done = wait_status(client, batch.id, "completed", "failed")
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (13, 12)
        assert done.request_counts.failed == 1
        assert output_ids(client, done.output_file_id) == [f"req-{i}" for i in range(12)]
        (error,) = client.files.content(done.error_file_id).text.splitlines()
        assert json.loads(error)["response"]["status_code"] == 400
        first = json.loads(client.files.content(done.output_file_id).text.splitlines()[0])
        assert first["response"]["body"]["object"] == "chat.completion"
        assert asked(upstream) == Counter({f"req-{i}": 1 for i in range(12)} | {"refused-0": 1})
        assert [b.id for b in client.batches.list(limit=5).data] == [batch.id]
        assert client.files.delete(uploaded.id).deleted is True

        # Cancelled mid-run: lines the backend holds are aborted there.
        hung = client.files.create(
            file=("hung.jsonl", io.BytesIO(lines(6, prefix="hung", hang=True))), purpose="batch"
        )
        stuck = client.batches.create(input_file_id=hung.id, endpoint=CHAT, completion_window="24h")
        poll(lambda: sum(1 for r in upstream.requests if b"hung" in r.body) == 4)
        assert client.batches.cancel(stuck.id).status in ("cancelling", "cancelled")
        cancelled = wait_status(client, stuck.id, "cancelled")
        assert cancelled.request_counts is not None and cancelled.request_counts.failed == 6
        for seen in [r for r in upstream.requests if b"hung" in r.body]:
            upstream.wait_event(seen.disconnected, timeout=10)
        assert sum(1 for r in upstream.requests if b"hung" in r.body) == 4


def test_the_anthropic_sdk_runs_message_batches_end_to_end(relay_server_factory, upstream):
    with (
        relay_server_factory(**FAST) as server,
        running_worker(server, upstream.url),
    ):
        poll(lambda: routable(server), what="the worker to register")
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)

        def request(custom_id: str, **mock: Any) -> Any:
            params: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": 32,
                "messages": [{"role": "user", "content": custom_id}],
            }
            if mock:
                params["mock"] = mock
            return {"custom_id": custom_id, "params": params}

        batch = client.messages.batches.create(
            requests=[request(f"m-{i}") for i in range(5)] + [request("bad", status=400)]
        )
        assert batch.processing_status == "in_progress"
        poll(
            lambda: client.messages.batches.retrieve(batch.id).processing_status == "ended",
            timeout=30,
        )
        done = client.messages.batches.retrieve(batch.id)
        assert done.request_counts.succeeded == 5 and done.request_counts.errored == 1
        assert done.results_url is not None and done.results_url.startswith(server.url)
        results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
        assert sorted(results) == ["bad", *(f"m-{i}" for i in range(5))]
        assert results["m-0"].type == "succeeded"
        assert results["m-0"].message.content[0].type == "text"
        assert results["bad"].type == "errored"
        assert [b.id for b in client.messages.batches.list(limit=10).data] == [batch.id]

        held = client.messages.batches.create(
            requests=[request(f"h-{i}", hang=True) for i in range(6)]
        )
        poll(lambda: sum(1 for r in upstream.requests if b"h-" in r.body) == 4)
        canceling = client.messages.batches.cancel(held.id)
        assert canceling.processing_status in ("canceling", "ended")
        poll(
            lambda: client.messages.batches.retrieve(held.id).processing_status == "ended",
            timeout=30,
        )
        kinds = Counter(r.result.type for r in client.messages.batches.results(held.id))
        assert kinds == {"canceled": 6}


def test_a_server_killed_mid_batch_resumes_and_answers_each_custom_id_once(
    relay_server_factory,
):
    with (
        upstream_in_thread(total_slots=4, first_byte_delay=0.05) as upstream,
        relay_server_factory(**FAST) as server,
        running_worker(server, upstream.url),
    ):
        poll(lambda: routable(server), what="the worker to register")
        client = openai_client(server)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines(60))), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"
        )

        def progress() -> int:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts.completed if counts is not None else 0

        poll(lambda: progress() >= 8, timeout=30, what="some lines to be answered")
        server.kill()  # SIGKILL: no graceful anything, lines in flight and unwritten
        assert 8 <= sum(asked(upstream).values()) < 60
        server.start()  # same port and database; the worker reconnects by itself
        poll(lambda: routable(server), timeout=30, what="the worker to reconnect")
        done = wait_status(client, batch.id, "completed", timeout=60)
        assert done.request_counts is not None and done.request_counts.completed == 60
        ids = output_ids(client, done.output_file_id)
        assert sorted(ids) == sorted(f"req-{i}" for i in range(60))
        assert len(ids) == len(set(ids)) == 60  # each custom_id exactly once
        assert done.error_file_id is None
        # Lines in flight (or answered, not yet written) at the kill ran again, once.
        assert set(asked(upstream)) == set(ids)
        assert max(asked(upstream).values()) <= 2


def _finished_here(server: LiveServer) -> int:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    pattern = r'^modelrelay_batch_lines_finished_total\{outcome="succeeded"\} (\S+)$'
    found = re.search(pattern, text, re.M)
    return int(float(found.group(1))) if found else 0


@pytest.mark.postgres
@pytest.mark.parametrize("cluster", [False, True], ids=["database", "cluster"])
def test_two_server_processes_on_one_postgresql_database_never_run_a_line_twice(
    tmp_path: Path, cluster: bool
):
    """Sharing only the database, or in cluster mode (Redis too): the process that
    validates the batch reads a file uploaded through the other, and every line runs
    once."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    shared = {**FAST, "MODELRELAY_SECRET_PEPPER": "pepper-shared-by-both-processes"}
    if cluster:
        require_redis()
        shared |= {"REDIS_URL": REDIS_URL, "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}"}
    with (
        _scratch_postgres_database() as database,
        upstream_in_thread(total_slots=2, first_byte_delay=0.03) as upstream,
        live_server(tmp_path / "a", DATABASE_URL=database, **shared) as first,
        live_server(tmp_path / "b", DATABASE_URL=database, **shared) as second,
        running_worker(first, upstream.url),
        running_worker(second, upstream.url),
    ):
        for server in (first, second):
            poll(lambda server=server: routable(server), what="the workers to register")
        client = openai_client(first)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines(80))), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"
        )
        done = wait_status(openai_client(second), batch.id, "completed", timeout=60)
        assert done.request_counts is not None and done.request_counts.completed == 80
        assert asked(upstream) == Counter({f"req-{i}": 1 for i in range(80)})
        here, there = _finished_here(first), _finished_here(second)
        assert here + there == 80 and here > 0 and there > 0
        assert sorted(output_ids(client, done.output_file_id)) == sorted(asked(upstream))


def test_an_upload_over_the_limit_is_refused_before_its_body(relay_server_factory):
    with relay_server_factory(BATCH_FILE_MAX_BYTES="1000") as server:
        client = openai_client(server)
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 1001)), purpose="batch")
        assert refused.value.status_code == 413
        assert client.files.create(file=("ok.jsonl", io.BytesIO(b"x" * 1000)), purpose="batch")
        # 100 MB announced, not a byte of it sent: the answer comes anyway.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: multipart/form-data; boundary=x\r\n"
                b"Content-Length: 100000000\r\n\r\n"
            )
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 ")


def _head(method: str, path: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _read_answer(sock: socket.socket) -> bytes:
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := sock.recv(4096)):
        answer += chunk
    return answer


def _answer_to_head(port: int, head: bytes) -> bytes:
    """Send a request's headers only (its body never comes) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        return _read_answer(sock)


def test_each_batch_route_is_refused_on_its_headers_before_any_body_byte(relay_server_factory):
    with relay_server_factory(BATCH_FILE_MAX_BYTES="100000") as server:
        cases = [
            # Each route's own limit: a batch's creation 64 KiB, a Message Batch the
            # file limit, an upload the file limit and its framing, none where no
            # body is read (GET, DELETE, cancel).
            (_head("POST", "/v1/batches", 65537), b"413 "),
            (_head("POST", "/v1/messages/batches", 100001), b"413 "),
            (_head("POST", "/v1/files", 200_000, "multipart/form-data; boundary=x"), b"413 "),
            (_head("GET", "/v1/files", 65537), b"413 "),
            (_head("DELETE", "/v1/messages/batches/msgbatch_x", 65537), b"413 "),
            (_head("POST", "/v1/batches/batch_x/cancel", 65537), b"413 "),
            # The method, the path and the content type, whatever the length.
            (_head("PUT", "/v1/files", 10**8), b"405 "),
            (_head("POST", "/v1/files/a/b/c", 10**8), b"404 "),
            (_head("POST", "/v1/messages/batches", 10**8, "text/plain"), b"415 "),
        ]
        for head, status in cases:
            answer = _answer_to_head(server.port, head)
            assert answer.startswith(b"HTTP/1.1 " + status), (head, answer[:300])
        anthropic = _answer_to_head(server.port, cases[1][0])
        assert b'"request_too_large"' in anthropic and b'"type":"error"' in anthropic


@pytest.mark.postgres
def test_an_upload_that_comes_before_the_keys_are_loaded_waits_for_them_unread(tmp_path: Path):
    """The first moments after a start: the API keys are being read (here held back by
    a lock on their table). An upload without a key gets its 401 once they are, and
    not a byte of its body is asked for meanwhile."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    import psycopg

    with _scratch_postgres_database() as database:
        env = {
            "DATABASE_URL": database,
            "MODELRELAY_REQUIRE_API_KEYS": "true",
            "MODELRELAY_SECRET_PEPPER": "pepper-of-both-starts",
        }
        with live_server(tmp_path / "first", **env):
            pass  # migrated
        with psycopg.connect(database) as locking:
            locking.execute("LOCK TABLE keys_apikey IN ACCESS EXCLUSIVE MODE")
            with (
                live_server(tmp_path / "second", **env) as server,
                socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
            ):
                sock.sendall(_head("POST", "/v1/files", 10**8, "multipart/form-data; boundary=x"))
                sock.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    sock.recv(4096)  # no verdict while the keys are not loaded
                locking.rollback()  # the keys can be read now
                sock.settimeout(10)
                answer = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]


def test_a_server_killed_while_storing_an_upload_leaves_no_byte_behind(relay_server_factory):
    """The upload's rows are written in one transaction: killed in the middle of it, the
    server restarts with the whole file or with nothing of it, never loose chunks that
    count against nobody. (Killed while the chunks are being written: the database's
    write-ahead log has grown past a few of them, not yet committed.)"""
    if os.environ.get("RELAY_TEST_DATABASE") == "postgres":
        pytest.skip("watches SQLite's write-ahead log; the SQLite pass runs it")
    body, content_type = _upload_body(b"x" * (48 * 1024 * 1024))
    with relay_server_factory() as server:
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        database = server.data_dir / "db.sqlite3"
        wal = database.with_name("db.sqlite3-wal")
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head + body)
            poll(
                lambda: wal.exists() and wal.stat().st_size > 8 * 1024 * 1024,
                timeout=30,
                what="the upload's chunks to be written",
            )
            server.kill()
        server.start()
        with closing(sqlite3.connect(database)) as db:
            loose = db.execute(
                "SELECT COUNT(*) FROM batches_filechunk c LEFT JOIN batches_storedfile f "
                "ON f.id = c.file_id WHERE f.id IS NULL"
            ).fetchone()
            kept = db.execute(
                "SELECT f.bytes, COALESCE(SUM(LENGTH(c.data)), 0) FROM batches_storedfile f "
                "LEFT JOIN batches_filechunk c ON c.file_id = f.id GROUP BY f.id"
            ).fetchall()
        assert loose == (0,)
        assert all(size == stored == 48 * 1024 * 1024 for size, stored in kept), kept


def _upload_body(content: bytes) -> tuple[bytes, str]:
    request = httpx.Request(
        "POST",
        "http://relay/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch"},
    )
    return request.read(), request.headers["content-type"]
