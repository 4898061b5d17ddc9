"""What a hostile worker or client cannot do through the relay's own paths (SPEC §4, §5):
each test replays an attack through the real ASGI application."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from keys.services import create_key
from relay.server import control, runtime
from relay.server.http import request as http
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


async def post(path: str = "/v1/chat/completions", body: Any = None, **kwargs: Any) -> HttpCall:
    return await HttpCall("POST", path, chat() if body is None else body, **kwargs).send()


# -- hostile workers ---------------------------------------------------------------


@pytest.mark.parametrize("status", [100, 101, 103, 199])
async def test_an_informational_status_from_a_worker_is_a_502_not_a_second_response(
    provider, status
):
    smuggled = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    async with FakeWorker() as worker:
        await worker.register()
        call = await post()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, status=status, body=smuggled)
        status_out, _, body = await call.response()
        assert status_out == 502
        assert b"HTTP/1.1" not in body
        assert json.loads(body)["error"]["code"] == "worker_error"
        # The worker is still trusted with the next request: only that answer failed.
        nxt = await post()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, body="fine")
        assert (await nxt.response())[2] == b"fine"


@pytest.mark.parametrize("status", [204, 304])
async def test_statuses_without_a_body_go_out_without_one(provider, status):
    async with FakeWorker() as worker:
        await worker.register()
        call = await post()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, status=status, body="HTTP/1.1 200 OK\r\n\r\nx")
        status_out, headers, body = await call.response()
        assert (status_out, body) == (status, b"")
        assert "content-length" not in headers


async def test_worker_headers_cannot_set_cookies_or_cors_and_responses_say_nosniff(
    provider, settings
):
    settings.CORS_ALLOWED_ORIGINS = ["https://app.example"]
    await runtime.reset()
    async with FakeWorker() as worker:
        await worker.register()
        call = await post(headers=[(b"origin", b"https://app.example")])
        request = await worker.expect(protocol.Request)
        await worker.answer(
            request.request_id,
            headers={
                "content-type": "application/json",
                "Set-Cookie": "sessionid=planted; Path=/",
                "set-cookie2": "x=1",
                "Access-Control-Allow-Origin": "*",
                "access-control-allow-credentials": "true",
                "x-upstream": "kept",
                "x-odd": "a\x7fb",
                "x-bell": "ring\x07",
            },
        )
        status, headers, _ = await call.response()
    assert status == 200
    assert not any(k.startswith("set-cookie") for k in headers)
    origins = [v for k, v in call.raw_headers if k == "access-control-allow-origin"]
    assert origins == ["https://app.example"]  # the relay's own, once
    assert "access-control-allow-credentials" not in headers
    assert headers["x-upstream"] == "kept"
    assert "x-odd" not in headers and "x-bell" not in headers  # control characters
    assert headers["x-content-type-options"] == "nosniff"
    for path, method in (("/health", "GET"), ("/v1/models", "GET"), ("/metrics", "GET")):
        status, headers, _ = await (await HttpCall(method, path).send()).response()
        assert headers["x-content-type-options"] == "nosniff", path


# -- hostile clients ---------------------------------------------------------------


async def test_a_relay_key_never_reaches_a_worker_whichever_header_carries_it(provider, settings):
    settings.MODELRELAY_REQUIRE_API_KEYS = True
    await runtime.reset()
    key = await sync_to_async(create_key)("client")
    other = await sync_to_async(create_key)("another")
    async with FakeWorker() as worker:
        await worker.register()
        attempts = [
            (
                "/v1/chat/completions",
                [
                    (b"authorization", f"Bearer {key.secret}".encode()),
                    (b"x-api-key", key.secret.encode()),
                ],
            ),
            (
                "/v1/chat/completions",
                [
                    (b"authorization", f"Bearer {key.secret}".encode()),
                    (b"x-api-key", other.secret.encode()),
                ],
            ),
            (
                "/v1/messages",
                [
                    (b"x-api-key", key.secret.encode()),
                    (b"authorization", f"Bearer {other.secret}".encode()),
                ],
            ),
            (
                "/v1/messages",
                [
                    (b"x-api-key", key.secret.encode()),
                    (b"authorization", b"Bearer mrk_revoked-or-made-up"),
                ],
            ),
        ]
        for path, headers in attempts:
            call = await post(path, headers=headers)
            request = await worker.expect(protocol.Request)
            assert "authorization" not in request.headers, path
            assert "x-api-key" not in request.headers, path
            await worker.answer(request.request_id)
            assert (await call.response())[0] == 200
        # A backend's own key (not a relay key) is still forwarded next to the relay's.
        call = await post(
            "/v1/messages",
            headers=[
                (b"authorization", f"Bearer {key.secret}".encode()),
                (b"x-api-key", b"sk-backend-key"),
            ],
        )
        request = await worker.expect(protocol.Request)
        assert request.headers["x-api-key"] == "sk-backend-key"
        assert "authorization" not in request.headers
        await worker.answer(request.request_id)
        await call.response()


async def test_huge_model_names_are_refused_and_never_kept(provider, settings):
    huge = "m" * (4 * 1024 * 1024)
    status, document = await (await post(body={"model": huge})).json()
    assert status == 400
    assert document["error"]["message"] == "'model' is longer than 256 characters"
    status, document = await (await post(body={"model": "x" * 256})).json()
    assert status == 404
    assert len(document["error"]["message"]) < 300
    relay = runtime.current().relay
    assert all(len(r.model) <= 256 for r in relay.stats.recent)
    assert all(len(model) <= 256 for _, model, _ in relay.stats.by_endpoint_model_outcome)
    status, document = await (await HttpCall("GET", "/v1/models/" + "y" * 5000).send()).json()
    assert status == 404
    assert len(document["error"]["message"]) < 300


async def test_the_fast_path_applies_allowed_hosts(provider, settings):
    settings.ALLOWED_HOSTS = ["relay.example", "127.0.0.1"]
    http.reset_hosts()
    try:
        for path, method in (
            ("/v1/chat/completions", "POST"),
            ("/v1/models", "GET"),
            ("/v1/models/m", "GET"),
            ("/health", "GET"),
            ("/metrics", "GET"),
        ):
            rebound = HttpCall(method, path, chat(), headers=[(b"host", b"attacker.example")])
            status, document = await (await rebound.send()).json()
            assert status == 400, path
            assert document["error"]["message"] == "Invalid Host header"
        good = HttpCall("GET", "/health", headers=[(b"host", b"relay.example:8080")])
        assert (await (await good.send()).json())[0] == 200
    finally:
        http.reset_hosts()


async def test_an_inference_body_without_a_json_content_type_gets_415(provider):
    for content_type in (None, b"text/plain", b"application/x-www-form-urlencoded"):
        call = await post(content_type=content_type)
        status, document = await call.json()
        assert status == 415
        assert document["error"]["message"] == "Content-Type must be application/json"
    call = await post(content_type=b"application/json; charset=utf-8", body={"model": "nope"})
    assert (await call.json())[0] == 404


async def test_a_worker_cannot_squat_a_model_another_provider_declared_exclusive(provider):
    owner_secret = "mrw_owner-secret"
    await make_provider("owner", owner_secret, exclusive_models="m\nm2")
    control.providers_changed()
    await until(lambda: "m" in runtime.current().relay.reserved)
    async with (
        FakeWorker() as squatter,
        FakeWorker(provider="owner", secret=owner_secret, client=("192.0.2.9", 9)) as owner,
    ):
        ack = await squatter.register(["m", "mine"], max_concurrent=4)
        assert ack.models == ["mine"]
        assert ack.warnings == ["not acked, reserved for another provider: 'm'"]
        call = await post()  # model "m": waits for its owner, never goes to the squatter
        await owner.register(["m"])
        request = await owner.expect(protocol.Request)
        await owner.answer(request.request_id, body="from the owner")
        assert (await call.response())[2] == b"from the owner"
        models = await (await HttpCall("GET", "/v1/models").send()).json()
        owned = {m["id"]: m["owned_by"] for m in models[1]["data"]}
        assert owned == {"m": "owner", "m2": "owner", "mine": "local"}


async def test_two_providers_cannot_both_claim_a_model_exclusively(provider):
    from django.core.exceptions import ValidationError

    from workers_app.models import Provider

    await make_provider("first", "mrw_first-secret", exclusive_models="m")
    second = Provider(name="second", exclusive_models="x, m")
    with pytest.raises(ValidationError, match="Already exclusive to provider 'first': m"):
        await sync_to_async(second.full_clean)()
