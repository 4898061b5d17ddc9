"""The old client API admitted like the /v1 routes, a key's slot given back on every way
out, and the JSON answers of the edge (401 shapes, paths nothing serves), through the
real ASGI application (SPEC §5, §12, §13)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from keys.services import create_key, update_key
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import SECRET, FakeWorker, HttpCall, app, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "edge-admission-admin"


@pytest.fixture
async def keyed(fresh_runtime, settings):
    settings.MODELRELAY_REQUIRE_API_KEYS = True
    settings.MODELRELAY_ADMIN_TOKEN = ADMIN
    await make_provider()


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


def old_chat(secret: str | None, model: str = "m", **document: Any) -> HttpCall:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **document}
    return HttpCall("POST", "/api/chat", body, headers=bearer(secret) if secret else [])


async def old_lines(call: HttpCall) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    status, headers, body = await (await call.send()).response()
    assert headers["content-type"] == "text/event-stream"
    return status, headers, [json.loads(line) for line in body.splitlines()]


async def serve_stream(worker: FakeWorker, prompt: int = 8, completion: int = 4) -> str:
    """Answer the next request as a streaming backend does, with its usage."""
    request = await worker.expect(protocol.Request)
    assert request.endpoint_path == "/v1/chat/completions" and request.is_streaming
    await worker.chunk(request.request_id, 'data: {"choices":[{"delta":{"content":"yes"}}]}\n\n')
    await worker.answer(
        request.request_id,
        body="data: [DONE]\n\n",
        headers={"content-type": "text/event-stream"},
        prompt_tokens=prompt,
        completion_tokens=completion,
    )
    return request.request_id


async def key_row(name: str) -> dict[str, Any]:
    call = await HttpCall("GET", "/admin/stats", headers=bearer(ADMIN)).send()
    _, stats = await call.json()
    (row,) = [row for row in stats["keys"] if row["name"] == name]
    return row


# -- /api/chat through every limit of its key -----------------------------------


async def test_the_old_api_goes_through_every_limit_of_the_key_and_is_charged(keyed):
    from workers_app.models import RequestLog

    tight = await sync_to_async(create_key)(
        "tight", max_concurrent=1, allowed_models=["m"], tokens_per_month=10
    )
    rt = runtime.current()
    async with FakeWorker() as worker:
        await worker.register(models=["m", "other"], max_concurrent=4)
        # No key, or a key that is not one: refused on the headers, with their status.
        for secret in (None, "mrk_not-a-key"):
            status, headers, lines = await old_lines(old_chat(secret))
            assert (status, lines) == (401, [{"err": "unauthorized"}])
            assert headers["www-authenticate"] == "Bearer"
        # A model the key may not use.
        status, _, lines = await old_lines(old_chat(tight.secret, "other"))
        assert (status, lines) == (403, [{"err": "unauthorized"}])
        # One at a time: the second is over the key's concurrency.
        first = await old_chat(tight.secret).send()
        running = await worker.expect(protocol.Request)
        status, headers, lines = await old_lines(old_chat(tight.secret))
        assert (status, lines) == (429, [{"err": "too many requests at once for this key"}])
        assert headers["retry-after"] == "1"
        await worker.chunk(running.request_id, 'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        await worker.answer(
            running.request_id,
            body="data: [DONE]\n\n",
            headers={"content-type": "text/event-stream"},
            prompt_tokens=8,
            completion_tokens=4,
        )
        status, _, body = await first.response()
        assert status == 200
        assert [json.loads(line) for line in body.splitlines()] == [{"o": "ok"}, {"done": True}]
        # Its 12 tokens spent the monthly budget of 10: the next one is refused.
        status, headers, lines = await old_lines(old_chat(tight.secret))
        assert (status, lines) == (429, [{"err": "token budget of this key spent"}])
        assert int(headers["retry-after"]) >= 1
    row = await key_row("tight")
    assert (row["tokens_today"], row["tokens_month"], row["requests"]) == (12, 12, 1)
    assert row["rejected_by"] == {
        "model_not_allowed": 1,
        "over_concurrency": 1,
        "over_monthly_budget": 1,
    }
    assert rt.limiter.open == {}
    await rt.bookkeeper.flush()
    served = [row async for row in RequestLog.objects.filter(api_key=tight.key, status=200)]
    assert [(r.endpoint, r.prompt_tokens, r.completion_tokens) for r in served] == [
        ("/v1/chat/completions", 8, 4)
    ]


async def test_the_old_api_keeps_to_the_request_rate_and_the_expiry_of_its_key(keyed):
    steady = await sync_to_async(create_key)("steady", requests_per_minute=1)
    async with FakeWorker() as worker:
        await worker.register()
        call = await old_chat(steady.secret).send()
        await serve_stream(worker)
        assert (await call.response())[0] == 200
        status, headers, lines = await old_lines(old_chat(steady.secret))
        assert (status, lines) == (429, [{"err": "rate limit of this key exceeded"}])
        assert int(headers["retry-after"]) >= 1

        past = dt.datetime.now(tz=dt.UTC) - dt.timedelta(seconds=1)
        await sync_to_async(update_key)(steady.key, expires_at=past)
        await runtime.current().sync()
        status, _, lines = await old_lines(old_chat(steady.secret))
        assert (status, lines) == (401, [{"err": "unauthorized"}])


# -- the key's slot on every way out ---------------------------------------------


class LegacyNode:
    """A node of the older broker on the ASGI app's ``/ws``: only what these tests need."""

    def __init__(self, model: str) -> None:
        query = f"name=old-box&model={model}&token={SECRET}&max_concurrency=1"
        self.comm = WebsocketCommunicator(app(), f"/ws?{query}")

    async def __aenter__(self) -> LegacyNode:
        connected, _ = await self.comm.connect(timeout=5)
        assert connected
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.comm.disconnect()


PATHS = ["/v1/chat/completions", "/api/chat"]


def request_to(path: str, secret: str, model: str = "m", **document: Any) -> HttpCall:
    if path == "/api/chat":
        return old_chat(secret, model, **document)
    return HttpCall("POST", path, chat(model, **document), headers=bearer(secret))


async def next_request_is_admitted(worker: FakeWorker, path: str, secret: str) -> None:
    """The key's one slot is free: a request of it reaches the worker and is answered."""
    call = await request_to(path, secret).send()
    request = await worker.expect(protocol.Request)
    if request.is_streaming:
        await worker.answer(request.request_id, body="data: [DONE]\n\n")
    else:
        await worker.answer(request.request_id)
    assert (await call.response())[0] == 200


@pytest.mark.parametrize("path", PATHS)
async def test_a_model_nobody_serves_gives_the_slot_back(keyed, path):
    one = await sync_to_async(create_key)("one", max_concurrent=1)
    async with FakeWorker() as worker:
        await worker.register()
        status, _, _ = await (await request_to(path, one.secret, "nobody-has-it").send()).response()
        assert status == 404
        await next_request_is_admitted(worker, path, one.secret)
    assert runtime.current().limiter.open == {}


@pytest.mark.parametrize("path", PATHS)
async def test_a_bug_while_submitting_gives_the_slot_back_and_answers_500(keyed, path, monkeypatch):
    one = await sync_to_async(create_key)("one", max_concurrent=1)
    relay = runtime.current().relay
    real = relay.submit
    calls: list[str] = []

    def broken(**kwargs: Any) -> Any:
        if not calls:
            calls.append(kwargs["model"])
            raise RuntimeError("a bug")
        return real(**kwargs)

    monkeypatch.setattr(relay, "submit", broken)
    async with FakeWorker() as worker:
        await worker.register()
        status, _, body = await (await request_to(path, one.secret).send()).response()
        assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
        await next_request_is_admitted(worker, path, one.secret)
    assert calls == ["m"]
    assert runtime.current().limiter.open == {}


async def test_a_400_digit_temperature_for_a_legacy_node_is_a_400_and_gives_the_slot_back(
    keyed,
):
    one = await sync_to_async(create_key)("one", max_concurrent=1)
    huge = int("9" * 400)
    async with FakeWorker() as worker, LegacyNode("old"):
        await worker.register()
        await until(lambda: "old" in runtime.current().relay.routable_models())
        call = request_to("/v1/chat/completions", one.secret, "old", temperature=huge)
        status, _, body = await (await call.send()).response()
        assert status == 400
        assert "'temperature' must be a number from 0 to 2" in json.loads(body)["error"]["message"]
        # The old API bounds it before it is even admitted.
        status, _, lines = await old_lines(old_chat(one.secret, "old", temperature=huge))
        assert (status, lines) == (400, [{"err": "invalid request"}])
        for path in PATHS:
            await next_request_is_admitted(worker, path, one.secret)
    assert runtime.current().limiter.open == {}


@pytest.mark.parametrize("path", PATHS)
async def test_a_client_leaving_while_queued_gives_the_slot_back(keyed, path):
    one = await sync_to_async(create_key)("one", max_concurrent=1)
    other = await sync_to_async(create_key)("other")
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=1)
        busy = await request_to(path, other.secret).send()
        holding = await worker.expect(protocol.Request)
        queued = await request_to(path, one.secret).send()
        rt = runtime.current()
        await until(lambda: rt.relay.queue_depth() == 1)
        await queued.disconnect()
        await until(lambda: rt.relay.queue_depth() == 0)
        await worker.answer(holding.request_id, body="data: [DONE]\n\n")
        assert (await busy.response())[0] == 200
        await next_request_is_admitted(worker, path, one.secret)
    assert runtime.current().limiter.open == {}


# -- paths nothing serves --------------------------------------------------------


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/apply-template", "/props"])
async def test_paths_a_backend_serves_but_the_relay_does_not_route_get_a_json_404(
    fresh_runtime, path
):
    await make_provider()
    call = await HttpCall("POST", path, {"content": "hello"}).send()
    status, headers, body = await call.response()
    assert status == 404 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == {
        "message": f"No route for POST {path}",
        "type": "invalid_request_error",
        "code": "not_found",
    }
    anthropic = [(b"anthropic-version", b"2023-06-01")]
    status, document = await (await HttpCall("GET", path, headers=anthropic).send()).json()
    assert status == 404
    assert document == {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"No route for GET {path}"},
    }


async def test_the_pages_django_serves_are_still_served(fresh_runtime):
    await make_provider()
    status, headers, _ = await (await HttpCall("GET", "/setup").send()).response()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    status, headers, _ = await (await HttpCall("GET", "/dashboard").send()).response()
    assert status == 302  # staff login first: Django's page, not a 404


# -- pongs of the reference's widths ----------------------------------------------


async def test_a_pong_the_reference_allows_keeps_the_worker_and_one_it_does_not_closes_it(
    fresh_runtime,
):
    await make_provider()
    rt = runtime.current()
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=2)
        # Microseconds, and the widest load a u32 holds: clamped, not a protocol error.
        await worker.send(
            {"type": "pong", "current_load": 2**32 - 1, "timestamp_unix_ms": 2**64 - 1}
        )
        (registered,) = rt.relay.registry.workers.values()
        await until(lambda: registered.reported_load == protocol.MAX_COUNT)
        await worker.send(
            {"type": "pong", "current_load": 0, "timestamp_unix_ms": 1_700_000_000_000_000}
        )
        await until(lambda: registered.reported_load == 0)
        call = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id)
        assert (await call.response())[0] == 200
        # Past a u64: what the reference could never have sent.
        await worker.send({"type": "pong", "current_load": 0, "timestamp_unix_ms": 2**64})
        assert (await worker.wait_closed())[0] == 1002


async def test_a_chunked_body_for_a_django_page_is_cut_off_at_djangos_limit(
    fresh_runtime, settings
):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 256 * 1024
    await make_provider()
    form = b"application/x-www-form-urlencoded"
    chunked = [(b"transfer-encoding", b"chunked")]
    call = HttpCall(
        "POST", "/django-admin/login/", b"a=" + b"x" * (600 * 1024), chunked, content_type=form
    )
    status, headers, body = await (await call.send(split=64 * 1024)).response()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["message"] == "Request body is larger than 262144 bytes"
    # Under the limit Django answers as ever (here: no CSRF token).
    small = HttpCall("POST", "/django-admin/login/", b"a=b", chunked, content_type=form)
    status, headers, _ = await (await small.send()).response()
    assert status == 403 and "connection" not in headers
