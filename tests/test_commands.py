"""``manage.py`` commands, including those that act on a live server's workers."""

from __future__ import annotations

import asyncio
import socket
import sys
from io import StringIO

import httpx
import pytest
from django.core.management import CommandError, call_command

from keys.models import ApiKey
from relay.wire import protocol
from tests.live import ROOT
from tests.rawworker import closed, connect, expect, register
from workers_app.models import Provider


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_create_provider_prints_its_secret_once():
    output = run("create_provider", "team-b", "--models", "a,b", "--max-queue-len", "5")
    secret = output.split("worker secret (shown once): ")[1].strip()
    provider = Provider.objects.get(name="team-b")
    assert provider.check_secret(secret)
    assert provider.declared_model_list == ["a", "b"] and provider.max_queue_len == 5
    with pytest.raises(CommandError, match="already exists"):
        run("create_provider", "team-b")
    with pytest.raises(CommandError, match="name"):
        run("create_provider", "no spaces allowed")


@pytest.mark.django_db
def test_api_keys_are_created_and_revoked_once():
    output = run("create_api_key", "ci")
    secret = output.split("key (shown once): ")[1].strip()
    key = ApiKey.objects.get(name="ci")
    assert key.prefix == secret[:12]
    assert "revoked API key" in run("revoke_api_key", str(key.id))
    with pytest.raises(CommandError, match="already revoked"):
        run("revoke_api_key", key.prefix)
    with pytest.raises(CommandError, match="no API key"):
        run("revoke_api_key", "424242")


@pytest.mark.parametrize("timeout", ["inf", "-inf", "nan", "-1", "0", "86401", "1e300"])
def test_drain_refuses_a_deadline_that_is_not_finite_and_within_a_day(timeout):
    # Checked before the server is contacted at all: nothing listens on this port, so a
    # command that got as far as the admin API would fail with "cannot reach" instead.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(CommandError, match="--timeout must be a finite number of seconds"):
        run("drain", "--all", f"--timeout={timeout}", "--server", url, "--token", "t")


async def manage(server, *args: str, token: str | None = "ops-token") -> tuple[int, str]:
    env = dict(server.env)
    env.pop("MODELRELAY_ADMIN_TOKEN", None)
    if token:
        env["MODELRELAY_ADMIN_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        *args,
        "--server",
        server.url,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode()


@pytest.mark.live
async def test_live_commands_list_refresh_and_drain(relay_server_factory):
    with relay_server_factory(MODELRELAY_ADMIN_TOKEN="ops-token") as server:
        async with await connect(server) as ws:
            ack = await register(ws, models=["llama3-8b"], max_concurrent=2)
            code, out = await manage(server, "workers")
            assert code == 0, out
            assert ack.worker_id in out and "llama3-8b" in out and "0/2" in out

            code, out = await manage(server, "refresh_models", "raw")
            assert code == 0 and f"asked raw ({ack.worker_id})" in out
            assert await expect(ws, protocol.ModelsRefresh)

            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                answer = asyncio.ensure_future(
                    client.post("/v1/chat/completions", json={"model": "llama3-8b"})
                )
                request = await expect(ws, protocol.Request)
                drain = asyncio.ensure_future(manage(server, "drain", "raw"))
                shutdown = await expect(ws, protocol.GracefulShutdown, timeout=30)
                assert shutdown.reason == "maintenance"
                await ws.send(
                    protocol.encode(
                        protocol.ResponseComplete(
                            request_id=request.request_id, status_code=200, body='{"ok":1}'
                        )
                    )
                )
                assert (await answer).json() == {"ok": 1}  # in-flight work completes
                assert await closed(ws) == (1000, "worker drained")
                code, out = await drain
                assert code == 0, out
                assert "draining raw" in out and "drained and disconnected" in out


@pytest.mark.live
async def test_live_commands_fail_with_one_clear_line(relay_server_factory):
    with relay_server_factory(MODELRELAY_ADMIN_TOKEN="ops-token") as server:
        code, out = await manage(server, "workers", token=None)
        assert code != 0 and "MODELRELAY_ADMIN_TOKEN is not set" in out
        code, out = await manage(server, "workers", token="wrong")
        assert code != 0 and "refused the admin token (403)" in out
        code, out = await manage(server, "drain", "nobody")
        assert code != 0 and "no connected worker with id or name 'nobody'" in out
        url = server.url
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        "workers",
        "--server",
        url,
        cwd=ROOT,
        env={**server.env, "MODELRELAY_ADMIN_TOKEN": "x"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out_b, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode != 0
    assert f"cannot reach the ModelRelay server at {url}" in out_b.decode()
    assert "Traceback" not in out_b.decode()


@pytest.mark.django_db
def test_create_api_key_takes_its_limits_as_flags():
    import datetime as dt

    output = run(
        "create_api_key",
        "lab",
        "--max-concurrent",
        "2",
        "--rpm",
        "30",
        "--tokens-per-day",
        "50000",
        "--tokens-per-month",
        "1000000",
        "--models",
        "llama3-8b, qwen",
        "--expires",
        "30d",
        "--weight",
        "2",
        "--default-class",
        "flex",
        "--max-class",
        "priority",
        "--deadline-ms",
        "1500",
    )
    assert "key (shown once): mrk_" in output
    key = ApiKey.objects.get(name="lab")
    limits = key.limits()
    assert (limits.max_concurrent, limits.requests_per_minute, limits.weight) == (2, 30, 2)
    assert (limits.default_class, limits.max_class) == ("flex", "priority")
    assert limits.deadline_ms == 1500
    assert (limits.tokens_per_day, limits.tokens_per_month) == (50_000, 1_000_000)
    assert limits.allowed_models == {"llama3-8b", "qwen"}
    assert key.expires_at is not None
    left = key.expires_at - dt.datetime.now(tz=dt.UTC)
    assert dt.timedelta(days=29) < left <= dt.timedelta(days=30)
    run("create_api_key", "dated", "--expires", "2031-02-03")
    assert ApiKey.objects.get(name="dated").expires_at == dt.datetime(2031, 2, 3, tzinfo=dt.UTC)
    with pytest.raises(CommandError, match="weight"):
        run("create_api_key", "heavy", "--weight", "0")
    with pytest.raises(CommandError, match="max-class"):
        run("create_api_key", "rude", "--max-class", "urgent")
    with pytest.raises(CommandError, match="--expires"):
        run("create_api_key", "when", "--expires", "someday")
    for bad in ("0", "3600001"):
        with pytest.raises(CommandError, match="deadline_ms"):
            run("create_api_key", "hasty", "--deadline-ms", bad)
