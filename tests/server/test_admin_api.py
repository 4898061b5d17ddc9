"""The admin JSON API, request log, metrics and the Django admin pages (SPEC §8)."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async

from keys.models import ApiKey
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "admin-token-for-tests"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]


@pytest.fixture
async def admin(fresh_runtime, settings):
    settings.MODELRELAY_ADMIN_TOKEN = TOKEN
    return await make_provider()


async def call(method: str, path: str, body=b"", headers=AUTH):
    return await (await HttpCall(method, path, body, headers=headers).send()).response()


async def get_json(path: str):
    status, _, body = await call("GET", path)
    return status, json.loads(body)


# -- auth -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/admin/workers", "/admin/stats", "/admin/keys"])
async def test_admin_routes_need_the_token(admin, settings, path):
    assert (await call("GET", path, headers=[]))[0] == 403
    wrong = [(b"authorization", b"Bearer not-it")]
    status, _, body = await call("GET", path, headers=wrong)
    assert status == 403 and json.loads(body) == {"detail": "invalid admin token"}
    assert (await call("GET", path))[0] == 200
    settings.MODELRELAY_ADMIN_TOKEN = ""
    status, _, body = await call("GET", path, headers=[(b"authorization", b"Bearer ")])
    assert status == 403
    assert json.loads(body)["detail"] == "admin API disabled: set MODELRELAY_ADMIN_TOKEN"


# -- keys -------------------------------------------------------------------------


async def test_keys_can_be_created_listed_and_revoked(admin, settings):
    status, _, body = await call("POST", "/admin/keys", {"name": "production-app"})
    assert status == 201
    created = json.loads(body)
    assert created["name"] == "production-app" and created["active"] is True
    assert created["secret"].startswith("mrk_") and created["prefix"] == created["secret"][:12]
    status, listing = await get_json("/admin/keys")
    assert [k["id"] for k in listing] == [created["id"]]
    assert "secret" not in listing[0]  # shown once, at creation only

    settings.MODELRELAY_REQUIRE_API_KEYS = True
    await runtime.reset()
    client = [(b"authorization", f"Bearer {created['secret']}".encode())]
    assert (await call("GET", "/v1/models", headers=client))[0] == 200
    assert (await call("DELETE", f"/admin/keys/{created['id']}"))[0] == 204
    await runtime.current().sync()
    assert (await call("GET", "/v1/models", headers=client))[0] == 401
    status, _, body = await call("DELETE", f"/admin/keys/{created['id']}")
    assert status == 404 and "already revoked" in json.loads(body)["detail"]
    assert (await call("DELETE", "/admin/keys/999999"))[0] == 404


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", ""),
        (b'{"name": ""}', "name"),
        (b'{"title": "x"}', "name"),
        (b"[]", ""),
    ],
)
async def test_malformed_admin_input_is_400_with_a_message(admin, body, fragment):
    status, _, raw = await call("POST", "/admin/keys", body)
    assert status == 400
    detail = json.loads(raw)["detail"]
    assert detail and fragment in str(detail)
    assert await ApiKey.objects.acount() == 0


# -- workers ----------------------------------------------------------------------


async def test_workers_listing_drain_and_refresh(admin):
    async with FakeWorker() as worker:
        ack = await worker.register(["a", "b"], max_concurrent=2, name="box-1")
        status, workers = await get_json("/admin/workers")
        assert status == 200
        assert len(workers) == 1
        listed = workers[0]
        assert (listed["id"], listed["name"], listed["provider"]) == (
            ack.worker_id,
            "box-1",
            "local",
        )
        assert listed["models"] == ["a", "b"] and listed["max_concurrent"] == 2
        assert listed["draining"] is False and listed["load"] == 0

        status, _, body = await call("POST", f"/admin/workers/{ack.worker_id}/refresh")
        assert status == 202
        assert await worker.expect(protocol.ModelsRefresh)

        inflight = await HttpCall("POST", "/v1/chat/completions", chat("a")).send()
        request = await worker.expect(protocol.Request)
        status, _, body = await call(
            "POST",
            f"/admin/workers/{ack.worker_id}/drain",
            {"timeout_secs": 30, "reason": "kernel update"},
        )
        assert status == 202 and json.loads(body)["status"] == "draining"
        shutdown = await worker.expect(protocol.GracefulShutdown)
        assert shutdown.reason == "kernel update" and shutdown.drain_timeout_secs == 30
        status, workers = await get_json("/admin/workers")
        assert workers[0]["draining"] is True and workers[0]["in_flight"] == 1
        await worker.answer(request.request_id)
        assert (await inflight.response())[0] == 200
        assert await worker.wait_closed() == (1000, "worker drained")
        status, workers = await get_json("/admin/workers")
        assert workers == []


@pytest.mark.parametrize(
    "timeout",
    [
        b"Infinity",
        b"-Infinity",
        b"NaN",
        b"1e999",
        b"-5",
        b"0",
        b"86401",
        b"1e300",
        b"true",
        b'"30"',
    ],
)
async def test_a_drain_deadline_that_is_not_finite_and_within_a_day_is_400(admin, timeout):
    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        body = b'{"timeout_secs": ' + timeout + b"}"
        status, _, raw = await call("POST", f"/admin/workers/{ack.worker_id}/drain", body)
        assert status == 400, raw
        assert "timeout_secs" in json.loads(raw)["detail"]
        # Refused before anything changed: the worker still takes work, and was told nothing.
        assert runtime.current().relay.registry.workers[ack.worker_id].draining is False
        status, _, body = await call("POST", f"/admin/workers/{ack.worker_id}/refresh")
        assert status == 202
        assert await worker.expect(protocol.ModelsRefresh)  # the next frame, no shutdown first
        status, _, raw = await call(
            "POST", f"/admin/workers/{ack.worker_id}/drain", b'{"timeout_secs": 86400}'
        )
        assert status == 202
        shutdown = await worker.expect(protocol.GracefulShutdown)
        assert shutdown.drain_timeout_secs == 86400


async def test_acting_on_an_unknown_worker_is_404(admin):
    status, _, body = await call("POST", "/admin/workers/w-nope/drain")
    assert status == 404 and "w-nope" in json.loads(body)["detail"]
    assert (await call("POST", "/admin/workers/w-nope/refresh"))[0] == 404
    status, _, _ = await call("POST", "/admin/workers/w-nope/drain", {"timeout_secs": -1})
    assert status == 400


async def test_stats_are_real_counters(admin):
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=1)
        ok = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        request = await worker.expect(protocol.Request)
        queued = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        await until(lambda: runtime.current().relay.queue_depth() == 1)
        status, stats = await get_json("/admin/stats")
        assert stats["in_flight"] == 1 and stats["queue_depth"] == 1
        assert stats["providers"]["local"]["queue_depth"] == 1
        assert stats["providers"]["local"]["workers"] == 1
        await worker.answer(request.request_id, prompt_tokens=11, completion_tokens=22)
        await ok.response()
        await queued.disconnect()
        await (await HttpCall("POST", "/v1/chat/completions", chat("nope")).send()).response()
    status, stats = await get_json("/admin/stats")
    assert status == 200
    assert stats["requests"]["by_outcome"] == {"cancelled": 1, "model_not_found": 1, "ok": 1}
    assert stats["requests"]["total"] == 3
    assert stats["tokens"] == {"prompt": 11, "completion": 22, "estimated": 0}
    assert stats["in_flight"] == 0 and stats["queue_depth"] == 0


# -- request log ----------------------------------------------------------------


async def test_the_request_log_is_written_in_batches(admin):
    from workers_app.models import RequestLog

    async with FakeWorker() as worker:
        await worker.register(name="box-9")
        streaming = await HttpCall("POST", "/v1/messages", chat(stream=True)).send()
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "event: a\ndata: {}\n\n")
        await worker.answer(request.request_id, body="", prompt_tokens=3, completion_tokens=4)
        await streaming.response()
    await (await HttpCall("POST", "/v1/chat/completions", chat("unknown")).send()).response()
    assert await RequestLog.objects.acount() == 0  # not on the request path
    await runtime.current().bookkeeper.flush()
    rows = [row async for row in RequestLog.objects.order_by("created_at")]
    assert len(rows) == 2
    served, rejected = rows
    assert served.request_id == request.request_id
    assert (served.model, served.endpoint, served.worker_name) == ("m", "/v1/messages", "box-9")
    assert (served.status, served.outcome, served.streamed) == (200, "ok", True)
    assert (served.prompt_tokens, served.completion_tokens) == (3, 4)
    assert served.ttfb_ms is not None and served.duration_ms >= served.ttfb_ms
    assert (rejected.status, rejected.outcome, rejected.request_id) == (404, "model_not_found", "")


async def test_the_request_log_writer_survives_database_errors(admin, monkeypatch):
    from relay.server import bookkeeper
    from workers_app.models import RequestLog

    real = bookkeeper.write_request_log
    failures: list[int] = []

    def flaky(batch):
        if not failures:
            failures.append(len(batch))
            raise RuntimeError("database is down")
        real(batch)

    monkeypatch.setattr(bookkeeper, "write_request_log", flaky)
    await (await HttpCall("POST", "/v1/chat/completions", chat("x1")).send()).response()
    keeper = runtime.current().bookkeeper
    await keeper.flush()
    assert failures == [1] and keeper.failures == 1 and len(keeper.pending) == 1
    await (await HttpCall("POST", "/v1/chat/completions", chat("x2")).send()).response()
    await keeper.flush()
    assert sorted([r.model async for r in RequestLog.objects.all()]) == ["x1", "x2"]
    assert not keeper.pending


# -- metrics ----------------------------------------------------------------------


async def test_metrics_in_prometheus_text(admin, settings):
    async with FakeWorker() as worker:
        await worker.register()
        done = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, prompt_tokens=2, completion_tokens=9)
        await done.response()
        await (await HttpCall("POST", "/v1/chat/completions", chat("ghost-123")).send()).response()
        status, headers, body = await call("GET", "/metrics", headers=[])
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert (
        'modelrelay_requests_total{endpoint="/v1/chat/completions",model="m",outcome="ok"} 1.0'
        in text
    )
    assert 'model="(unknown)",outcome="model_not_found"} 1.0' in text
    assert "ghost-123" not in text  # unknown model names never become labels
    assert 'modelrelay_tokens_total{kind="completion",model="m"} 9.0' in text
    assert 'modelrelay_workers{provider="local"} 1.0' in text
    assert 'modelrelay_queue_depth{provider="local"} 0.0' in text
    assert "modelrelay_request_duration_seconds_bucket" in text
    assert "modelrelay_time_to_first_byte_seconds_count" in text
    settings.MODELRELAY_METRICS_TOKEN = "scrape-me"
    await runtime.reset()
    assert (await call("GET", "/metrics", headers=[]))[0] == 403
    ok = await call("GET", "/metrics", headers=[(b"authorization", b"Bearer scrape-me")])
    assert ok[0] == 200


# -- Django admin pages ---------------------------------------------------------


@pytest.fixture
async def staff(admin):
    from django.contrib.auth.models import User
    from django.test import AsyncClient

    user = await sync_to_async(User.objects.create_superuser)("root", "root@example.com", "pw")
    client = AsyncClient()
    await client.aforce_login(user)
    return client


async def test_provider_secret_is_shown_once_in_the_admin(staff):
    from workers_app.models import Provider

    form = {
        "name": "team-gpu",
        "enabled": "on",
        "description": "",
        "declared_models": "llama3-8b",
        "max_queue_len": "",
        "queue_timeout_secs": "",
        "request_timeout_secs": "",
        "max_models_per_worker": "",
    }
    response = await staff.post("/django-admin/workers_app/provider/add/", form, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    assert "Worker secret for provider <b>team-gpu</b>" in page
    secret = page.split("user-select:all'>")[1].split("<")[0]
    provider = await Provider.objects.aget(name="team-gpu")
    assert provider.check_secret(secret) and secret not in provider.secret_hash
    again = await staff.get("/django-admin/workers_app/provider/")
    assert secret not in again.content.decode()
    async with FakeWorker(provider="team-gpu", secret=secret) as worker:
        assert (await worker.register(["x"])).models == ["x"]


async def test_connected_workers_page_lists_and_drains_live_workers(staff):
    url = "/django-admin/workers_app/connectedworker/"
    empty = await staff.get(url)
    assert "No worker is connected" in empty.content.decode()
    async with FakeWorker() as worker:
        ack = await worker.register(["llama3-8b"], name="box-3")
        page = (await staff.get(url)).content.decode()
        assert ack.worker_id in page and "box-3" in page and "llama3-8b" in page
        response = await staff.post(url, {"action": "refresh", "worker_id": ack.worker_id})
        assert response.status_code == 302
        assert await worker.expect(protocol.ModelsRefresh)
        await staff.post(url, {"action": "drain", "worker_id": ack.worker_id})
        assert await worker.expect(protocol.GracefulShutdown)
        assert await worker.wait_closed() == (1000, "worker drained")
    index = (await staff.get("/django-admin/")).content.decode()
    assert "Connected workers (live)" in index


async def test_audit_admins_are_read_only(staff):
    for model in ("requestlog", "workersession"):
        response = await staff.get(f"/django-admin/workers_app/{model}/add/")
        assert response.status_code == 403
        listing = await staff.get(f"/django-admin/workers_app/{model}/")
        assert listing.status_code == 200


PROVIDERS = "/django-admin/workers_app/provider/"


async def run_provider_action(client, action: str, name: str = "local") -> str:
    """Run a Django admin action on one provider; the page it lands on."""
    from workers_app.models import Provider

    provider = await Provider.objects.aget(name=name)
    form = {"action": action, "_selected_action": str(provider.pk), "index": "0"}
    response = await client.post(PROVIDERS, form, follow=True)
    assert response.status_code == 200
    return response.content.decode()


async def test_the_admin_rotates_a_secret_with_or_without_disconnecting_workers(staff):
    from workers_app.models import Provider

    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        page = await run_provider_action(staff, "rotate_secret")
        first = page.split("user-select:all'>")[1].split("<")[0]
        assert "Workers already connected to &#x27;local&#x27; keep running" in page
        assert ack.worker_id in runtime.current().relay.registry.workers

        page = await run_provider_action(staff, "rotate_secret_and_disconnect")
        second = page.split("user-select:all'>")[1].split("<")[0]
        assert await worker.wait_closed() == (1008, "provider secret rotated")
        assert "Disconnected 1 connected worker(s) of &#x27;local&#x27;" in page
    local = await Provider.objects.aget(name="local")
    assert local.check_secret(second) and not local.check_secret(first)
    async with FakeWorker(secret=first) as old:
        await old.connect()
        assert await old.wait_closed() == (1008, "invalid worker secret")
    options = (await staff.get(PROVIDERS)).content.decode()
    assert "Rotate worker secret and disconnect connected workers" in options
    page = await run_provider_action(staff, "rotate_secret_and_disconnect")
    assert "No worker of &#x27;local&#x27; was connected" in page


async def test_staff_who_may_only_view_providers_cannot_rotate_enable_or_disable(admin):
    from django.contrib.auth.models import Permission, User
    from django.test import AsyncClient

    from tests.asgikit import SECRET
    from workers_app.models import Provider

    def viewer() -> User:
        user = User.objects.create_user("viewer", "", "pw", is_staff=True)
        user.user_permissions.add(Permission.objects.get(codename="view_provider"))
        return user

    client = AsyncClient()
    await client.aforce_login(await sync_to_async(viewer)())
    listing = (await client.get(PROVIDERS)).content.decode()
    assert "rotate_secret" not in listing and "disable" not in listing
    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        for action in ("rotate_secret", "rotate_secret_and_disconnect", "disable"):
            page = await run_provider_action(client, action)
            assert "user-select:all" not in page
        local = await Provider.objects.aget(name="local")
        assert local.check_secret(SECRET) and local.enabled
        assert ack.worker_id in runtime.current().relay.registry.workers


async def test_staff_who_may_only_view_api_keys_cannot_revoke_them(admin):
    from django.contrib.auth.models import Permission, User
    from django.test import AsyncClient

    from keys.services import create_key

    def setup() -> tuple[User, ApiKey]:
        user = User.objects.create_user("key-viewer", "", "pw", is_staff=True)
        user.user_permissions.add(Permission.objects.get(codename="view_apikey"))
        return user, create_key("kept").key

    user, key = await sync_to_async(setup)()
    client = AsyncClient()
    await client.aforce_login(user)
    listing = (await client.get("/django-admin/keys/apikey/")).content.decode()
    assert "Revoke selected keys" not in listing
    form = {"action": "revoke", "_selected_action": str(key.pk), "index": "0"}
    await client.post("/django-admin/keys/apikey/", form, follow=True)
    await key.arefresh_from_db()
    assert key.revoked_at is None
