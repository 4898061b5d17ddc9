"""Joining (SPEC §22) through the real ASGI application: join tokens traded for a
credential of the worker's own, holds (no takeover), revocation, the operator's
surfaces (admin API, manage.py) and the provider secret that keeps working."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.utils import timezone

from relay.core.credentials import hash_secret
from relay.server import runtime
from relay.wire import joining
from tests.asgikit import FakeWorker, HttpCall, make_provider, until
from tests.stall import STALL_BUDGET_MS, LoopStalls

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "admin-token-for-tests"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]


@pytest.fixture
async def provider(fresh_runtime, settings):
    settings.MODELRELAY_ADMIN_TOKEN = TOKEN
    return await make_provider()


async def mint(provider: str = "local", **options) -> str:
    from workers_app.joining import mint_token
    from workers_app.models import Provider

    row = await Provider.objects.aget(name=provider)
    return (await sync_to_async(mint_token)(row, **options)).secret


async def join(token: str, name: str = "box-1", **call) -> tuple[int, dict]:
    body = {"token": token, "name": name}
    status, _, raw = await (await HttpCall("POST", joining.PATH, body, **call).send()).response()
    return status, json.loads(raw)


def joined(credential: str, provider: str | None = "local", **kwargs) -> FakeWorker:
    header = (b"x-worker-credential", credential.encode())
    return FakeWorker(provider=provider, secret=None, headers=[header], **kwargs)


async def a_joined_worker(name: str = "box-1") -> dict:
    status, body = await join(await mint(), name)
    assert status == 201, body
    return body


def registered(worker_id: str):
    return runtime.current().relay.registry.workers.get(worker_id)


# -- the token ------------------------------------------------------------------------------


async def test_a_join_token_is_traded_once_for_a_credential_kept_only_as_a_hash(provider):
    from workers_app.models import JoinedWorker, JoinToken

    token = await mint()
    status, body = await join(token, "gpu-box-7")
    assert status == 201
    assert body["name"] == "gpu-box-7" and body["provider"] == "local"
    credential = body["credential"]
    assert credential.startswith("mrc_") and len(credential) > 40
    row = await JoinedWorker.objects.aget(pk=body["worker_id"])
    assert row.prefix == credential[:12]
    assert row.credential_hash == hash_secret(credential, _pepper())
    stored = json.dumps([str(getattr(row, f.attname)) for f in row._meta.fields])
    assert credential not in stored and token not in stored
    spent = await JoinToken.objects.aget(prefix=token[:12])
    assert spent.used == 1 and spent.state() == "used"
    assert token not in json.dumps([str(getattr(spent, f.attname)) for f in spent._meta.fields])

    again, refused = await join(token, "gpu-box-8")  # replayed
    assert again == 401
    assert refused["error"]["message"] == "join token already used"
    assert refused["error"]["code"] == "join_refused"
    assert await JoinedWorker.objects.acount() == 1


async def test_a_token_for_n_uses_lets_n_workers_join_each_with_its_own_credential(provider):
    token = await mint(uses=2)
    first, second = (await join(token, "a"))[1], (await join(token, "b"))[1]
    assert first["credential"] != second["credential"]
    assert first["worker_id"] != second["worker_id"]
    assert (await join(token, "c"))[0] == 401


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        ("expire", "join token expired"),
        ("revoke", "join token revoked"),
        ("forge", "invalid join token"),
        ("unknown", "invalid join token"),
    ],
)
async def test_an_unusable_token_is_refused_with_its_reason(provider, spoil, reason):
    from workers_app.models import JoinToken

    token = await mint()
    rows = JoinToken.objects.filter(prefix=token[:12])
    if spoil == "expire":
        await rows.aupdate(expires_at=timezone.now() - dt.timedelta(seconds=1))
    elif spoil == "revoke":
        await rows.aupdate(revoked_at=timezone.now())
    elif spoil == "forge":  # the right prefix, the wrong rest
        token = token[:12] + "x" * (len(token) - 12)
    else:
        token = "mrj_" + "y" * 43
    status, body = await join(token)
    assert (status, body["error"]["message"]) == (401, reason)


async def test_a_token_joins_only_an_enabled_provider(provider):
    token = await mint()
    provider.enabled = False
    await provider.asave()
    status, body = await join(token)
    assert (status, body["error"]["message"]) == (401, "provider 'local' is disabled")
    provider.enabled = True
    await provider.asave()
    assert (await join(token))[0] == 201  # the refusal did not spend it


async def test_failed_joins_are_throttled_like_bad_worker_secrets(provider, settings):
    settings.AUTH_MAX_FAILURES = 2
    token = await mint()
    for _ in range(2):
        assert (await join("mrj_" + "z" * 43))[0] == 401
    call = await HttpCall("POST", joining.PATH, {"token": token, "name": "a"}).send()
    status, headers, body = await call.response()
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert "too many failed attempts" in json.loads(body)["error"]["message"]
    # The same throttle as the worker socket's: that address is blocked there too.
    async with FakeWorker(client=("198.51.100.7", 1)) as worker:
        await worker.connect()
        assert (await worker.wait_closed())[1].startswith("too many failed authentication")
    # Nothing was spent meanwhile: another address joins with the token.
    other = {"token": token, "name": "a"}
    call = HttpCall("POST", joining.PATH, other)
    call.comm.scope["client"] = ("198.51.100.8", 1)
    assert (await (await call.send()).response())[0] == 201


async def test_the_join_request_is_bounded_and_checked(provider):
    token = await mint()
    name = "n" * 200
    body = json.dumps({"token": token, "name": name}).encode()
    at_bound = body[:-1] + b" " * (joining.MAX_JOIN_BYTES - len(body)) + b"}"
    assert len(at_bound) == joining.MAX_JOIN_BYTES
    async with LoopStalls() as stalls:
        status, _, raw = await (await HttpCall("POST", joining.PATH, at_bound).send()).response()
    assert status == 201, raw
    assert stalls.longest_ms < STALL_BUDGET_MS
    over = at_bound[:-1] + b" }"
    assert (await (await HttpCall("POST", joining.PATH, over).send()).response())[0] == 413
    declared = [(b"content-length", b"999999")]
    refused = HttpCall("POST", joining.PATH, b"", headers=declared)
    assert (await (await refused.send()).response())[0] == 413
    too_long = json.dumps({"token": token, "name": "n" * 201})
    assert (await (await HttpCall("POST", joining.PATH, too_long).send()).response())[0] == 400
    extra = json.dumps({"token": token, "name": "a", "provider": "other"})
    assert (await (await HttpCall("POST", joining.PATH, extra).send()).response())[0] == 400
    text = HttpCall("POST", joining.PATH, body, content_type=b"text/plain")
    assert (await (await text.send()).response())[0] == 415
    status, headers, _ = await (await HttpCall("GET", joining.PATH).send()).response()
    assert status == 405 and headers["allow"] == "POST"


# -- the credential at connect --------------------------------------------------------------


async def test_a_joined_worker_connects_with_its_credential_to_its_provider_only(provider):
    await make_provider("other", secret="mrw_other-secret")
    body = await a_joined_worker()
    async with joined(body["credential"], provider="other") as astray:
        await astray.connect()
        assert await astray.wait_closed() == (1008, "this worker belongs to provider 'local'")
    async with joined(body["credential"]) as worker:
        ack = await worker.register(["m"], name="box-1")
        live = registered(ack.worker_id)
        assert live.provider == "local" and live.identity == body["worker_id"]
    async with joined("mrc_" + "q" * 43) as forged:
        await forged.connect()
        assert await forged.wait_closed() == (1008, "invalid worker credential")


async def test_a_connection_presenting_a_connected_workers_identity_is_refused(provider):
    from workers_app.models import JoinedWorker

    body = await a_joined_worker()
    async with joined(body["credential"]) as first:
        ack = await first.register(["m"])
        async with joined(body["credential"], client=("192.0.2.50", 2)) as second:
            await second.connect()
            assert await second.wait_closed() == (
                1008,
                f"worker 'box-1' (#{body['worker_id']}) is connected already",
            )
        assert registered(ack.worker_id) is not None  # the first is untouched
        row = await JoinedWorker.objects.aget(pk=body["worker_id"])
        assert row.connected() and row.last_address == "192.0.2.10"
    await until(lambda: not runtime.current().identities.held)
    row = await JoinedWorker.objects.aget(pk=body["worker_id"])
    assert not row.connected() and row.last_seen_at is not None  # let go at the close
    async with joined(body["credential"]) as again:
        assert (await again.register(["m"])).models == ["m"]


async def test_a_takeover_attempt_counts_as_a_failed_attempt(provider, settings):
    settings.AUTH_MAX_FAILURES = 2
    body = await a_joined_worker()
    async with joined(body["credential"]) as first:
        await first.register(["m"])
        for _ in range(2):
            async with joined(body["credential"], client=("192.0.2.66", 1)) as thief:
                await thief.connect()
                assert "connected already" in (await thief.wait_closed())[1]
        async with joined(body["credential"], client=("192.0.2.66", 1)) as thief:
            await thief.connect()
            assert (await thief.wait_closed())[1].startswith("too many failed authentication")


async def test_the_hold_of_a_process_that_died_lapses(provider):
    from workers_app.models import JoinedWorker

    body = await a_joined_worker()
    rows = JoinedWorker.objects.filter(pk=body["worker_id"])
    later = timezone.now() + dt.timedelta(seconds=60)
    await rows.aupdate(holder="gone:0", held_until=later)
    async with joined(body["credential"]) as refused:
        await refused.connect()
        assert "connected already" in (await refused.wait_closed())[1]
    await rows.aupdate(held_until=timezone.now() - dt.timedelta(seconds=1))
    async with joined(body["credential"], client=("192.0.2.77", 1)) as worker:
        assert (await worker.register(["m"])).models == ["m"]


# -- revocation -----------------------------------------------------------------------------


async def test_revoking_one_worker_closes_it_refuses_it_after_and_spares_the_others(provider):
    from workers_app.joining import revoke_worker
    from workers_app.models import JoinedWorker

    one, two = await a_joined_worker("box-1"), await a_joined_worker("box-2")
    async with (
        joined(one["credential"]) as first,
        joined(two["credential"], client=("192.0.2.11", 1)) as second,
        FakeWorker(client=("192.0.2.12", 1)) as shared,  # the provider's secret
    ):
        acks = [await first.register(["m"]), await second.register(["m"]), await shared.register()]
        row = await JoinedWorker.objects.aget(pk=one["worker_id"])
        assert await sync_to_async(revoke_worker)(row)
        assert await first.wait_closed() == (1008, "worker credential revoked")
        await until(lambda: registered(acks[0].worker_id) is None)
        assert registered(acks[1].worker_id) is not None
        assert registered(acks[2].worker_id) is not None
        assert second.closed is None and shared.closed is None
    async with joined(one["credential"]) as back:
        await back.connect()
        assert await back.wait_closed() == (1008, "worker credential revoked")


async def test_a_revocation_whose_broadcast_is_lost_closes_the_worker_at_the_next_sync(
    provider, settings
):
    from workers_app.models import JoinedWorker

    body = await a_joined_worker()
    async with joined(body["credential"]) as worker:
        await worker.register(["m"])
        # Written by another process, no broadcast: only the periodic check sees it.
        await JoinedWorker.objects.filter(pk=body["worker_id"]).aupdate(revoked_at=timezone.now())
        closed = await worker.wait_closed(timeout=settings.SYNC_SECS + 3)
        assert closed == (1008, "worker credential revoked")


async def test_a_deleted_worker_is_closed_like_a_revoked_one(provider, settings):
    from workers_app.models import JoinedWorker

    body = await a_joined_worker()
    async with joined(body["credential"]) as worker:
        await worker.register(["m"])
        await JoinedWorker.objects.filter(pk=body["worker_id"]).adelete()
        closed = await worker.wait_closed(timeout=settings.SYNC_SECS + 3)
        assert closed == (1008, "worker credential revoked")


async def test_the_provider_secret_keeps_working_and_rotating_it_spares_joined_workers(provider):
    from workers_app.services import rotate_secret

    body = await a_joined_worker()
    async with (
        joined(body["credential"]) as own,
        FakeWorker(client=("192.0.2.13", 1)) as shared,
    ):
        await own.register(["m"])
        assert (await shared.register()).models == ["m"]
        await sync_to_async(rotate_secret)(provider, disconnect=True)
        assert await shared.wait_closed() == (1008, "provider secret rotated")
        assert own.closed is None
        assert len(runtime.current().relay.registry.of_provider("local")) == 1


# -- the operator's surfaces ----------------------------------------------------------------


async def api(method: str, path: str, body: object = b""):
    call = HttpCall(method, path, body if isinstance(body, bytes) else json.dumps(body), AUTH)
    status, _, raw = await (await call.send()).response()
    return status, (json.loads(raw) if raw else None)


async def test_the_admin_api_mints_lists_and_revokes_tokens_and_workers(provider):
    status, made = await api("POST", "/admin/join-tokens", {"provider": "local", "uses": 2})
    assert status == 201 and made["token"].startswith("mrj_") and made["uses"] == 2
    assert made["state"] == "usable" and made["created_by"] == "api"
    _, listed = await api("GET", "/admin/join-tokens")
    assert [t["id"] for t in listed] == [made["id"]] and "token" not in listed[0]
    for bad in (
        {"provider": "nope"},
        {"provider": "local", "uses": 0},
        {"provider": "local", "ttl_secs": 0},
    ):
        assert (await api("POST", "/admin/join-tokens", bad))[0] in (400, 404), bad

    body = (await join(made["token"]))[1]
    async with joined(body["credential"]) as worker:
        await worker.register(["m"])
        _, workers = await api("GET", "/admin/joined-workers")
        assert [(w["id"], w["name"], w["provider"], w["connected"]) for w in workers] == [
            (body["worker_id"], "box-1", "local", True)
        ]
        assert workers[0]["last_address"] == "192.0.2.10" and workers[0]["created_at"]
        assert (await api("DELETE", f"/admin/joined-workers/{body['worker_id']}"))[0] == 204
        assert await worker.wait_closed() == (1008, "worker credential revoked")
    assert (await api("DELETE", f"/admin/joined-workers/{body['worker_id']}"))[0] == 404
    assert (await api("DELETE", f"/admin/join-tokens/{made['id']}"))[0] == 204
    assert (await join(made["token"], "box-2"))[1]["error"]["message"] == "join token revoked"


async def test_manage_py_mints_lists_and_revokes(provider):
    out = io.StringIO()
    await sync_to_async(call_command)(
        "create_join_token", "--provider", "local", "--ttl", "30m", "--uses", "1", stdout=out
    )
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("mrj_") and "usable once" in out.getvalue()
    body = (await join(token, "lab-3"))[1]
    out = io.StringIO()
    await sync_to_async(call_command)("joined_workers", stdout=out)
    header, row = out.getvalue().splitlines()
    assert header.split()[:4] == ["ID", "NAME", "PROVIDER", "STATE"]
    assert row.split()[:3] == [str(body["worker_id"]), "lab-3", "local"]
    out = io.StringIO()
    await sync_to_async(call_command)("revoke_worker", "lab-3", stdout=out)
    assert f"revoked worker #{body['worker_id']} 'lab-3'" in out.getvalue()


@pytest.mark.parametrize("ttl", ["0s", "31d", "soon", "-1h"])
def test_create_join_token_refuses_a_ttl_out_of_range(ttl):
    from django.core.management.base import CommandError

    from workers_app.joining import parse_ttl
    from workers_app.models import JoinToken, Provider

    Provider.objects.create(name="local")
    with pytest.raises(ValueError):
        parse_ttl(ttl)
    with pytest.raises(CommandError, match=r"second|duration"):
        call_command("create_join_token", "--provider", "local", f"--ttl={ttl}")
    assert not JoinToken.objects.exists()


def _pepper() -> str:
    from django.conf import settings

    return settings.SECRET_PEPPER


@pytest.fixture
async def staff(provider):
    from django.contrib.auth.models import User
    from django.test import AsyncClient

    user = await sync_to_async(User.objects.create_superuser)("root", "root@example.com", "pw")
    client = AsyncClient()
    await client.aforce_login(user)
    return client


async def test_the_django_admin_mints_a_token_once_and_revokes_a_worker(staff, provider):
    from workers_app.models import JoinedWorker, JoinToken

    add = "/django-admin/workers_app/jointoken/add/"
    bad = await staff.post(add, {"provider": provider.pk, "uses": "1", "ttl": "40d"})
    assert "at most 30 days" in bad.content.decode() and not await JoinToken.objects.aexists()
    form = {"provider": provider.pk, "uses": "1", "ttl": "2h"}
    response = await staff.post(add, form, follow=True)
    page = response.content.decode()
    assert "Join token for provider <b>local</b>" in page
    token = page.split("user-select:all'>")[1].split("<")[0]
    row = await JoinToken.objects.aget()
    assert row.prefix == token[:12] and row.created_by == "admin: root"
    assert 7190 < (row.expires_at - row.created_at).total_seconds() < 7210
    listing = (await staff.get("/django-admin/workers_app/jointoken/")).content.decode()
    assert token not in listing and "usable" in listing

    body = (await join(token, "admin-box"))[1]
    async with joined(body["credential"]) as worker:
        await worker.register(["m"])
        workers = (await staff.get("/django-admin/workers_app/joinedworker/")).content.decode()
        assert "admin-box" in workers and "192.0.2.10" in workers
        action = {"action": "revoke", "_selected_action": [str(body["worker_id"])]}
        await staff.post("/django-admin/workers_app/joinedworker/", action, follow=True)
        assert await worker.wait_closed() == (1008, "worker credential revoked")
    assert (await JoinedWorker.objects.aget()).revoked_at is not None
    assert (await staff.get("/django-admin/workers_app/joinedworker/add/")).status_code == 403
