"""The dashboard and the setup wizard, in process (SPEC §9).

Pages go through Django's test clients; the event stream's disconnect goes through
the real ASGI application; live workers are ``FakeWorker``s on the same event loop.
"""

from __future__ import annotations

import html
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient, Client

from relay.core import timeline
from relay.core.stats import RequestRecord
from relay.pages import bundle, recipes
from relay.pages.dashboard import StreamCount, api_status
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import SECRET, FakeWorker, HttpCall, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)

SETUP_POST = {
    "platform": "linux",
    "backend": "llama",
    "mode": "new",
    "name": "lab-gpus",
    "backend_url": "http://127.0.0.1:8000",
    "models": "tiny-model, other-model",
    "max_concurrent": "",
}
ROTATE_LOCAL = {**SETUP_POST, "mode": "rotate", "name": "", "provider": "local"}


async def _user(username: str, *, staff: bool):
    from django.contrib.auth.models import User

    if staff:
        return await sync_to_async(User.objects.create_superuser)(username, "", "pw")
    return await sync_to_async(User.objects.create_user)(username, "", "pw")


async def _staff_with(*permissions: str) -> AsyncClient:
    """A logged-in staff user (not a superuser) holding exactly ``permissions``."""
    from django.contrib.auth.models import Permission, User

    def make() -> User:
        user = User.objects.create_user(f"staff-{len(permissions)}", "", "pw", is_staff=True)
        for name in permissions:
            app, codename = name.split(".")
            user.user_permissions.add(
                Permission.objects.get(content_type__app_label=app, codename=codename)
            )
        return user

    client = AsyncClient()
    await client.aforce_login(await sync_to_async(make)())
    return client


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


@pytest.fixture
async def staff(provider):
    client = AsyncClient()
    await client.aforce_login(await _user("root", staff=True))
    return client


def secret_on(page: str) -> str:
    match = re.search(r'id="worker-secret">([^<]+)<', page)
    assert match, "no secret on the page"
    return html.unescape(match.group(1))


def attribute(page: str, pattern: str) -> str:
    match = re.search(pattern, page)
    assert match, f"{pattern!r} not on the page"
    return html.unescape(match.group(1))


def code_block(page: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}">(.*?)</pre>', page, re.S)
    assert match, f"no #{element_id} on the page"
    return html.unescape(match.group(1))


def shell_words(snippet: str) -> list[str]:
    """Split a shown command as sh would, line continuations included."""
    return shlex.split(snippet.replace("\\\n", " "))


async def first_events(response, count: int) -> list[str]:
    """The first ``count`` events of a streaming response; closes the stream."""
    events: list[str] = []
    stream = response.streaming_content
    try:
        async for chunk in stream:
            events.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
            if len(events) >= count:
                break
    finally:
        await stream.aclose()
    return events


# -- dashboard ---------------------------------------------------------------------------


async def test_the_dashboard_sends_anonymous_visitors_to_the_admin_login(provider):
    response = await AsyncClient().get("/dashboard")
    assert response.status_code == 302
    assert response["Location"] == "/django-admin/login/?next=/dashboard"


async def test_live_endpoints_refuse_visitors_who_are_not_staff(provider):
    anonymous = AsyncClient()
    member = AsyncClient()
    await member.aforce_login(await _user("member", staff=False))
    for client in (anonymous, member):
        assert (await client.get("/dashboard/events")).status_code == 403
        assert (await client.post("/dashboard/workers/w-1/drain")).status_code == 403
        assert (await client.get("/setup/status?provider=local&since=0")).status_code == 403
    assert (await member.get("/dashboard")).status_code == 302


async def test_the_dashboard_renders_live_workers_in_its_first_snapshot(staff):
    empty = (await staff.get("/dashboard")).content.decode()
    assert 'id="empty-state"' in empty and 'href="/setup"' in empty
    assert json.loads(_initial(empty))["workers"] == []
    async with FakeWorker() as worker:
        ack = await worker.register(["llama3-8b"], name="box-7", max_concurrent=4)
        response = await staff.get("/dashboard")
        assert response.status_code == 200
        page = response.content.decode()
        snap = json.loads(_initial(page))
        assert [w["name"] for w in snap["workers"]] == ["box-7"]
        assert snap["workers"][0]["id"] == ack.worker_id
        assert snap["workers"][0]["max_concurrent"] == 4
        assert snap["stats"]["providers"]["local"]["workers"] == 1
        assert "relay/dashboard.js" in page and "relay/relay.css" in page


def _initial(page: str) -> str:
    match = re.search(r'<script id="initial-snapshot" type="application/json">(.*?)</script>', page)
    assert match
    return match.group(1)


async def test_the_event_stream_yields_snapshots_with_a_registered_worker(staff):
    async with FakeWorker() as worker:
        ack = await worker.register(["llama3-8b"], name="box-1")
        response = await staff.get("/dashboard/events")
        assert response.status_code == 200
        assert response["Content-Type"] == "text/event-stream"
        assert response["Cache-Control"] == "no-cache"
        retry, data = await first_events(response, 2)
        assert retry.startswith("retry: ")
        assert data.startswith("data: ") and data.endswith("\n\n")
        snap = json.loads(data.removeprefix("data: "))
        assert [(w["id"], w["name"], w["models"]) for w in snap["workers"]] == [
            (ack.worker_id, "box-1", ["llama3-8b"])
        ]
        assert set(snap["timeline"]["counts"]) == set(timeline.CLASSES)
        assert snap["stats"]["workers_connected"] == 1


async def test_the_event_stream_ends_its_generator_when_the_client_disconnects(staff):
    cookie = f"sessionid={staff.cookies['sessionid'].value}".encode()
    before = StreamCount.open
    call = HttpCall("GET", "/dashboard/events", headers=[(b"cookie", cookie)])
    await call.send()
    assert await call.start() == 200
    headers = {k.lower(): v for k, v in call.headers.items()}
    assert headers["content-type"] == "text/event-stream"
    first, _ = await call.chunk()
    assert first.startswith(b"retry: ")
    snapshot_event, more = await call.chunk()
    assert snapshot_event.startswith(b"data: {") and more
    assert StreamCount.open == before + 1
    await call.disconnect()
    await until(lambda: StreamCount.open == before)


async def test_the_dashboard_shows_who_is_using_the_pool(staff, settings):
    from keys.services import create_key

    page = (await staff.get("/dashboard")).content.decode()
    assert json.loads(_initial(page))["keys"] is None  # keys off: one anonymous lane
    assert 'id="keys-off"' in page
    settings.MODELRELAY_REQUIRE_API_KEYS = True
    await runtime.reset()
    team = await sync_to_async(create_key)("team-a", tokens_per_day=1000, weight=2)
    auth = [(b"authorization", f"Bearer {team.secret}".encode())]
    async with FakeWorker() as worker:
        await worker.register(["m"], max_concurrent=1)
        body = {"model": "m", "messages": []}
        calls = [await HttpCall("POST", "/v1/chat/completions", body, headers=auth).send()]
        first = await worker.expect(protocol.Request)
        calls.append(await HttpCall("POST", "/v1/chat/completions", body, headers=auth).send())
        await until(lambda: runtime.current().relay.queue_depth() == 1)
        response = await staff.get("/dashboard/events")
        _, data = await first_events(response, 2)
        (row,) = json.loads(data.removeprefix("data: "))["keys"]
        assert (row["name"], row["in_flight"], row["queued"], row["weight"]) == ("team-a", 1, 1, 2)
        assert row["tokens_per_day"] == 1000
        await worker.answer(first.request_id, prompt_tokens=5, completion_tokens=6)
        second = await worker.expect(protocol.Request)
        await worker.answer(second.request_id)
        for call in calls:
            await call.response()
    snap = json.loads(_initial((await staff.get("/dashboard")).content.decode()))
    (row,) = snap["keys"]
    assert (row["in_flight"], row["queued"], row["tokens_today"], row["requests"]) == (0, 0, 11, 2)
    assert snap["recent"][0]["key"] == "team-a"


async def test_recent_requests_are_listed_by_when_they_ended_with_their_class(staff):
    relay = runtime.current().relay
    # A long request that arrived first and ended last, a batch line preempted once,
    # and a refusal: the list holds them as they finished.
    short = replace(_record(200, at=1000.0), request_id="r-short", duration=0.1)
    line = replace(
        _record(200, at=1000.5),
        request_id="r-line",
        duration=0.3,
        service_class="flex",
        preemptions=1,
    )
    refused = replace(_record(404, "model_not_found", at=1000.7), request_id="", duration=0.0)
    long = replace(_record(200, at=999.0), request_id="r-long", duration=2.0)
    for record in (short, line, refused, long):
        relay.stats.observe(record)
    page = (await staff.get("/dashboard")).content.decode()
    assert "<th>Ended</th>" in page and '<th class="hide-sm">Class</th>' in page
    assert "latest ended first" in page
    recent = json.loads(_initial(page))["recent"]
    shown = [(r["request_id"], r["ended_at"], r["class"], r["preemptions"]) for r in recent]
    assert shown == [
        ("r-long", 1001.0, "default", 0),
        ("r-line", 1000.8, "flex", 1),
        ("", 1000.7, "default", 0),
        ("r-short", 1000.1, "default", 0),
    ]


async def test_a_message_batch_shows_the_status_its_api_says(staff):
    import datetime as dt

    from django.utils import timezone

    from batches.models import Batch

    later = timezone.now() + dt.timedelta(days=1)
    made = [  # ended ones: the engine leaves them as they are
        ("msgbatch_1", "anthropic", "completed"),
        ("msgbatch_2", "anthropic", "cancelled"),
        ("batch_3", "openai", "completed"),
        ("batch_4", "openai", "cancelled"),
    ]
    for public_id, api, status in made:
        await Batch.objects.acreate(
            public_id=public_id, api=api, status=status, endpoint="/v1/x", expires_at=later
        )
    engine = runtime.current().batches
    await until(lambda: len(engine.batches) == 4)  # the engine's next look at the database
    snap = json.loads(_initial((await staff.get("/dashboard")).content.decode()))
    shown = sorted((b["id"], b["status"], b["api_status"]) for b in snap["batches"])
    assert shown == [
        ("batch_3", "completed", "completed"),
        ("batch_4", "cancelled", "cancelled"),
        ("msgbatch_1", "completed", "ended"),
        ("msgbatch_2", "cancelled", "ended"),
    ]
    assert all("api_status" not in row for row in engine.batches)  # the engine's own rows


def test_message_batches_have_three_statuses_as_their_api_says():
    from batches.models import STATUSES

    said = {status: api_status({"api": "anthropic", "status": status}) for status in STATUSES}
    assert said == {
        "validating": "in_progress",
        "in_progress": "in_progress",
        "finalizing": "in_progress",
        "cancelling": "canceling",
        "completed": "ended",
        "failed": "ended",
        "expired": "ended",
        "cancelled": "ended",
    }
    assert all(api_status({"api": "openai", "status": s}) == s for s in STATUSES)


async def test_staff_drain_and_refresh_workers_from_the_dashboard(staff):
    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        url = f"/dashboard/workers/{ack.worker_id}"
        response = await staff.post(f"{url}/refresh")
        assert response.status_code == 200 and response.json()["ok"] is True
        assert await worker.expect(protocol.ModelsRefresh)
        response = await staff.post(f"{url}/drain")
        assert response.json() == {"ok": True, "worker_id": ack.worker_id, "action": "drain"}
        shutdown = await worker.expect(protocol.GracefulShutdown)
        assert shutdown.reason == "drained from the dashboard"
        assert await worker.wait_closed() == (1000, "worker drained")
    assert (await staff.post(f"{url}/drain")).status_code == 404
    assert (await staff.post(f"{url}/explode")).status_code == 404
    assert (await staff.get(f"{url}/drain")).status_code == 405


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        ('{"timeout_secs": Infinity}', "application/json"),
        ('{"timeout_secs": NaN}', "application/json"),
        ('{"timeout_secs": -1}', "application/json"),
        ('{"timeout_secs": 1e300}', "application/json"),
        ('{"timeout_secs": true}', "application/json"),
        ("timeout_secs=inf", "application/x-www-form-urlencoded"),
        ("timeout_secs=0", "application/x-www-form-urlencoded"),
        ("timeout_secs=soon", "application/x-www-form-urlencoded"),
    ],
)
async def test_a_dashboard_drain_with_a_bad_deadline_is_400_and_changes_nothing(
    staff, body, content_type
):
    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        url = f"/dashboard/workers/{ack.worker_id}"
        response = await staff.post(f"{url}/drain", body, content_type=content_type)
        assert response.status_code == 400
        assert "timeout_secs must be a finite number of seconds" in response.json()["detail"]
        assert runtime.current().relay.registry.workers[ack.worker_id].draining is False
        assert (await staff.post(f"{url}/refresh")).status_code == 200
        assert await worker.expect(protocol.ModelsRefresh)  # nothing was sent before it
        good = await staff.post(f"{url}/drain", {"timeout_secs": "90"})
        assert good.status_code == 200
        shutdown = await worker.expect(protocol.GracefulShutdown)
        assert shutdown.drain_timeout_secs == 90


async def test_dashboard_actions_need_the_csrf_token(provider):
    client = AsyncClient(enforce_csrf_checks=True)
    await client.aforce_login(await _user("root", staff=True))
    page = (await client.get("/dashboard")).content.decode()
    token = attribute(page, r'<meta name="csrf-token" content="([^"]+)"')
    async with FakeWorker() as worker:
        ack = await worker.register(["m"])
        url = f"/dashboard/workers/{ack.worker_id}/refresh"
        assert (await client.post(url)).status_code == 403
        assert (await client.post(url, headers={"X-CSRFToken": token})).status_code == 200
        assert await worker.expect(protocol.ModelsRefresh)


class OtherProcesses:
    """Stands in for the Redis-backed cluster: one worker held by another server process."""

    def __init__(self) -> None:
        self.remote = {
            "id": "w-remote1",
            "name": "far-box",
            "provider": "local",
            "models": ["remote-model"],
            "max_concurrent": 2,
            "load": 0,
            "draining": False,
            "requests_served": 0,
            "connected_secs": 0.5,
            "instance": "other",
        }
        self.forwarded: list[tuple[str, str, dict]] = []

    async def workers(self):
        return [self.remote]

    async def forward(self, kind: str, worker_id: str, **fields) -> bool:
        self.forwarded.append((kind, worker_id, fields))
        return worker_id == self.remote["id"]


async def test_with_redis_the_pages_show_and_reach_workers_of_other_processes(staff, monkeypatch):
    since = time.time() - 5
    cluster = OtherProcesses()
    monkeypatch.setattr(runtime.current(), "cluster", cluster)
    _, data = await first_events(await staff.get("/dashboard/events"), 2)
    assert [w["name"] for w in json.loads(data.removeprefix("data: "))["workers"]] == ["far-box"]
    response = await staff.post("/dashboard/workers/w-remote1/drain")
    assert response.status_code == 200
    assert cluster.forwarded == [
        ("drain", "w-remote1", {"timeout": None, "reason": "drained from the dashboard"})
    ]
    assert (await staff.post("/dashboard/workers/w-nowhere/refresh")).status_code == 404
    body = (await staff.get(f"/setup/status?provider=local&since={since}")).json()
    assert body["ready"] is True and body["model"] == "remote-model"


async def test_the_home_page_sends_staff_to_the_dashboard_and_others_to_setup(staff):
    assert (await AsyncClient().get("/"))["Location"] == "/setup"
    assert (await staff.get("/"))["Location"] == "/dashboard"


# -- outcome timeline ------------------------------------------------------------------------


def _record(status: int, outcome: str = "ok", at: float = 1000.0) -> RequestRecord:
    return RequestRecord(
        request_id="r",
        key_id=None,
        provider="local",
        model="m",
        endpoint="chat",
        worker_id=None,
        worker_name=None,
        status=status,
        outcome=outcome,
        streamed=False,
        queue_wait=0.0,
        ttfb=None,
        duration=0.5,
        prompt_tokens=None,
        completion_tokens=None,
        requeues=0,
        created_at=at,
    )


def test_the_timeline_counts_outcomes_per_bucket_and_forgets_old_ones():
    now = [1000.0]
    line = timeline.Timeline(bucket_secs=10, buckets=3, clock=lambda: now[0])
    line.observe(_record(200))
    line.observe(_record(404, "upstream_error"))
    line.observe(_record(499, "cancelled"))
    now[0] = 1015.0
    line.observe(_record(503, "queue_full"))
    series = line.series()
    assert series["counts"] == {
        "ok": [0, 1, 0],
        "client_error": [0, 1, 0],
        "error": [0, 0, 1],
        "cancelled": [0, 1, 0],
    }
    assert series["end"] == 1020.0
    assert line.rate(window=20) == pytest.approx(4 / 15)
    now[0] = 1100.0
    assert all(sum(v) == 0 for v in line.series()["counts"].values())


# -- wizard: steps 1 and 2 ----------------------------------------------------------------------


async def test_the_first_two_wizard_steps_are_public(provider):
    client = AsyncClient()
    start = (await client.get("/setup")).content.decode()
    for word in ("Linux", "macOS", "Windows", "llama-server", "Ollama", "vLLM", "Other"):
        assert word in start
    llama = (await client.get("/setup/backend?platform=linux&backend=llama")).content.decode()
    assert "llama-server -m model.gguf --port 8000 -np 4" in llama
    assert 'href="/setup/worker?platform=linux&amp;backend=llama"' in llama
    ollama = (await client.get("/setup/backend?platform=macos&backend=ollama")).content.decode()
    assert "ollama serve" in ollama and "http://127.0.0.1:11434" in ollama
    vllm = (await client.get("/setup/backend?platform=linux&backend=vllm")).content.decode()
    assert "vllm serve" in vllm and "--port 8000" in vllm
    windows = (await client.get("/setup/backend?platform=windows&backend=llama")).content.decode()
    assert "winget install llama.cpp" in windows
    bad = await client.get("/setup/backend?platform=amiga&backend=llama")
    assert bad.status_code == 302 and bad["Location"] == "/setup"


async def test_the_secret_step_requires_a_staff_login(provider):
    response = await AsyncClient().get("/setup/worker?platform=linux&backend=ollama")
    assert response.status_code == 302
    target = quote("/setup/worker?platform=linux&backend=ollama", safe="/")
    assert response["Location"] == f"/django-admin/login/?next={target}"
    posted = await AsyncClient().post("/setup/worker", SETUP_POST)
    assert posted.status_code == 302
    from workers_app.models import Provider

    assert not await Provider.objects.filter(name="lab-gpus").aexists()


async def test_the_secret_form_is_prefilled_for_the_chosen_backend(staff):
    page = (await staff.get("/setup/worker?platform=windows&backend=ollama")).content.decode()
    # Empty (the worker finds its backend), with the backend's usual URL as the example.
    assert 'value="" placeholder="http://127.0.0.1:11434"' in page
    assert '<option value="local"' in page
    vllm = (await staff.get("/setup/worker?platform=linux&backend=vllm")).content.decode()
    assert 'name="max_concurrent" id="id_max_concurrent" value="8"' in vllm


# -- wizard: step 3 (secret and command) ---------------------------------------------------------


async def test_a_new_providers_secret_is_shown_once_and_lets_a_worker_in(staff):
    from workers_app.models import Provider

    response = await staff.post("/setup/worker", SETUP_POST)
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    page = response.content.decode()
    secret = secret_on(page)
    created = await Provider.objects.aget(name="lab-gpus")
    assert created.check_secret(secret)
    assert secret not in created.secret_hash and secret not in created.secret_prefix
    again = (await staff.get("/setup/worker?platform=linux&backend=llama")).content.decode()
    assert secret not in again
    async with FakeWorker(provider="lab-gpus", secret=secret) as worker:
        ack = await worker.register(["tiny-model"])
        assert ack.models == ["tiny-model"]


async def test_rotating_a_provider_invalidates_its_old_secret(staff):
    from workers_app.models import Provider

    page = (await staff.post("/setup/worker", ROTATE_LOCAL)).content.decode()
    secret = secret_on(page)
    assert secret != SECRET
    local = await Provider.objects.aget(name="local")
    assert local.check_secret(secret) and not local.check_secret(SECRET)
    async with FakeWorker(secret=SECRET) as worker:
        await worker.connect()
        assert await worker.wait_closed() == (1008, "invalid worker secret")
    async with FakeWorker(secret=secret) as worker:
        assert (await worker.register(["m"])).models == ["m"]


async def test_rotating_the_env_configured_provider_warns_that_a_restart_undoes_it(staff, settings):
    settings.PROVIDER_NAME, settings.WORKER_SECRET = "local", SECRET
    page = (await staff.post("/setup/worker", ROTATE_LOCAL)).content.decode()
    assert 'id="env-secret-warning"' in page
    settings.WORKER_SECRET = ""
    page = (await staff.post("/setup/worker", ROTATE_LOCAL)).content.decode()
    assert 'id="env-secret-warning"' not in page


async def test_staff_without_provider_permissions_can_neither_create_nor_rotate(provider):
    from workers_app.models import Provider

    client = await _staff_with()
    assert (await client.get("/setup/worker?platform=linux&backend=llama")).status_code == 403
    assert (await client.post("/setup/worker", SETUP_POST)).status_code == 403
    assert (await client.post("/setup/worker", ROTATE_LOCAL)).status_code == 403
    disconnect = {**ROTATE_LOCAL, "disconnect": "on"}
    assert (await client.post("/setup/worker", disconnect)).status_code == 403
    assert not await Provider.objects.filter(name="lab-gpus").aexists()
    assert (await Provider.objects.aget(name="local")).check_secret(SECRET)


async def test_creating_needs_the_add_permission_and_rotating_the_change_permission(provider):
    from workers_app.models import Provider

    adder = await _staff_with("workers_app.add_provider")
    form = (await adder.get("/setup/worker?platform=linux&backend=llama")).content.decode()
    assert "You may not rotate provider secrets." in form
    assert '<option value="local"' not in form
    assert (await adder.post("/setup/worker", ROTATE_LOCAL)).status_code == 403
    assert (await Provider.objects.aget(name="local")).check_secret(SECRET)
    created = await adder.post("/setup/worker", SETUP_POST)
    assert created.status_code == 200
    assert (await Provider.objects.aget(name="lab-gpus")).check_secret(
        secret_on(created.content.decode())
    )

    rotator = await _staff_with("workers_app.change_provider", "workers_app.view_provider")
    form = (await rotator.get("/setup/worker?platform=linux&backend=llama")).content.decode()
    assert "You may not create providers." in form
    assert 'name="mode" value="rotate" checked' in form
    assert (await rotator.post("/setup/worker", {**SETUP_POST, "name": "b"})).status_code == 403
    assert not await Provider.objects.filter(name="b").aexists()
    rotated = await rotator.post("/setup/worker", ROTATE_LOCAL)
    assert rotated.status_code == 200
    local = await Provider.objects.aget(name="local")
    assert local.check_secret(secret_on(rotated.content.decode()))


async def test_rotating_in_the_wizard_can_also_disconnect_the_connected_workers(staff):
    async with FakeWorker() as kept:
        ack = await kept.register(["m"])
        page = (await staff.post("/setup/worker", ROTATE_LOCAL)).content.decode()
        outcome = attribute(page, r'id="rotation-outcome">([^<]+)<')
        assert "Workers already connected to 'local' keep running" in outcome
        assert ack.worker_id in runtime.current().relay.registry.workers
        assert kept.closed is None

        # The old secret leaked: rotate again, and this time evict whoever used it.
        page = (await staff.post("/setup/worker", {**ROTATE_LOCAL, "disconnect": "on"})).content
        page = page.decode()
        assert await kept.wait_closed() == (1008, "provider secret rotated")
        assert ack.worker_id not in runtime.current().relay.registry.workers
        assert "(secret rotated, connected workers disconnected)" in page
        outcome = attribute(page, r'id="rotation-outcome">([^<]+)<')
        assert "Disconnected 1 connected worker(s) of 'local'" in outcome
    async with FakeWorker(secret=SECRET) as intruder:
        await intruder.connect()
        assert await intruder.wait_closed() == (1008, "invalid worker secret")
    async with FakeWorker(secret=secret_on(page)) as worker:
        assert (await worker.register(["m"])).models == ["m"]


async def test_the_secret_form_refuses_bad_and_taken_names(staff):
    from workers_app.models import Provider

    bad = (await staff.post("/setup/worker", {**SETUP_POST, "name": "no spaces!"})).content
    assert b"Use 1-64 letters" in bad and b'id="worker-secret"' not in bad
    taken = (await staff.post("/setup/worker", {**SETUP_POST, "name": "local"})).content.decode()
    assert "exists: rotate its secret instead" in taken
    nothing = {**SETUP_POST, "mode": "rotate", "provider": ""}
    missing = (await staff.post("/setup/worker", nothing)).content.decode()
    assert "Choose the provider" in missing
    url = {**SETUP_POST, "backend_url": "ftp://box"}
    assert b"base URL" in (await staff.post("/setup/worker", url)).content
    assert await Provider.objects.acount() == 1
    local = await Provider.objects.aget(name="local")
    assert local.check_secret(SECRET)


@pytest.mark.parametrize("platform", ["linux", "macos", "windows"])
async def test_the_command_for_each_platform_has_this_url_the_provider_and_the_secret(
    staff, settings, platform
):
    settings.PUBLIC_URL = ""
    page = (await staff.post("/setup/worker", {**SETUP_POST, "platform": platform})).content
    page = page.decode()
    secret = secret_on(page)
    script = code_block(page, f"install-command-{platform}")
    run = code_block(page, f"run-command-{platform}")
    assert script.endswith(run)
    assert "--proxy-url http://testserver" in run
    assert "--provider lab-gpus" in run
    assert "--backend-url http://127.0.0.1:8000" in run
    # The secret travels in the environment: a flag would show in `ps` on the GPU box.
    assert "--worker-secret" not in page
    for pin in bundle.worker_requirements():
        assert pin in script
    if platform == "windows":
        assert "py -m venv modelrelay-worker" in script
        assert "Invoke-WebRequest -UseBasicParsing -OutFile worker.pyz " in script
        assert "http://testserver/setup/worker.pyz" in script
        python = r".\modelrelay-worker\Scripts\python.exe"
        assert run.startswith(f"$env:WORKER_SECRET = '{secret}'; {python} worker.pyz ")
        assert "--models 'tiny-model,other-model'" in run
    else:
        assert "curl -fsSLO http://testserver/setup/worker.pyz" in script
        argv = shell_words(run)
        assert argv[:3] == [f"WORKER_SECRET={secret}", "modelrelay-worker/bin/python", "worker.pyz"]
        assert argv[argv.index("--models") + 1] == "tiny-model,other-model"
        assert secret not in argv[1:]
    assert f'data-platform="{platform}"' in page


async def test_the_linux_tab_has_a_systemd_env_file_with_the_secret(staff):
    page = (await staff.post("/setup/worker", SETUP_POST)).content.decode()
    secret = secret_on(page)
    lines = code_block(page, "env-file").splitlines()
    assert lines == [
        "PROXY_URL=http://testserver",
        "PROVIDER_NAME=lab-gpus",
        f"WORKER_SECRET={secret}",
        "BACKEND_URL=http://127.0.0.1:8000",
        "MODELS=tiny-model,other-model",
    ]


async def test_an_https_public_url_stays_https_in_the_command(staff, settings):
    settings.PUBLIC_URL = "https://relay.example.com/"
    page = (await staff.post("/setup/worker", SETUP_POST)).content.decode()
    run = code_block(page, "run-command-linux")
    assert "--proxy-url https://relay.example.com " in run
    assert "curl -fsSLO https://relay.example.com/setup/worker.pyz" in code_block(
        page, "install-command-linux"
    )
    assert "wss://" not in run


def test_commands_quote_what_people_typed():
    setup = recipes.WorkerSetup(
        public_url="http://relay.lan:8080",
        provider="lab",
        secret="mrw_abc-DEF_123",
        backend_url="http://127.0.0.1:8000",
        models=("it's; rm -rf ~", "b"),
        max_concurrent=3,
    )
    linux = recipes.worker_command("linux", setup, ["httpx==0.28.1"])
    argv = shell_words(linux.run)
    assert argv[0] == "WORKER_SECRET=mrw_abc-DEF_123"
    assert argv[argv.index("--models") + 1] == "it's; rm -rf ~,b"
    assert argv[argv.index("--max-concurrent") + 1] == "3"
    windows = recipes.worker_command("windows", setup, ["httpx==0.28.1"])
    assert windows.run.startswith("$env:WORKER_SECRET = 'mrw_abc-DEF_123'; ")
    assert "--models 'it''s; rm -rf ~,b'" in windows.run
    env = recipes.env_file(setup)
    assert 'MODELS="it\'s; rm -rf ~,b"\n' in env and "MAX_CONCURRENT=3\n" in env
    odd = recipes.env_file(replace(setup, models=('say "$HOME" \\ `x`',)))
    assert 'MODELS="say \\"\\$HOME\\" \\\\ \\`x\\`"\n' in odd
    curl = recipes.curl_test("https://relay.example.com", "it's")
    argv = shell_words(curl)
    assert argv[1] == "https://relay.example.com/v1/chat/completions"
    assert json.loads(argv[-1])["model"] == "it's"
    assert "Authorization" in recipes.curl_test("https://x", "m", api_key=True)


# -- wizard: step 4 (confirmation) -----------------------------------------------------------------


async def test_the_status_reports_only_workers_connected_after_the_secret_was_issued(staff):
    async with FakeWorker() as old:
        await old.register(["stale-model"], name="old-box")
        page = (await staff.post("/setup/worker", ROTATE_LOCAL)).content.decode()
        status_url = attribute(page, r'data-status-url="([^"]+)"')
        assert status_url.startswith("/setup/status?provider=local&since=")
        body = (await staff.get(status_url)).json()
        assert body == {"provider": "local", "ready": False, "workers": []}
        async with FakeWorker(secret=secret_on(page), client=("192.0.2.11", 40001)) as new:
            await new.register(["llama3-8b", "qwen"], name="new-box")
            body = (await staff.get(status_url)).json()
            assert body["ready"] is True
            assert [w["name"] for w in body["workers"]] == ["new-box"]
            assert body["model"] == "llama3-8b"
            argv = shell_words(body["curl"])
            assert argv[1] == "http://testserver/v1/chat/completions"
            assert json.loads(argv[-1])["model"] == "llama3-8b"
            assert "Invoke-RestMethod" in body["powershell"]
    assert (await staff.get("/setup/status?provider=local&since=soon")).status_code == 400


async def test_the_status_sees_a_worker_the_moment_it_registers(staff):
    since = time.time()
    url = f"/setup/status?provider=local&since={since}"
    assert (await staff.get(url)).json()["ready"] is False
    async with FakeWorker() as worker:
        await worker.register(["m"])
        await until(lambda: bool(runtime.current().relay.registry.workers))
        assert (await staff.get(url)).json()["ready"] is True


# -- worker.pyz --------------------------------------------------------------------------------


def test_the_served_worker_zipapp_runs(tmp_path):
    response = Client().get("/setup/worker.pyz")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == 'attachment; filename="worker.pyz"'
    target = tmp_path / "worker.pyz"
    target.write_bytes(response.content)
    # From an empty directory, so only the archive's own ``relay`` package can be imported.
    result = subprocess.run(
        [sys.executable, str(target), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "--worker-secret" in result.stdout and "--proxy-url" in result.stdout


def test_the_bundle_holds_the_worker_and_exactly_the_wire_and_worker_packages():
    built = bundle.worker_bundle()
    assert built.members[0] == "__main__.py"
    root = Path(bundle.ROOT)
    shipped = {
        p.relative_to(root).as_posix()
        for folder in ("relay/wire", "relay/worker")
        for p in (root / folder).glob("*.py")
    }
    assert set(built.members) == {"__main__.py", "relay/__init__.py"} | shipped
    assert "relay/worker/session.py" in shipped and "relay/wire/protocol.py" in shipped
    assert bundle.worker_bundle() is built  # cached while the sources are unchanged
    assert bundle.build().data == built.data  # reproducible


def test_the_worker_requirements_pin_what_the_bundled_modules_import():
    # Every bundled file's imports count, not only worker.py's (httpx and httpcore are
    # imported in relay/).
    names = [pin.split("==")[0] for pin in bundle.worker_requirements()]
    assert names == ["websockets", "httpx", "msgspec", "httptools", "httpcore"]


def test_a_worker_that_imports_the_server_side_is_not_bundled(tmp_path, monkeypatch):
    fake = tmp_path / "worker.py"
    fake.write_text("from relay import __version__\nfrom relay.core import dispatch\n")
    monkeypatch.setattr(bundle, "WORKER", fake)
    with pytest.raises(bundle.BundleError, match="does not ship"):
        bundle.build()


def test_a_worker_that_imports_django_is_not_bundled(tmp_path, monkeypatch):
    fake = tmp_path / "worker.py"
    fake.write_text("import django\nfrom relay import protocol\n")
    monkeypatch.setattr(bundle, "WORKER", fake)
    with pytest.raises(bundle.BundleError, match="django"):
        bundle.build()


# -- wizard: joining with a token (SPEC §22) -------------------------------------------------------

JOIN_POST = {
    **SETUP_POST,
    "mode": "join",
    "name": "",
    "provider": "local",
    "backend_url": "",
    "models": "",
}


async def test_joining_in_the_wizard_mints_a_token_and_shows_two_commands_per_platform(staff):
    from relay.pages.wheel import wheel_filename
    from workers_app.models import JoinToken

    page = (await staff.post("/setup/worker", JOIN_POST)).content.decode()
    token = attribute(page, r'id="join-token">([^<]+)<')
    row = await JoinToken.objects.select_related("provider").aget()
    assert row.prefix == token[:12] and row.provider.name == "local" and row.uses == 1
    assert row.created_by.startswith("setup: ")
    wheel_url = f"http://testserver/setup/{wheel_filename()}"
    linux = code_block(page, "join-install-linux")
    assert (
        linux
        == f"python3 -m venv modelrelay-worker && modelrelay-worker/bin/pip install {wheel_url}"
    )
    assert shell_words(code_block(page, "join-run-linux")) == [
        "modelrelay-worker/bin/modelrelay-worker",
        "--proxy-url",
        "http://testserver",
        "--join-token",
        token,
    ]
    windows = code_block(page, "join-install-windows").splitlines()
    assert windows == [
        "py -m venv modelrelay-worker",
        rf".\modelrelay-worker\Scripts\python.exe -m pip install {wheel_url}",
    ]
    run = code_block(page, "join-run-windows")
    assert run == (
        r".\modelrelay-worker\Scripts\modelrelay-worker.exe --proxy-url http://testserver "
        f"--join-token {token}"
    )
    assert f'href="{wheel_url}"' in page
    assert attribute(page, r'data-status-url="([^"]+)"').startswith("/setup/status?provider=local")
    # What was asked for goes on the command line, nothing else.
    asked = {**JOIN_POST, "backend_url": "http://127.0.0.1:8081", "models": "a, b"}
    page = (await staff.post("/setup/worker", asked)).content.decode()
    argv = shell_words(code_block(page, "join-run-macos"))
    assert argv[argv.index("--backend-url") + 1] == "http://127.0.0.1:8081"
    assert argv[argv.index("--models") + 1] == "a,b"


async def test_joining_in_the_wizard_needs_the_permission_to_add_join_tokens(provider):
    from workers_app.models import JoinToken

    rotator = await _staff_with("workers_app.change_provider", "workers_app.view_provider")
    form = (await rotator.get("/setup/worker?platform=linux&backend=llama")).content.decode()
    assert "You may not mint join tokens." in form
    assert (await rotator.post("/setup/worker", JOIN_POST)).status_code == 403
    joiner = await _staff_with("workers_app.add_jointoken")
    form = (await joiner.get("/setup/worker?platform=linux&backend=llama")).content.decode()
    assert 'name="mode" value="join" checked' in form
    assert (await joiner.post("/setup/worker", JOIN_POST)).status_code == 200
    assert await JoinToken.objects.acount() == 1
    missing = (await joiner.post("/setup/worker", {**JOIN_POST, "provider": ""})).content
    assert b"Choose the provider the worker joins." in missing
