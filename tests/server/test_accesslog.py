"""The access log (:mod:`relay.server.accesslog`): one line per finished or refused
request in the server's log, in both formats; ``ACCESS_LOG=false`` writes none."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.core.keycache import KeyCache
from relay.core.stats import RequestRecord
from relay.server import accesslog
from relay.server.accesslog import AccessLog, fields, text_line
from relay.wire.logrecord import JsonFormatter, OneLineFormatter
from tests.live import LiveServer, live_server
from tests.test_e2e import CHAT, MODEL, poll, routable, running_worker
from tests.upstream import upstream_in_thread

ADMIN = {"authorization": "Bearer admin-token"}


def record(**changed: Any) -> RequestRecord:
    served: dict[str, Any] = {
        "request_id": "r-1",
        "key_id": None,
        "provider": "local",
        "model": "m",
        "endpoint": CHAT,
        "worker_id": "w-1",
        "worker_name": "gpu box",
        "status": 200,
        "outcome": "ok",
        "streamed": True,
        "queue_wait": 0.0012,
        "ttfb": 0.05,
        "duration": 1.25,
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "requeues": 0,
        "created_at": 1_700_000_000.0,
    }
    served.update(changed)
    return RequestRecord(**served)


def test_a_text_line_names_every_field_and_quotes_what_has_spaces() -> None:
    line = text_line(fields(record(service_class="flex", preemptions=1), "team a"))
    assert line == (
        'POST /v1/chat/completions 200 ok model=m key="team a" worker="gpu box" class=flex '
        "preemptions=1 queue_ms=1.2 first_byte_ms=50.0 duration_ms=1250.0 prompt_tokens=7 "
        "completion_tokens=5 request_id=r-1"
    )
    # A line forged through a name stays one line: the formatter escapes it.
    forged = text_line(fields(record(model="m\nPOST /x 200 ok"), None))
    entry = logging.makeLogRecord({"msg": forged, "levelno": logging.INFO, "levelname": "INFO"})
    assert "\n" not in OneLineFormatter("%(message)s").format(entry)


def test_a_refusal_has_no_request_id_worker_class_or_timings() -> None:
    refused = RequestRecord.rejected(
        status=404,
        outcome="model_not_found",
        model="nobody",
        endpoint=CHAT,
        streamed=False,
        key_id=None,
    )
    line = fields(refused, None)
    assert line["request_id"] is None and line["worker"] is None and line["class"] is None
    assert (line["queue_ms"], line["first_byte_ms"], line["duration_ms"]) == (None, None, None)
    assert text_line(line) == (
        "POST /v1/chat/completions 404 model_not_found model=nobody key=- worker=- class=- "
        "queue_ms=- first_byte_ms=- duration_ms=- prompt_tokens=- completion_tokens=- "
        "request_id=-"
    )


def test_the_loop_only_queues_and_a_full_queue_drops_lines_and_says_how_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = accesslog._Writer.__new__(accesslog._Writer)  # no thread: nothing is taken out
    held._pending, held._wake = deque(), threading.Event()
    held.dropped = held._said = 0
    monkeypatch.setattr(accesslog, "_shared", held)
    monkeypatch.setattr(accesslog, "MAX_PENDING", 2)
    observe = AccessLog(KeyCache("pepper"), json_lines=False).observe
    for _ in range(5):
        observe(record())
    assert len(held._pending) == 2 and held.dropped == 3 and held._wake.is_set()
    stream = io.StringIO()
    monkeypatch.setattr(accesslog.logger, "handlers", [logging.StreamHandler(stream)])
    held._emit([held._entry(*held._pending.popleft()) for _ in range(2)])
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("access log: 3 lines dropped")
    assert [line.split()[:3] for line in lines[1:]] == [["POST", CHAT, "200"]] * 2
    held._emit([held._entry(record(), None, 1.0, False)])  # said once
    assert len(stream.getvalue().splitlines()) == 4


def server_lines(server: LiveServer) -> list[dict[str, Any]]:
    """The server's access lines (``LOG_FORMAT=json``)."""
    found = []
    for line in list(server.output):
        if line.startswith("{"):
            document = json.loads(line)
            if document["logger"] == "relay.access":
                found.append(document)
    return found


def one_line(server: LiveServer, **match: Any) -> dict[str, Any]:
    """The one access line whose fields hold ``match``, once it is written."""

    def matching() -> list[dict[str, Any]]:
        return [d for d in server_lines(server) if all(d.get(k) == v for k, v in match.items())]

    poll(lambda: matching() != [], what=f"an access line with {match}")
    [line] = matching()
    return line


@pytest.mark.live
def test_each_request_gets_one_json_line_with_its_fields(tmp_path: Path) -> None:
    env = {
        "LOG_FORMAT": "json",
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "MODELRELAY_ADMIN_TOKEN": "admin-token",
    }
    with (
        upstream_in_thread() as up,
        live_server(tmp_path / "server", **env) as server,
        running_worker(server, up.url, "--worker-name", "gpu-1", "--no-backend-metrics"),
        httpx.Client(base_url=server.url, timeout=10) as client,
    ):
        made = client.post("/admin/keys", headers=ADMIN, json={"name": "team-a"}).json()
        secret = made["secret"]
        bearer = {"authorization": f"Bearer {secret}"}

        def served_with_the_key() -> bool:
            listed = client.get("/v1/models", headers=bearer)
            return listed.status_code == 200 and MODEL in listed.text

        poll(served_with_the_key, what="the key and the worker's model")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert client.post(CHAT, json=chat, headers=bearer).status_code == 200
        served = one_line(server, status=200)
        assert served["message"] == "POST /v1/chat/completions 200 ok"
        assert served["level"] == "info"
        assert {k: served[k] for k in ("method", "path", "model", "outcome", "key")} == {
            "method": "POST",
            "path": CHAT,
            "model": MODEL,
            "outcome": "ok",
            "key": "team-a",
        }
        assert (served["worker"], served["class"], served["streamed"]) == (
            "gpu-1",
            "default",
            False,
        )
        assert (served["prompt_tokens"], served["completion_tokens"]) == (7, 5)
        assert served["request_id"].startswith("r-")
        assert 0 <= served["queue_ms"] <= served["first_byte_ms"] <= served["duration_ms"]

        # The backend fails: its status, the worker that ran it.
        failed = client.post(CHAT, json={**chat, "mock": {"status": 500}}, headers=bearer)
        assert failed.status_code == 500
        line = one_line(server, status=500)
        assert (line["worker"], line["key"], line["model"]) == ("gpu-1", "team-a", MODEL)
        assert line["request_id"].startswith("r-") and line["request_id"] != served["request_id"]

        # Refused before admission: a model nobody serves.
        missing = client.post(CHAT, json={**chat, "model": "nobody-serves-this"}, headers=bearer)
        assert missing.status_code == 404
        line = one_line(server, status=404)
        assert (line["outcome"], line["model"], line["key"]) == (
            "model_not_found",
            "nobody-serves-this",
            "team-a",
        )
        assert line["request_id"] is None and line["worker"] is None

        # Cancelled by its client mid-stream.
        slow = {**chat, "stream": True, "mock": {"tokens": 50, "token_delay": 0.2}}
        with client.stream("POST", CHAT, json=slow, headers=bearer) as response:
            next(response.iter_raw())
        line = one_line(server, status=499)
        assert (line["outcome"], line["cancel_reason"]) == ("cancelled", "client_disconnect")
        assert line["streamed"] is True and line["worker"] == "gpu-1"
        assert line["first_byte_ms"] is not None

        assert len(server_lines(server)) == 4
        assert secret not in server.log()


@pytest.mark.live
def test_the_text_format_writes_the_line_as_its_message(tmp_path: Path) -> None:
    with (
        upstream_in_thread() as up,
        live_server(tmp_path / "server") as server,
        running_worker(server, up.url, "--worker-name", "gpu-1", "--no-backend-metrics"),
    ):
        poll(lambda: routable(server), what="the worker's model")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + CHAT, json=chat, timeout=10).status_code == 200
        line = server.wait_for_log("relay.access: POST /v1/chat/completions 200 ok")
        assert " model=mock-model key=- worker=gpu-1 class=default " in line
        assert " prompt_tokens=7 completion_tokens=5 request_id=r-" in line


@pytest.mark.live
def test_access_log_false_writes_no_line(tmp_path: Path) -> None:
    with (
        upstream_in_thread() as up,
        live_server(tmp_path / "server", LOG_FORMAT="json", ACCESS_LOG="false") as server,
        running_worker(server, up.url, "--no-backend-metrics"),
    ):
        poll(lambda: routable(server), what="the worker's model")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + CHAT, json=chat, timeout=10).status_code == 200
        missing = httpx.post(server.url + CHAT, json={**chat, "model": "nobody"}, timeout=10)
        assert missing.status_code == 404
    # Stopped: whatever the access log had queued would have been written by now.
    server_docs = [json.loads(line) for line in server.output if line.startswith("{")]
    assert server_docs and [d for d in server_docs if d["logger"] == "relay.access"] == []


def test_json_fields_are_the_objects_keys() -> None:
    entry = logging.makeLogRecord({"msg": "POST /x 200 ok", "levelno": 20, "levelname": "INFO"})
    entry.__dict__.update(fields(record(), "k"))
    document = json.loads(JsonFormatter().format(entry))
    assert document["class"] == "default" and document["key"] == "k"
    assert document["request_id"] == "r-1" and document["duration_ms"] == 1250.0
