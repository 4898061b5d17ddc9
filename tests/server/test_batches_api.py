"""The Files and Batches APIs through the real ASGI app and a fake worker (SPEC §16):
uploads and their limits, who sees what, validation, how lines run and end."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from batches.models import FileChunk, StoredFile
from keys.services import create_key
from relay.server import runtime
from relay.server.batches import files, lifecycle
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until
from tests.batchkit import (
    CHAT,
    Answering,
    bearer,
    call,
    content,
    create_batch,
    ended,
    jsonl,
    least_stall,
    line,
    multipart,
    submit,
    upload,
    wait_batch,
)
from tests.stall import STALL_BUDGET_MS

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "batches-admin-token"
MISSING = "missing_required_parameter"


@pytest.fixture
async def provider(request, fresh_runtime, settings):
    """The provider, with the relay's settings for the test (``indirect`` parameters:
    the runtime reads them when it starts, with the first worker or request)."""
    settings.BATCH_POLL_SECS = 0.05
    settings.BATCH_FLUSH_SECS = 0.02
    settings.BATCH_CLAIM_SECS = 5
    settings.MODELRELAY_ADMIN_TOKEN = ADMIN
    for name, value in getattr(request, "param", {}).items():
        setattr(settings, name, value)
    return await make_provider()


def relay_settings(**values: object) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("provider", [values], indirect=True, ids=[""])


@pytest.fixture
async def worker(provider):
    worker = FakeWorker()
    await worker.register(["m"], max_concurrent=2)
    answering = Answering(worker).start()
    yield answering
    await answering.stop()
    await worker.disconnect()


# ------------------------------------------------------------------------- files


async def test_a_file_is_uploaded_listed_read_and_deleted(provider):
    data = jsonl(line("a"), line("b"))
    uploaded = await upload(data)
    assert uploaded["object"] == "file"
    assert uploaded["bytes"] == len(data)
    assert uploaded["purpose"] == "batch" and uploaded["filename"] == "in.jsonl"
    assert uploaded["id"].startswith("file-")
    status, listed = await call("GET", "/v1/files")
    assert status == 200 and [f["id"] for f in listed["data"]] == [uploaded["id"]]
    assert (await call("GET", f"/v1/files/{uploaded['id']}")) == (200, uploaded)
    status, raw = await call("GET", f"/v1/files/{uploaded['id']}/content")
    assert status == 200 and raw == data
    status, deleted = await call("DELETE", f"/v1/files/{uploaded['id']}")
    assert (status, deleted) == (200, {"id": uploaded["id"], "object": "file", "deleted": True})
    status, missing = await call("GET", f"/v1/files/{uploaded['id']}")
    assert status == 404 and missing["error"]["code"] == "not_found"


async def test_a_file_one_byte_over_the_limit_is_413_and_one_at_it_is_kept(provider, settings):
    settings.BATCH_FILE_MAX_BYTES = 1000
    body, content_type = multipart(b"x" * 1001)
    status, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert status == 413
    assert document["error"]["code"] == "request_too_large"
    assert (await upload(b"x" * 1000))["bytes"] == 1000
    status, listed = await call("GET", "/v1/files")
    assert [f["bytes"] for f in listed["data"]] == [1000]


async def test_an_upload_declaring_more_than_the_limit_is_refused_before_its_body(
    provider, settings
):
    settings.BATCH_FILE_MAX_BYTES = 1000
    headers = [(b"content-length", b"10000000")]
    upload_call = HttpCall(
        "POST", "/v1/files", b"", headers, content_type=b"multipart/form-data; boundary=x"
    )
    # Not a byte of the body is sent: the answer comes from the headers alone.
    assert await upload_call.start() == 413
    assert json.loads(await upload_call.read_rest())["error"]["code"] == "request_too_large"


# ------------------------------------------------------------------------- stored bytes


async def test_an_upload_is_stored_in_chunks_and_read_back_whole(provider, monkeypatch):
    monkeypatch.setattr(files, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(files, "READ_CHUNKS", 2)
    data = bytes(range(256)) * 14  # 3584 bytes: three whole chunks and a part
    uploaded = await upload(data)
    sizes = await sync_to_async(
        lambda: [len(d) for d in FileChunk.objects.order_by("index").values_list("data", flat=True)]
    )()
    assert sizes == [1000, 1000, 1000, 584]
    status, raw = await call("GET", f"/v1/files/{uploaded['id']}/content")
    assert status == 200 and raw == data
    await call("DELETE", f"/v1/files/{uploaded['id']}")
    assert await sync_to_async(FileChunk.objects.count)() == 0


async def test_a_key_keeps_at_most_its_files_and_bytes_and_one_more_is_refused(provider, settings):
    settings.BATCH_MAX_FILES_PER_KEY = 3
    settings.BATCH_MAX_FILE_BYTES_PER_KEY = 1000
    first = await upload(b"x" * 600)
    await upload(b"x" * 399)
    await upload(b"x")  # three files of 1000 bytes in all: the most it may keep
    # One file more is a 429, in OpenAI's envelope ...
    body, content_type = multipart(b"y")
    status, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert status == 429, document
    assert document["error"]["code"] == "file_count_exceeded"
    assert "At most 3 files" in document["error"]["message"]
    await call("DELETE", f"/v1/files/{first['id']}")
    # ... one byte more a 413; and a refused upload leaves no row and no byte behind.
    body, content_type = multipart(b"y" * 601)
    status, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert status == 413, document
    assert document["error"]["code"] == "file_bytes_exceeded"
    assert "at most 1000 bytes in all (400 in use)" in document["error"]["message"]
    assert await sync_to_async(StoredFile.objects.count)() == 2
    assert await sync_to_async(FileChunk.objects.count)() == 2
    assert (await upload(b"y" * 600))["bytes"] == 600


@relay_settings(MODELRELAY_REQUIRE_API_KEYS=True, BATCH_MAX_FILES_PER_KEY=1)
async def test_each_key_has_its_own_room_and_a_full_one_is_refused_before_the_body(provider):
    team = await sync_to_async(create_key)("team")
    lab = await sync_to_async(create_key)("lab")
    await runtime.current().sync()
    await upload(b"a", bearer(team.secret))
    await upload(b"b", bearer(lab.secret))  # the other key's room is its own
    headers = [*bearer(team.secret), (b"content-length", b"5000")]
    refused = HttpCall(
        "POST", "/v1/files", b"", headers, content_type=b"multipart/form-data; boundary=x"
    )
    # Not a byte of the body is sent: the key's files are counted first.
    assert await refused.start() == 429
    assert json.loads(await refused.read_rest())["error"]["code"] == "file_count_exceeded"


async def test_without_keys_every_upload_shares_one_room(provider, settings):
    settings.BATCH_MAX_FILES_PER_KEY = 1
    await upload(b"a")
    body, content_type = multipart(b"b")
    status, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert status == 429 and document["error"]["code"] == "file_count_exceeded"


async def test_pruning_an_old_upload_deletes_its_bytes(provider):
    uploaded = await upload(b"x" * 10)

    def age_and_prune() -> int:
        old = timezone.now() - dt.timedelta(days=31)
        StoredFile.objects.filter(public_id=uploaded["id"]).update(created_at=old)
        lifecycle.prune(30)
        return FileChunk.objects.count() + StoredFile.objects.count()

    assert await sync_to_async(age_and_prune)() == 0


async def test_the_admin_lists_uploads_without_reading_their_bytes(provider):
    from django.contrib.auth.models import User
    from django.test import AsyncClient

    uploaded = await upload(b"x" * 10)
    user = await sync_to_async(User.objects.create_superuser)("root", "root@example.com", "pw")
    staff = AsyncClient()
    await staff.aforce_login(user)
    listing = await staff.get("/django-admin/batches/storedfile/")
    assert listing.status_code == 200 and uploaded["id"] in listing.content.decode()
    pk = await sync_to_async(lambda: StoredFile.objects.get(public_id=uploaded["id"]).pk)()
    assert (await staff.get(f"/django-admin/batches/storedfile/{pk}/change/")).status_code == 200


async def test_the_largest_upload_never_stalls_the_event_loop(provider, settings):
    settings.BATCH_FILE_MAX_BYTES = 8 * 1024 * 1024
    one = json.dumps(line("x" * 1000)).encode() + b"\n"
    data = one * (settings.BATCH_FILE_MAX_BYTES // len(one))
    data += b"\n" * (settings.BATCH_FILE_MAX_BYTES - len(data))
    body, content_type = multipart(data)
    await upload(b"warm")  # first calls (the application's set-up) out of the measure

    def prepare() -> Callable[[], Awaitable[None]]:
        uploading = HttpCall("POST", "/v1/files", body, content_type=content_type)

        async def run() -> None:
            status, document = await (await uploading.send(split=64 * 1024)).json(timeout=30)
            assert status == 200 and document["bytes"] == len(data), document

        return run

    assert (stall := await least_stall(prepare)) < STALL_BUDGET_MS, stall


# ------------------------------------------------------------------------- input lines


def sized_line(custom_id: str, size: int) -> bytes:
    """An input line of exactly ``size`` bytes (its body padded)."""
    bare = len(json.dumps(line(custom_id, pad="")).encode())
    return json.dumps(line(custom_id, pad="x" * (size - bare))).encode()


@relay_settings(MAX_REQUEST_BYTES=4096)
async def test_a_line_of_max_request_bytes_runs_and_one_byte_more_fails_validation(worker):
    fits, over = sized_line("fits", 4096), sized_line("over", 4097)
    assert (len(fits), len(over)) == (4096, 4097)
    done = await wait_batch((await submit([fits]))["id"], ended)
    assert done["status"] == "completed", done
    # The body goes to the worker as the bytes it was sent as, never re-encoded.
    (request,) = worker.requests
    assert request.body == json.dumps(json.loads(fits)["body"])
    failed = await wait_batch((await submit([line("a"), over, line("b")]))["id"], ended)
    assert failed["status"] == "failed"
    (error,) = failed["errors"]["data"]
    assert (error["code"], error["line"]) == ("line_too_large", 2)
    assert "larger than 4096 bytes" in error["message"]
    assert len(worker.requests) == 1


async def test_a_line_nested_as_deep_as_json_goes_runs_and_deeper_fails_saying_so(worker):
    def nested(custom_id: str, depth: int) -> bytes:
        body = json.dumps(line(custom_id)["body"])[:-1] + ', "x": '
        body += "[" * depth + "]" * depth + "}"
        head = json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT})[:-1]
        return f'{head}, "body": {body}}}'.encode()

    done = await wait_batch((await submit([nested("deep", 500)]))["id"], ended)
    assert done["request_counts"]["completed"] == 1, done
    failed = await wait_batch((await submit([nested("deeper", 100_000)]))["id"], ended)
    (error,) = failed["errors"]["data"]
    assert (error["code"], error["message"]) == (
        "invalid_json_line",
        "This line is nested too deeply",
    )


@relay_settings(MAX_REQUEST_BYTES=8 * 1024 * 1024)
async def test_validating_the_largest_line_never_stalls_the_event_loop(worker):
    # A model nobody serves: the whole line is read, then the batch fails, and nothing
    # runs (running a line costs what the same request sent directly does).
    escapes = '\\"\u00e9' * 1000
    bare = len(json.dumps(line("big", model="nobody-serves-this", pad="")).encode())
    pad = escapes * ((8 * 1024 * 1024 - bare) // len(json.dumps(escapes)))
    body, content_type = multipart(jsonl(line("big", model="nobody-serves-this", pad=pad)))
    await upload(b"warm")  # first calls (the application's set-up) out of the measure

    def prepare() -> Callable[[], Awaitable[None]]:
        uploading = HttpCall("POST", "/v1/files", body, content_type=content_type)

        async def run() -> None:
            _, uploaded = await (await uploading.send(split=64 * 1024)).json(timeout=30)
            batch = await create_batch(uploaded["id"])
            failed = await wait_batch(batch["id"], ended, timeout=30)
            assert [e["code"] for e in failed["errors"]["data"]] == ["model_not_found"]

        return run

    assert (stall := await least_stall(prepare)) < STALL_BUDGET_MS, stall


@pytest.mark.parametrize(
    ("method", "path", "length", "content_type", "status"),
    [
        ("POST", "/v1/batches", 65537, b"application/json", 413),
        ("POST", "/v1/messages/batches", 10**9, b"application/json", 413),
        ("GET", "/v1/files", 65537, None, 413),
        ("POST", "/v1/batches/batch_x/cancel", 65537, None, 413),
        ("PUT", "/v1/files", 10**9, b"application/json", 405),
        ("POST", "/v1/messages/batches", 100, b"text/plain", 415),
    ],
)
async def test_each_route_is_refused_on_its_headers_in_the_application_too(
    provider, method, path, length, content_type, status
):
    headers = [(b"content-length", str(length).encode())]
    refused = HttpCall(method, path, b"", headers, content_type=content_type)
    assert await refused.start() == status  # not a byte of the body was sent
    await refused.read_rest()


@pytest.mark.parametrize(
    ("body", "content_type", "status", "message"),
    [
        (b"{}", b"application/json", 415, "multipart/form-data"),
        (b"--x--\r\n", b"multipart/form-data; boundary=x", 400, "file: a file part"),
        (b"junk", b"multipart/form-data", 400, "multipart body could not be read"),
    ],
)
async def test_malformed_uploads_are_refused_saying_why(
    provider, body, content_type, status, message
):
    answer, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert answer == status
    assert message in document["error"]["message"]


async def test_only_batch_files_are_kept(provider):
    body, content_type = multipart(b"{}", purpose="fine-tune")
    status, document = await call("POST", "/v1/files", body, content_type=content_type)
    assert status == 400 and "purpose" in document["error"]["message"]


@relay_settings(MODELRELAY_REQUIRE_API_KEYS=True)
async def test_a_key_sees_only_its_own_files_and_batches_and_the_admin_sees_all(provider):
    team = await sync_to_async(create_key)("team")
    lab = await sync_to_async(create_key)("lab")
    await runtime.current().sync()
    ours = await upload(jsonl(line("a")), bearer(team.secret))
    theirs = await upload(jsonl(line("b")), bearer(lab.secret))
    status, listed = await call("GET", "/v1/files", headers=bearer(team.secret))
    assert [f["id"] for f in listed["data"]] == [ours["id"]]
    for path in (f"/v1/files/{theirs['id']}", f"/v1/files/{theirs['id']}/content"):
        status, document = await call("GET", path, headers=bearer(team.secret))
        assert status == 404, path
    status, _ = await call("DELETE", f"/v1/files/{theirs['id']}", headers=bearer(team.secret))
    assert status == 404
    # A key cannot start a batch on another key's file either.
    body = {"input_file_id": theirs["id"], "endpoint": CHAT, "completion_window": "24h"}
    status, _ = await call("POST", "/v1/batches", body, bearer(team.secret))
    assert status == 404
    batch = await create_batch(ours["id"], bearer(team.secret))
    for who, expected in ((lab.secret, []), (team.secret, [batch["id"]]), (ADMIN, [batch["id"]])):
        status, listed = await call("GET", "/v1/batches", headers=bearer(who))
        assert [b["id"] for b in listed["data"]] == expected
    status, _ = await call("GET", f"/v1/batches/{batch['id']}", headers=bearer(lab.secret))
    assert status == 404
    status, _ = await call("POST", f"/v1/batches/{batch['id']}/cancel", headers=bearer(lab.secret))
    assert status == 404
    status, listed = await call("GET", "/v1/files", headers=bearer(ADMIN))
    assert {f["id"] for f in listed["data"]} == {ours["id"], theirs["id"]}
    status, document = await call("GET", "/v1/files")
    assert status == 401 and document["error"]["code"] == "invalid_api_key"


async def test_unknown_paths_and_methods_answer_in_the_envelope(provider):
    status, document = await call("PUT", "/v1/files")
    assert status == 405 and document["error"]["code"] == "method_not_allowed"
    call_ = await HttpCall("GET", "/v1/batches/x/cancel").send()
    assert await call_.start() == 405 and call_.headers["allow"] == "POST"
    await call_.read_rest()
    status, document = await call("GET", "/v1/files/a/b/c")
    assert status == 404 and document["error"]["code"] == "not_found"
    status, document = await call("GET", "/v1/messages/batches/nope")
    assert status == 404 and document["type"] == "error"
    assert document["error"]["type"] == "not_found_error"


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("lines", "code", "number"),
    [
        ([b'{"custom_id": "a", "method": "POST"', line("b")], "invalid_json_line", 1),
        ([line("a"), line("b", url="/v1/embeddings")], "invalid_url", 2),
        ([line("a"), line("a")], "duplicate_custom_id", 2),
        ([line("a"), line("b", model="nobody-serves-this")], "model_not_found", 2),
        ([{**line("a"), "method": "GET"}], "invalid_method", 1),
        ([{"method": "POST", "url": CHAT, "body": {"model": "m"}}], MISSING, 1),
        ([{"custom_id": "a", "method": "POST", "url": CHAT, "body": {}}], MISSING, 1),
        ([b"[1, 2]"], "invalid_json_line", 1),
        ([], "empty_file", None),
    ],
)
async def test_a_batch_with_a_bad_line_fails_with_errors_and_runs_nothing(
    worker, lines, code, number
):
    uploaded = await upload(jsonl(*lines))
    batch = await create_batch(uploaded["id"])
    assert batch["status"] == "validating"
    failed = await wait_batch(batch["id"], ended)
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    assert failed["errors"]["object"] == "list"
    assert [(e["code"], e["line"]) for e in failed["errors"]["data"]] == [(code, number)]
    assert failed["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert worker.requests == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
        ({"input_file_id": "f", "endpoint": "/v1/nope", "completion_window": "24h"}, "endpoint"),
        ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
        (
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": [1]},
            "metadata",
        ),
    ],
)
async def test_a_malformed_create_is_400(provider, body, message):
    status, document = await call("POST", "/v1/batches", body)
    assert status == 400 and message in document["error"]["message"]


async def test_too_many_queued_lines_for_one_key_fail_the_batch(worker, settings):
    settings.BATCH_MAX_QUEUED_LINES_PER_KEY = 3
    worker.reply = lambda request: None  # hold every line: they stay queued
    first = await submit([line("a"), line("b")])
    started = await wait_batch(first["id"], lambda b: b["status"] != "validating")
    assert started["status"] == "in_progress", started
    second = await submit([line("c"), line("d")])
    failed = await wait_batch(second["id"], ended)
    assert failed["status"] == "failed"
    assert [e["code"] for e in failed["errors"]["data"]] == ["batch_lines_exceeded"]
    third = await submit([line("e")])
    assert (await wait_batch(third["id"], lambda b: b["status"] != "validating"))["status"] == (
        "in_progress"
    )


# ------------------------------------------------------------------------- running


async def test_a_batch_runs_each_line_once_and_writes_output_and_error_files(worker):
    def reply(request: protocol.Request) -> tuple[int, str]:
        said = json.loads(request.body)["messages"][0]["content"]
        if said == "bad":
            return 400, '{"error": {"message": "no", "type": "invalid_request_error"}}'
        return 200, json.dumps({"said": said})

    worker.reply = reply
    lines = [line(f"l{i}") for i in range(7)] + [line("bad"), line("s", stream=True)]
    batch = await submit(lines, metadata={"job": "eval"})
    assert batch["metadata"] == {"job": "eval"}
    done = await wait_batch(batch["id"], ended)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 9, "completed": 8, "failed": 1}
    assert done["usage"]["input_tokens"] == 27 and done["usage"]["output_tokens"] == 18
    assert done["usage"]["input_tokens_details"] == {"cached_tokens": 9}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert done[stamp] >= done["created_at"]
    assert sorted(worker.said()) == sorted(["bad", "s", *(f"l{i}" for i in range(7))])
    # Never streamed: the request frame and the body both say so.
    streamed = [r for r in worker.requests if json.loads(r.body)["messages"][0]["content"] == "s"]
    assert not streamed[0].is_streaming and json.loads(streamed[0].body)["stream"] is False
    assert all(r.endpoint_path == CHAT for r in worker.requests)
    output = await content(done["output_file_id"])
    assert [o["custom_id"] for o in output] == [*(f"l{i}" for i in range(7)), "s"]
    first = output[0]
    assert first["error"] is None and first["id"].startswith("batch_req_")
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"] == {"said": "l0"}
    assert first["response"]["request_id"].startswith("r-")
    errors = await content(done["error_file_id"])
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad", 400)]
    assert errors[0]["response"]["body"]["error"]["message"] == "no"
    _, output_file = await call("GET", f"/v1/files/{done['output_file_id']}")
    assert output_file["purpose"] == "batch_output"
    _, raw = await call("GET", f"/v1/files/{done['output_file_id']}/content")
    assert output_file["bytes"] == len(raw)


@relay_settings(MAX_REQUEUE_COUNT=2)
async def test_a_line_whose_worker_fails_is_tried_again_up_to_the_cap_then_errored(worker):
    worker.reply = lambda r: (503, "{}") if "down" in r.body else (200, "{}")
    batch = await submit([line("down"), line("fine")])
    done = await wait_batch(batch["id"], ended)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert worker.said().count("down") == 3  # the first try and MAX_REQUEUE_COUNT more
    assert worker.said().count("fine") == 1
    errors = await content(done["error_file_id"])
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("down", 503)]


@relay_settings(MAX_REQUEUE_COUNT=1)
async def test_a_worker_error_frame_is_tried_again_then_written_as_the_error(worker):
    worker.reply = lambda request: None
    batch = await submit([line("a")])
    for _ in range(2):
        await until(lambda: len(worker.held) == 1)
        request_id = next(iter(worker.held))
        worker.held.clear()
        worker.in_flight -= 1
        await worker.worker.send(
            protocol.Error(request_id=request_id, message="backend exploded", code="internal")
        )
    done = await wait_batch(batch["id"], ended)
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    (error,) = await content(done["error_file_id"])
    assert error["response"] is None
    assert error["error"]["code"] == "worker_error"


@relay_settings(MAX_QUEUE_LEN=1)
async def test_batch_lines_only_take_free_slots_and_never_fill_the_queue(worker):
    worker.reply = lambda request: None
    batch = await submit([line(f"l{i}") for i in range(6)])
    relay = runtime.current().relay
    await until(lambda: worker.in_flight == 2)
    # Both slots are taken by batch lines and nothing of the batch waits in the queue:
    # an interactive request is queued (not refused with 429) ...
    assert relay.queue_depth() == 0
    interactive = await HttpCall("POST", CHAT, chat()).send()
    # ... and takes the slot of a batch line that has sent nothing yet (SPEC §15): that
    # line goes back to the queue, to run again on the next free slot.
    await until(lambda: "hi" in worker.said())
    assert relay.stats.preemptions == 1 and len(worker.cancels) == 1
    assert relay.queue_depth() == 1
    interactive_id = worker.requests[-1].request_id
    await worker.release(interactive_id)
    status, _ = await interactive.json()
    assert status == 200
    assert worker.most_in_flight == 2
    assert all(r.is_streaming is False for r in worker.requests)
    while worker.held:
        await worker.release(next(iter(worker.held)))
        await until(lambda: worker.held or len(worker.requests) == 8, timeout=5)
    done = await wait_batch(batch["id"], ended)
    assert done["request_counts"]["completed"] == 6
    assert worker.most_in_flight == 2


@relay_settings(MODELRELAY_REQUIRE_API_KEYS=True)
async def test_batch_lines_are_flex_requests_of_their_key_under_its_limits(worker):
    key = await sync_to_async(create_key)("evals", max_concurrent=1)
    await runtime.current().sync()
    worker.reply = lambda request: None
    relay = runtime.current().relay
    submitted: list[object] = []
    original = relay.submit

    def spy(**kwargs):
        request = original(**kwargs)
        submitted.append((request.key_id, request.service_class, request.is_streaming))
        return request

    relay.submit = spy  # type: ignore[method-assign]
    batch = await submit([line("a"), line("b"), line("c")], bearer(key.secret))
    await until(lambda: worker.in_flight == 1)
    assert submitted == [(key.key.id, "flex", False)]
    while len(worker.requests) < 3 or worker.held:
        await until(lambda: worker.held)
        assert worker.in_flight == 1  # the key's max_concurrent, though two slots are free
        await worker.release(next(iter(worker.held)))
        await until(lambda: worker.in_flight == 1 or len(worker.requests) == 3)
    done = await wait_batch(batch["id"], ended, bearer(key.secret))
    assert done["request_counts"]["completed"] == 3
    assert worker.most_in_flight == 1


@relay_settings(MODELRELAY_REQUIRE_API_KEYS=True)
async def test_a_model_the_key_may_not_use_errors_its_lines(worker):
    key = await sync_to_async(create_key)("narrow", allowed_models="other")
    await runtime.current().sync()
    batch = await submit([line("a")], bearer(key.secret))
    done = await wait_batch(batch["id"], ended, bearer(key.secret))
    (error,) = await content(done["error_file_id"], bearer(key.secret))
    assert error["error"]["code"] == "model_not_allowed"
    assert worker.requests == []


async def test_cancelling_a_running_batch_stops_its_lines_and_keeps_what_ended(worker):
    worker.reply = lambda r: (200, "{}") if "first" in r.body else None
    batch = await submit([line("first"), line("held-1"), line("held-2"), line("never")])
    await until(lambda: len(worker.held) == 2 and len(worker.requests) == 3)
    status, cancelling = await call("POST", f"/v1/batches/{batch['id']}/cancel")
    assert status == 200 and cancelling["status"] in ("cancelling", "cancelled")
    await until(lambda: len(worker.cancels) == 2, timeout=5)
    assert {c.request_id for c in worker.cancels} == {r.request_id for r in worker.requests[1:]}
    done = await wait_batch(batch["id"], ended)
    assert done["status"] == "cancelled" and done["cancelled_at"] >= done["cancelling_at"]
    assert done["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert [o["custom_id"] for o in await content(done["output_file_id"])] == ["first"]
    errors = await content(done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("held-1", "batch_cancelled"),
        ("held-2", "batch_cancelled"),
        ("never", "batch_cancelled"),
    ]
    assert len(worker.requests) == 3
    status, again = await call("POST", f"/v1/batches/{batch['id']}/cancel")
    assert status == 400 and "cancelled" in again["error"]["message"]


async def test_a_batch_that_outlives_its_completion_window_expires(worker, settings):
    settings.BATCH_COMPLETION_WINDOW_SECS = 0.5
    worker.reply = lambda r: (200, "{}") if "quick" in r.body else None
    batch = await submit([line("quick"), line("slow-1"), line("slow-2"), line("later")])
    await until(lambda: len(worker.held) == 2)
    done = await wait_batch(batch["id"], ended, timeout=10)
    assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"]
    assert done["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert sorted(c.reason for c in worker.cancels) in (["timeout", "timeout"],)
    errors = await content(done["error_file_id"])
    assert {e["custom_id"]: e["error"]["code"] for e in errors} == {
        "slow-1": "batch_expired",
        "slow-2": "batch_expired",
        "later": "batch_expired",
    }


async def test_batches_list_newest_first_in_pages(worker):
    worker.reply = lambda request: None
    ids = [(await submit([line(f"l{i}")]))["id"] for i in range(3)]
    _, page = await call("GET", "/v1/batches?limit=2")
    assert [b["id"] for b in page["data"]] == [ids[2], ids[1]]
    assert page["has_more"] is True and page["object"] == "list"
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    _, rest = await call("GET", f"/v1/batches?limit=2&after={ids[1]}")
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert (await call("GET", "/v1/batches?limit=0"))[0] == 400


async def test_metrics_and_the_dashboard_snapshot_show_batch_lines(worker):
    from relay.pages.dashboard import live_snapshot

    worker.reply = lambda r: (200, "{}") if "done" in r.body else None
    batch = await submit([line("done"), line("held-1"), line("held-2"), line("waiting")])
    await until(lambda: len(worker.held) == 2)
    rt = runtime.current()
    await until(lambda: rt.batches.finished["succeeded"] == 1)
    _, _, text = await (await HttpCall("GET", "/metrics").send()).response()
    metrics = text.decode()
    assert 'modelrelay_batch_lines{state="running"} 2.0' in metrics
    assert 'modelrelay_batch_lines_finished_total{outcome="succeeded"} 1.0' in metrics
    assert 'modelrelay_batches{status="in_progress"} 1.0' in metrics
    snapshot = await live_snapshot(rt)
    (row,) = snapshot["batches"]
    assert row["id"] == batch["id"] and row["total"] == 4 and row["status"] == "in_progress"


async def test_spare_slots_are_left_for_interactive_requests(worker, settings):
    settings.BATCH_SPARE_SLOTS = 1
    worker.reply = lambda r: None if "line" in r.body else (200, "{}")
    batch = await submit([line(f"line-{i}") for i in range(3)])
    await until(lambda: worker.in_flight == 1)
    relay = runtime.current().relay
    status, _ = await (await HttpCall("POST", CHAT, chat()).send()).json()
    assert status == 200  # it took the spare slot at once, nothing of it was queued
    assert relay.queue_depth() == 0 and worker.most_in_flight == 1
    while len(worker.requests) < 4 or worker.held:
        await until(lambda: worker.held)
        await worker.release(next(iter(worker.held)))
    done = await wait_batch(batch["id"], ended)
    assert done["request_counts"]["completed"] == 3 and worker.most_in_flight == 1
