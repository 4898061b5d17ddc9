"""``LOG_FORMAT=json`` (SPEC §17): one JSON object per line from the server and the worker,
the start banner included, ``request_id`` on every line about a request on both sides."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

from relay.wire import logrecord
from relay.wire.logrecord import JsonFormatter
from tests.live import live_server
from tests.test_e2e import poll, routable, running_worker
from tests.upstream import upstream_in_thread


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("relay", logging.INFO, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


def test_a_record_is_one_json_object_with_its_request_id_and_extra_fields() -> None:
    line = JsonFormatter().format(
        record("worker %s said:\nhello", "box", request_id="r-1", worker="box")
    )
    assert "\n" not in line
    document = json.loads(line)
    assert document["message"] == "worker box said:\nhello"
    assert document["request_id"] == "r-1" and document["worker"] == "box"
    assert document["level"] == "info" and document["logger"] == "relay"
    assert document["time"].endswith("Z")


def test_the_tasks_request_id_tags_lines_that_do_not_name_one() -> None:
    token = logrecord.request_id.set("r-from-context")
    try:
        document = json.loads(JsonFormatter().format(record("backend error")))
    finally:
        logrecord.request_id.reset(token)
    assert document["request_id"] == "r-from-context"
    assert "request_id" not in json.loads(JsonFormatter().format(record("idle")))


def test_a_traceback_stays_inside_the_object() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord(
            "relay", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(failed)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


@pytest.mark.live
def test_server_and_worker_write_json_lines_naming_the_request_on_both_sides(
    tmp_path: Path,
) -> None:
    with (
        upstream_in_thread() as up,
        live_server(tmp_path / "server", LOG_FORMAT="json", LOG_LEVEL="debug") as server,
        running_worker(server, up.url, "--log-format", "json", "--no-backend-metrics") as worker,
    ):
        poll(lambda: routable(server), what="the worker's model")
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "mock-model", "messages": []},
            timeout=10,
        )
        assert answer.status_code == 200
        [recorded] = [r for r in up.requests if r.path == "/v1/chat/completions"]
        worker.wait_for_log('"request_id"')
        server_lines = list(server.output)
        worker_lines = list(worker.lines)
    server_docs = [json.loads(line) for line in server_lines if line.strip()]
    worker_docs = [json.loads(line) for line in worker_lines if line.strip()]
    [banner] = [d for d in server_docs if "Listening on" in d["message"]]
    assert banner["message"].startswith("ModelRelay ") and "Listening on" in banner["message"]
    assert banner["listen"].startswith("127.0.0.1:") and banner["provider"] == "local"
    assert "WORKER_SECRET=" in banner["banner"]
    # The request's id, as the relay assigned it and the worker received it.
    forwarding = [d for d in worker_docs if d["message"].startswith("forwarding request")]
    [line] = forwarding
    request_id = line["request_id"]
    assert request_id.startswith("r-") and request_id in line["message"]
    # The relay's own lines (at debug, uvicorn's WebSocket library also dumps frames).
    about = [
        d for d in server_docs if request_id in d["message"] and d["logger"].startswith("relay")
    ]
    assert about, "the server logged nothing about the request"
    assert [d for d in about if d.get("request_id") != request_id] == []
    assert all(d.get("request_id") == request_id for d in worker_docs if request_id in d["message"])
    assert recorded.finished.is_set()
