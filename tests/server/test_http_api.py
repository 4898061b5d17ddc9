"""Client requests end to end through the real ASGI app and a fake worker (SPEC §5-§6)."""

from __future__ import annotations

import json

import pytest

from relay.server import control, runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


def relay():
    return runtime.current().relay


def total_load() -> int:
    return sum(w.load for w in relay().registry.workers.values())


async def post(path: str = "/v1/chat/completions", body=None, **kwargs) -> HttpCall:
    return await HttpCall("POST", path, chat() if body is None else body, **kwargs).send()


# -- bad client input -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{nope", "Request body is not valid JSON"),
        (b"[1, 2]", "Request body must be a JSON object"),
        (b'"model"', "Request body must be a JSON object"),
        (b"{}", "'model' is required"),
        (b'{"model": 7}', "'model' must be a string"),
        (b'{"model": "  "}', "'model' must not be empty"),
        (b'{"model": "m", "stream": "yes"}', "'stream' must be a boolean"),
        (b'{"model": "m\xff"}', "Request body must be UTF-8 encoded JSON"),
        (b"", "Request body is not valid JSON"),
    ],
)
async def test_bad_bodies_get_400_saying_what_is_wrong(provider, body, message):
    status, document = await (await post(body=body)).json()
    assert status == 400
    assert document == {
        "error": {"message": message, "type": "invalid_request_error", "code": "invalid_request"}
    }


async def test_anthropic_route_answers_errors_in_its_own_envelope(provider):
    status, document = await (await post("/v1/messages", body=b"{}")).json()
    assert status == 400
    assert document == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'model' is required"},
    }
    status, document = await (await post("/v1/messages", body=chat("claude-nope"))).json()
    assert status == 404
    assert document["error"] == {
        "type": "not_found_error",
        "message": "model 'claude-nope' is not served here",
    }


async def test_oversized_bodies_get_413(provider, settings):
    settings.MAX_REQUEST_BYTES = 2048
    big = chat(padding="x" * 4096)
    call = await HttpCall("POST", "/v1/chat/completions", big).send(split=1000)
    status, document = await call.json()
    assert status == 413
    assert document["error"]["code"] == "request_too_large"


async def test_wrong_content_type_gets_415_and_wrong_method_405(provider):
    call = await post(body=b"model=m", content_type=b"application/x-www-form-urlencoded")
    status, document = await call.json()
    assert status == 415
    assert document["error"]["message"] == "Content-Type must be application/json"
    status, _ = await (await HttpCall("GET", "/v1/chat/completions").send()).json()
    assert status == 405


async def test_unknown_model_gets_404(provider):
    status, document = await (await post(body=chat("nobody-has-this"))).json()
    assert status == 404
    assert document["error"] == {
        "message": "model 'nobody-has-this' is not served here",
        "type": "invalid_request_error",
        "code": "model_not_found",
    }


# -- pass-through ----------------------------------------------------------------


async def test_non_streaming_round_trip_is_byte_exact(provider):
    raw = b'{"model":"m",   "messages":[{"role":"user","content":"h\xc3\xa9 \\u00e9"}],"x":1}'
    headers = [
        (b"authorization", b"Bearer upstream-key"),
        (b"openai-organization", b"org-1"),
        (b"user-agent", b"curl/8"),
        (b"x-api-key", b"k"),
        (b"anthropic-beta", b"tools-2024"),
        (b"cookie", b"secret=1"),
    ]
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(body=raw, headers=headers)
        request = await worker.expect(protocol.Request)
        assert request.body == raw.decode()
        assert request.is_streaming is False
        assert request.endpoint_path == "/v1/chat/completions"
        assert request.headers == {
            "authorization": "Bearer upstream-key",
            "openai-organization": "org-1",
            "x-api-key": "k",
            "anthropic-beta": "tools-2024",
            "content-type": "application/json",
        }
        await worker.answer(
            request.request_id,
            body='{"id":"cmpl-1","choices":[]}',
            headers={
                "content-type": "application/json",
                "x-request-id": "up-1",
                "connection": "keep-alive, x-hop",
                "x-hop": "1",
                "transfer-encoding": "chunked",
                "content-length": "999",
            },
        )
        status, headers_out, body = await call.response()
        assert status == 200
        assert body == b'{"id":"cmpl-1","choices":[]}'
        assert headers_out["x-request-id"] == "up-1"
        assert headers_out["content-length"] == str(len(body))
        assert "connection" not in headers_out and "x-hop" not in headers_out
        assert "transfer-encoding" not in headers_out


@pytest.mark.parametrize("status", [400, 404, 422, 500, 503])
async def test_upstream_errors_are_returned_as_they_were(provider, status):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, status=status, body='{"error":{"message":"up"}}')
        got, _, body = await call.response()
        assert got == status
        assert body == b'{"error":{"message":"up"}}'


async def test_streaming_chunks_are_flushed_one_by_one_in_order(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        assert request.is_streaming is True
        await worker.chunk(request.request_id, 'data: {"n":0}\n\n')
        assert await call.start() == 200
        assert call.headers["content-type"].startswith("text/event-stream")
        assert call.headers["cache-control"] == "no-cache"
        assert call.headers["x-accel-buffering"] == "no"
        assert await call.chunk() == (b'data: {"n":0}\n\n', True)
        for n in (1, 2, 3):  # each chunk reaches the client before the next is sent
            await worker.chunk(request.request_id, f'data: {{"n":{n}}}\n\n')
            assert await call.chunk() == (f'data: {{"n":{n}}}\n\n'.encode(), True)
        await worker.chunk(request.request_id, "data: [DONE]\n\n")
        await worker.answer(
            request.request_id, body="", headers={"content-type": "text/event-stream"}
        )
        assert await call.read_rest() == b"data: [DONE]\n\n"
        await call.finished()
    assert total_load() == 0


async def test_streaming_upstream_error_before_any_chunk_is_a_normal_response(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post("/v1/messages", body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.answer(
            request.request_id,
            status=429,
            body='{"type":"error","error":{"type":"rate_limit_error"}}',
        )
        status, headers, body = await call.response()
        assert status == 429
        assert headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["type"] == "rate_limit_error"


async def test_five_mebibyte_bodies_make_the_round_trip(provider):
    content = "é" * (5 * 1024 * 1024 // 2)
    big = json.dumps(chat(messages=[{"role": "user", "content": content}]))
    answer = json.dumps({"choices": [{"message": {"content": content}}]})
    async with FakeWorker() as worker:
        await worker.register()
        call = await HttpCall("POST", "/v1/chat/completions", big).send(split=65536)
        request = await worker.expect(protocol.Request, timeout=10)
        assert len(request.body.encode()) == len(big.encode()) >= 5 * 1024 * 1024
        assert request.body == big
        await worker.answer(request.request_id, body=answer)
        status, _, body = await call.response(timeout=10)
        assert status == 200 and body == answer.encode()


async def test_responses_route_and_models_listing(provider):
    async with FakeWorker() as worker:
        await worker.register(["b-model", "a-model"])
        call = await post("/v1/responses", body={"model": "a-model", "input": "hi"})
        request = await worker.expect(protocol.Request)
        assert request.endpoint_path == "/v1/responses"
        await worker.answer(request.request_id, body='{"object":"response"}')
        assert (await call.response())[2] == b'{"object":"response"}'

        status, listing = await (await HttpCall("GET", "/v1/models").send()).json()
        assert status == 200 and listing["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"]) for m in listing["data"]] == [
            ("a-model", "model", "local"),
            ("b-model", "model", "local"),
        ]
        status, one = await (await HttpCall("GET", "/v1/models/a-model").send()).json()
        assert (status, one["id"]) == (200, "a-model")
        status, missing = await (await HttpCall("GET", "/v1/models/zzz").send()).json()
        assert status == 404 and missing["error"]["code"] == "model_not_found"
        anthropic = [(b"anthropic-version", b"2023-06-01")]
        status, listing = await (
            await HttpCall("GET", "/v1/models", headers=anthropic).send()
        ).json()
        assert [m["type"] for m in listing["data"]] == ["model", "model"]
        assert listing["has_more"] is False


async def test_health_reports_workers_queue_and_uptime(provider):
    async with FakeWorker() as worker:
        await worker.register()
        status, health = await (await HttpCall("GET", "/health").send()).json()
    assert status == 200
    assert set(health) == {"status", "version", "workers_connected", "queue_depth", "uptime_secs"}
    assert health["status"] == "ok" and health["workers_connected"] == 1
    assert health["queue_depth"] == 0 and health["uptime_secs"] >= 0


# -- queueing, capacity, timeouts ----------------------------------------------


async def test_a_full_queue_answers_429_with_retry_after(fresh_runtime):
    await make_provider(max_queue_len=1)
    async with FakeWorker() as worker:
        await worker.register()
        first = await post()
        await worker.expect(protocol.Request)
        second = await post()
        await until(lambda: relay().queue_depth() == 1)
        status, headers, body = await (await post()).response()
        assert status == 429
        assert headers["retry-after"] == "1"
        assert (
            json.loads(body)["error"]["message"] == "Service temporarily at capacity, please retry"
        )
        await first.disconnect()
        await second.disconnect()


async def test_queued_requests_are_dispatched_when_capacity_frees(provider):
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=1)
        first = await post(body=chat(n=1))
        second = await post(body=chat(n=2))
        r1 = await worker.expect(protocol.Request)
        await worker.answer(r1.request_id, body="one")
        r2 = await worker.expect(protocol.Request)
        assert json.loads(r2.body)["n"] == 2
        await worker.answer(r2.request_id, body="two")
        assert (await first.response())[2] == b"one"
        assert (await second.response())[2] == b"two"


async def test_queue_timeout_answers_504(fresh_runtime):
    await make_provider(queue_timeout_secs=0.05, declared_models="m")
    status, _, body = await (await post()).response()
    assert status == 504
    assert json.loads(body)["error"]["message"] == "Request timed out waiting for worker"


async def test_request_timeout_answers_504_and_cancels_the_worker(fresh_runtime):
    await make_provider(request_timeout_secs=0.05)
    async with FakeWorker() as worker:
        await worker.register()
        call = await post()
        request = await worker.expect(protocol.Request)
        status, _, _ = await call.response()
        assert status == 504
        assert await worker.expect(protocol.Cancel) == protocol.Cancel(
            request_id=request.request_id, reason="timeout"
        )
        assert total_load() == 0


async def test_provider_disabled_while_requests_wait_gets_503(fresh_runtime):
    from workers_app.models import Provider

    await make_provider(declared_models="m")
    call = await post()
    await until(lambda: relay().queue_depth() == 1)
    await Provider.objects.filter(name="local").aupdate(enabled=False)
    control.providers_changed()
    status, headers, body = await call.response()
    assert status == 503
    assert headers["retry-after"]
    assert json.loads(body)["error"]["message"] == "Provider is currently disabled"
    status, _, _ = await (await post()).response()
    assert status == 503


async def test_provider_deleted_while_requests_wait_gets_generic_503(fresh_runtime):
    provider = await make_provider(declared_models="m")
    call = await post()
    await until(lambda: relay().queue_depth() == 1)
    await provider.adelete()
    status, _, body = await call.response()
    assert status == 503
    assert json.loads(body)["error"]["message"] == "Service temporarily unavailable, please retry"


# -- cancellation ----------------------------------------------------------------


async def test_client_gone_while_queued_never_reaches_a_worker(provider):
    async with FakeWorker() as worker:
        await worker.register()
        busy = await post(body=chat(n=1))
        first = await worker.expect(protocol.Request)
        queued = await post(body=chat(n=2))
        await until(lambda: relay().queue_depth() == 1)
        await queued.disconnect()
        assert relay().queue_depth() == 0
        await worker.answer(first.request_id)
        await busy.response()
        third = await post(body=chat(n=3))
        nxt = await worker.expect(protocol.Request)
        assert json.loads(nxt.body)["n"] == 3  # request 2 was never sent
        await worker.answer(nxt.request_id)
        await third.response()


async def test_client_gone_while_waiting_for_an_answer_cancels_the_worker(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post()
        request = await worker.expect(protocol.Request)
        await call.disconnect()
        assert await worker.expect(protocol.Cancel) == protocol.Cancel(
            request_id=request.request_id, reason="client_disconnect"
        )
        assert total_load() == 0
        await worker.answer(request.request_id)  # late: dropped, nothing breaks


async def test_client_gone_mid_stream_cancels_the_worker_and_frees_the_slot(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "data: 1\n\n")
        await call.start()
        await call.chunk()
        await call.disconnect()
        cancel = await worker.expect(protocol.Cancel)
        assert cancel.reason == "client_disconnect"
        assert total_load() == 0
        await worker.chunk(request.request_id, "data: late\n\n")  # dropped
        second = await post()
        nxt = await worker.expect(protocol.Request)
        await worker.answer(nxt.request_id)
        assert (await second.response())[0] == 200


#: A stream's last event per API, and a chunk before it that only mentions it.
LAST_EVENTS = [
    ("/v1/chat/completions", 'data: {"c":"data: [DONE]"}\n\n', "data: [DONE]\n\n"),
    (
        "/v1/messages",
        'event: message_delta\ndata: {"type":"message_delta","text":"message_stop"}\n\n',
        'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ),
    (
        "/v1/responses",
        'event: response.output_text.done\ndata: {"text":"response.completed"}\n\n',
        'event: response.completed\ndata: {"type":"response.completed"}\n\n',
    ),
]


@pytest.mark.parametrize(("path", "before", "last"), LAST_EVENTS)
async def test_a_client_that_leaves_after_the_last_event_cancels_nothing_and_is_charged(
    provider, path, before, last
):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(path, body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, before)
        await call.start()
        assert await call.chunk() == (before.encode(), True)
        # The end, cut in two where a marker could be missed.
        cut = len(last) // 3
        await worker.chunk(request.request_id, last[:cut])
        await worker.chunk(request.request_id, last[cut:])
        seen = b""
        while seen != last.encode():
            seen += (await call.chunk())[0]
        # The SDKs hang up here, often before the worker's completion arrives.
        await call.comm.send_input({"type": "http.disconnect"})
        await until(lambda: relay().stats.left_after_end == 1)
        assert total_load() == 1  # still in flight: the completion is awaited
        await worker.answer(request.request_id, body="", prompt_tokens=7, completion_tokens=5)
        await call.finished()
        stats = relay().stats
        assert dict(stats.by_outcome) == {"ok": 1} and stats.cancels == {}
        assert (stats.tokens_total("prompt"), stats.tokens_total("completion")) == (7, 5)
        assert total_load() == 0
        second = await post()
        # No cancel was sent: the next frame is the next request.
        nxt = await worker.expect(protocol.Request)
        await worker.answer(nxt.request_id)
        assert (await second.response())[0] == 200


async def test_a_completion_that_does_not_come_within_the_grace_is_cancelled(provider, settings):
    settings.STREAM_END_GRACE_SECS = 0.05
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "data: [DONE]\n\n")
        await call.start()
        await call.chunk()
        await call.comm.send_input({"type": "http.disconnect"})
        cancel = await worker.expect(protocol.Cancel)
        assert cancel == protocol.Cancel(request_id=request.request_id, reason="client_disconnect")
        await call.finished()
        assert relay().stats.left_after_end == 1 and total_load() == 0
        assert dict(relay().stats.by_outcome) == {"cancelled": 1}


@pytest.mark.parametrize(("path", "before", "last"), LAST_EVENTS)
async def test_a_client_that_leaves_before_the_last_event_still_cancels(
    provider, path, before, last
):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(path, body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, before)  # mentions the end, is not it
        await call.start()
        await call.chunk()
        await call.disconnect()
        cancel = await worker.expect(protocol.Cancel)
        assert cancel == protocol.Cancel(request_id=request.request_id, reason="client_disconnect")
        assert relay().stats.left_after_end == 0 and total_load() == 0
        assert dict(relay().stats.by_outcome) == {"cancelled": 1}


# -- worker loss -----------------------------------------------------------------


async def test_a_request_survives_its_worker_dying(provider):
    async with FakeWorker(client=("192.0.2.1", 1)) as doomed:
        await doomed.register(name="doomed")
        call = await post()
        await doomed.expect(protocol.Request)
    async with FakeWorker(client=("192.0.2.2", 2)) as rescuer:
        await rescuer.register(name="rescuer")
        request = await rescuer.expect(protocol.Request)
        await rescuer.answer(request.request_id, body="rescued")
        assert (await call.response())[2] == b"rescued"


async def test_requeue_is_capped_then_503(provider, settings):
    settings.MAX_REQUEUE_COUNT = 1
    await runtime.reset()
    call = None
    for attempt in range(2):
        async with FakeWorker(client=("192.0.2.1", attempt)) as worker:
            await worker.register()
            if call is None:
                call = await post()
            await worker.expect(protocol.Request)
    assert call is not None
    status, _, body = await call.response()
    assert status == 503
    assert (
        json.loads(body)["error"]["message"]
        == "Request could not be processed after multiple attempts"
    )


async def test_a_stream_cut_by_worker_loss_ends_with_an_sse_error_event(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post("/v1/messages", body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "event: message_start\ndata: {}\n\n")
        await call.start()
        assert await call.chunk() == (b"event: message_start\ndata: {}\n\n", True)
    tail = await call.read_rest()
    assert tail.startswith(b"event: error\ndata: ")
    assert json.loads(tail.split(b"data: ", 1)[1])["error"]["type"] == "overloaded_error"
    assert relay().queue_depth() == 0


async def test_stream_ceiling_ends_the_stream_with_an_error_event(provider, settings):
    settings.MAX_STREAM_BYTES = 16
    await runtime.reset()
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(body=chat(stream=True))
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "data: 0123456\n\n")
        await call.start()
        await call.chunk()
        await worker.chunk(request.request_id, "data: 789abcdef\n\n")
        tail = await call.read_rest()
        assert json.loads(tail[len(b"data: ") :])["error"]["code"] == "stream_too_large"
        assert (await worker.expect(protocol.Cancel)).request_id == request.request_id


async def test_draining_lets_the_in_flight_request_finish(provider):
    async with FakeWorker() as worker:
        ack = await worker.register(max_concurrent=2)
        call = await post()
        request = await worker.expect(protocol.Request)
        relay().drain_worker(ack.worker_id, timeout=10)
        await worker.expect(protocol.GracefulShutdown)
        await worker.answer(request.request_id, body="finished")
        assert (await call.response())[2] == b"finished"
        assert await worker.wait_closed() == (1000, "worker drained")


async def test_bad_worker_frames_never_leak_slots_or_reach_other_clients(provider):
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=2)
        call = await post()
        request = await worker.expect(protocol.Request)
        await worker.chunk("r-not-yours", "data: stolen\n\n")
        await worker.answer("r-not-yours")
        await worker.answer(request.request_id, body="real")
        await worker.answer(request.request_id, body="duplicate")
        await worker.chunk(request.request_id, "after completion")
        assert (await call.response())[2] == b"real"
        bad_status = await post()
        second = await worker.expect(protocol.Request)
        await worker.answer(second.request_id, status=42)
        status, _, _ = await bad_status.response()
        assert status == 502
        await worker.send(protocol.Error(request_id="r-unknown", message="?"))
        await until(lambda: relay().stats.dropped_frames == 5)
        assert total_load() == 0


async def test_worker_error_report_fails_that_request_with_502(provider):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post("/v1/messages", body=chat())
        request = await worker.expect(protocol.Request)
        await worker.send(
            protocol.Error(request_id=request.request_id, message="CUDA OOM at 0xdead")
        )
        status, _, body = await call.response()
        assert status == 502
        assert b"CUDA" not in body  # worker internals are not echoed to clients
        assert json.loads(body)["error"]["type"] == "api_error"


async def test_shutdown_answers_503_to_new_requests(provider):
    relay().shutting_down = True
    status, headers, _ = await (await post()).response()
    assert status == 503 and headers["retry-after"]
    status, health = await (await HttpCall("GET", "/health").send()).json()
    assert status == 503 and health["status"] == "draining"


async def test_cors_is_off_by_default_and_on_when_configured(provider, settings):
    origin = [(b"origin", b"https://chat.example")]
    status, headers, _ = await (await post(body=chat("nope"), headers=origin)).response()
    assert "access-control-allow-origin" not in headers
    settings.CORS_ALLOWED_ORIGINS = ["https://chat.example"]
    await runtime.reset()
    preflight = await HttpCall("OPTIONS", "/v1/chat/completions", headers=origin).send()
    status, headers, _ = await preflight.response()
    assert status == 204
    assert headers["access-control-allow-origin"] == "https://chat.example"
    assert "authorization" in headers["access-control-allow-headers"]
    status, headers, _ = await (await post(body=chat("nope"), headers=origin)).response()
    assert headers["access-control-allow-origin"] == "https://chat.example"
