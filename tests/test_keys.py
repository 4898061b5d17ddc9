"""Client API keys on the inference routes (SPEC §8)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from keys.models import ApiKey
from keys.services import create_key, revoke_key
from relay.core.keycache import KeyCache, KnownKey
from relay.server import runtime
from relay.wire import protocol
from relay.wire.errors import Unauthorized
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def keyed(fresh_runtime, settings):
    settings.MODELRELAY_REQUIRE_API_KEYS = True
    await make_provider()
    return await sync_to_async(create_key)("ci")


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


def test_the_cache_checks_prefix_and_hmac():
    from relay.core.credentials import hash_secret

    cache = KeyCache("pepper")
    secret = "mrk_abcdefgh12345678"
    cache.replace({secret[:12]: KnownKey(id=7, key_hash=hash_secret(secret, "pepper"))})
    assert cache.verify(secret) == 7
    assert cache.verify(secret + "x") is None
    assert cache.verify("mrk_zzzzzzzz12345678") is None
    with pytest.raises(Unauthorized, match="Missing API key"):
        cache.authenticate([], "openai")
    with pytest.raises(Unauthorized, match="Invalid or revoked"):
        cache.authenticate([(b"authorization", b"Bearer nope")], "openai")
    assert cache.authenticate([(b"x-api-key", secret.encode())], "anthropic") == (
        7,
        frozenset({"x-api-key"}),
    )
    with pytest.raises(Unauthorized):  # x-api-key only counts on the Anthropic route
        cache.authenticate([(b"x-api-key", secret.encode())], "openai")


@pytest.mark.parametrize(
    ("path", "headers", "message"),
    [
        ("/v1/chat/completions", [], "Missing API key: send Authorization: Bearer <key>"),
        (
            "/v1/chat/completions",
            [(b"authorization", b"Bearer mrk_notakey")],
            "Invalid or revoked API key (sent in Authorization: Bearer)",
        ),
        (
            "/v1/chat/completions",
            [(b"authorization", b"Basic dXNlcjpwYXNz")],
            "Authorization must use the Bearer scheme: send Authorization: Bearer <key>",
        ),
        (
            "/v1/chat/completions",
            [(b"x-api-key", b"mrk_sent-where-it-is-not-read")],
            "x-api-key is accepted on /v1/messages only; this route takes "
            "Authorization: Bearer <key>",
        ),
        (
            "/v1/messages",
            [],
            "Missing API key: send x-api-key: <key> or Authorization: Bearer <key>",
        ),
        (
            "/v1/messages",
            [(b"x-api-key", b"mrk_notakey")],
            "Invalid or revoked API key (sent in x-api-key)",
        ),
    ],
)
async def test_requests_without_a_valid_key_get_401(keyed, path, headers, message):
    anthropic = path.startswith("/v1/messages")
    call = await HttpCall("POST", path, chat(), headers=headers).send()
    status, response_headers, body = await call.response()
    document = json.loads(body)
    assert status == 401
    if anthropic:
        assert document["type"] == "error"
        assert document["error"] == {"type": "authentication_error", "message": message}
    else:
        assert document["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    assert response_headers["www-authenticate"] == "Bearer"
    # The same shape on GET /v1/models, in the same envelope.
    models_headers = headers + ([(b"anthropic-version", b"2023-06-01")] if anthropic else [])
    call = await HttpCall("GET", "/v1/models", headers=models_headers).send()
    status, models_response_headers, body = await call.response()
    assert status == 401
    assert json.loads(body) == document
    assert models_response_headers == response_headers
    status, _ = await (await HttpCall("GET", "/health").send()).json()
    assert status == 200  # never on /health


async def test_a_valid_key_passes_and_is_not_forwarded(keyed):
    async with FakeWorker() as worker:
        await worker.register()
        call = await HttpCall(
            "POST", "/v1/chat/completions", chat(), headers=bearer(keyed.secret)
        ).send()
        request = await worker.expect(protocol.Request)
        assert "authorization" not in request.headers
        await worker.answer(request.request_id, prompt_tokens=5, completion_tokens=7)
        assert (await call.response())[0] == 200


async def test_anthropic_clients_may_use_x_api_key(keyed):
    async with FakeWorker() as worker:
        await worker.register()
        headers = [(b"x-api-key", keyed.secret.encode()), (b"anthropic-version", b"2023-06-01")]
        call = await HttpCall("POST", "/v1/messages", chat(), headers=headers).send()
        request = await worker.expect(protocol.Request)
        assert "x-api-key" not in request.headers
        assert request.headers["anthropic-version"] == "2023-06-01"
        await worker.answer(request.request_id)
        assert (await call.response())[0] == 200
        missing = await HttpCall("POST", "/v1/messages", chat()).send()
        status, document = await missing.json()
        assert status == 401 and document["error"]["type"] == "authentication_error"


async def test_a_revoked_key_is_refused_at_once(keyed):
    headers = bearer(keyed.secret)
    status, _ = await (await HttpCall("GET", "/v1/models", headers=headers).send()).json()
    assert status == 200
    await sync_to_async(revoke_key)(keyed.key)
    await runtime.current().sync()  # what the signal-triggered reload does
    status, document = await (await HttpCall("GET", "/v1/models", headers=headers).send()).json()
    assert status == 401
    assert document["error"]["message"].startswith("Invalid or revoked API key")


async def test_keys_created_elsewhere_are_seen_by_the_next_sync(keyed):
    rt = runtime.current()
    await rt.ready()
    other = await sync_to_async(create_key)("made-by-another-process")
    await rt.sync()
    status, _ = await (
        await HttpCall("GET", "/v1/models", headers=bearer(other.secret)).send()
    ).json()
    assert status == 200


async def test_usage_and_last_used_are_written_off_the_hot_path(keyed):
    async with FakeWorker() as worker:
        await worker.register()
        for _ in range(2):
            call = await HttpCall(
                "POST", "/v1/chat/completions", chat(), headers=bearer(keyed.secret)
            ).send()
            request = await worker.expect(protocol.Request)
            await worker.answer(request.request_id, prompt_tokens=5, completion_tokens=7)
            await call.response()
    key = await ApiKey.objects.aget(id=keyed.key.id)
    assert key.last_used_at is None and key.requests == 0  # nothing written per request
    await runtime.current().bookkeeper.flush()
    key = await ApiKey.objects.aget(id=keyed.key.id)
    assert key.requests == 2
    assert (key.prompt_tokens, key.completion_tokens) == (10, 14)
    assert key.last_used_at is not None


async def test_keys_are_stored_as_prefix_and_hmac_only(keyed):
    key = await ApiKey.objects.aget(id=keyed.key.id)
    assert keyed.secret.startswith("mrk_")
    assert key.prefix == keyed.secret[:12]
    assert keyed.secret not in json.dumps(
        {f.name: str(getattr(key, f.name)) for f in ApiKey._meta.fields}
    )


# -- limits (SPEC §13) ----------------------------------------------------------------

ADMIN = [(b"authorization", b"Bearer keys-admin")]


async def admin_call(method: str, path: str, body: Any = b"") -> tuple[int, Any]:
    call = await HttpCall(method, path, body, headers=ADMIN).send()
    status, _, raw = await call.response()
    return status, json.loads(raw) if raw else None


async def test_keys_are_created_with_limits_and_changed_through_the_admin_api(keyed, settings):
    settings.MODELRELAY_ADMIN_TOKEN = "keys-admin"
    status, made = await admin_call(
        "POST",
        "/admin/keys",
        {
            "name": "team",
            "max_concurrent": 4,
            "requests_per_minute": 60,
            "tokens_per_day": 100_000,
            "allowed_models": ["llama3-8b", "qwen"],
            "expires_at": "2030-01-01T00:00:00Z",
            "weight": 3,
        },
    )
    assert status == 201, made
    assert made["allowed_models"] == ["llama3-8b", "qwen"] and made["weight"] == 3
    assert made["tokens_per_month"] is None
    key_id = made["id"]
    status, changed = await admin_call(
        "PATCH", f"/admin/keys/{key_id}", {"max_concurrent": None, "tokens_per_month": 5_000_000}
    )
    assert status == 200
    assert changed["max_concurrent"] is None and changed["tokens_per_month"] == 5_000_000
    assert changed["requests_per_minute"] == 60  # untouched
    await runtime.current().sync()
    limits = runtime.current().key_limits(key_id)
    assert limits.max_concurrent is None and limits.tokens_per_month == 5_000_000
    assert limits.allowed_models == {"llama3-8b", "qwen"} and limits.weight == 3
    status, listed = await admin_call("GET", "/admin/keys")
    assert [k["weight"] for k in listed if k["id"] == key_id] == [3]
    bad: dict[str, Any]
    for bad in ({"weight": 0}, {"max_concurrent": -1}, {"allowed_models": []}, {"name": None}):
        status, problem = await admin_call("PATCH", f"/admin/keys/{key_id}", bad)
        assert status == 400, (bad, problem)
    assert (await admin_call("PATCH", "/admin/keys/999999", {"weight": 2}))[0] == 404


async def test_limits_are_edited_in_the_django_admin(keyed):
    from django.contrib.auth.models import User
    from django.test import AsyncClient

    user = await sync_to_async(User.objects.create_superuser)("root", "root@example.com", "pw")
    client = AsyncClient()
    await client.aforce_login(user)
    url = f"/django-admin/keys/apikey/{keyed.key.id}/change/"
    page = (await client.get(url)).content.decode()
    assert "Limits (empty: no limit)" in page and 'name="tokens_per_day"' in page
    form = {
        "name": "ci",
        "max_concurrent": "2",
        "requests_per_minute": "",
        "tokens_per_day": "1000",
        "tokens_per_month": "",
        "allowed_models": "a, b\nc",
        "expires_at_0": "",
        "expires_at_1": "",
        "weight": "5",
        "default_class": "flex",
        "max_class": "default",
    }
    response = await client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    key = await ApiKey.objects.aget(id=keyed.key.id)
    assert (key.max_concurrent, key.tokens_per_day, key.weight) == (2, 1000, 5)
    assert (key.limits().default_class, key.limits().max_class) == ("flex", "default")
    assert key.allowed_model_list == ["a", "b", "c"]
    form["weight"] = "0"
    assert (await client.post(url, form)).status_code == 200  # the form, with the error
    listing = (await client.get("/django-admin/keys/apikey/")).content.decode()
    assert "2 at once, 1,000 tokens/day, 3 model(s)" in listing
