"""Security edges against live servers: evicting workers by rotating their provider's secret
(in one process and across processes sharing Redis), who may read the files
``manage.py serve`` keeps in DATA_DIR, and that no secret reaches the server's log.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import sqlite3
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from relay.wire import protocol
from tests import live
from tests.conftest import REDIS_URL, require_redis
from tests.live import ROOT, LiveServer
from tests.rawworker import closed, connect, expect, register

pytestmark = pytest.mark.live

OPERATOR, PASSWORD = "operator", "correct-horse-battery"
ADMIN_TOKEN = "security-edges-admin"


# --------------------------------------------------------------------------- helpers


async def create_superuser(server: LiveServer) -> None:
    """An admin user in the server's database, made the way an operator would."""
    env = {
        **server.env,
        "DJANGO_SUPERUSER_USERNAME": OPERATOR,
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        "DJANGO_SUPERUSER_EMAIL": "operator@example.com",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        "createsuperuser",
        "--noinput",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, output.decode()


@asynccontextmanager
async def admin_session(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client logged in to the Django admin through its login form."""
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        await client.get("/django-admin/login/")
        response = await client.post(
            "/django-admin/login/?next=/django-admin/",
            data={
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
                "username": OPERATOR,
                "password": PASSWORD,
                "next": "/django-admin/",
            },
        )
        assert response.status_code == 302, response.text
        yield client


async def provider_action(client: httpx.AsyncClient, action: str) -> tuple[str, str]:
    """Run an admin action on the only provider; the new secret and the outcome shown."""
    listing = (await client.get("/django-admin/workers_app/provider/")).text
    (pk,) = re.findall(r'name="_selected_action" value="(\d+)"', listing)
    response = await client.post(
        "/django-admin/workers_app/provider/",
        data={
            "csrfmiddlewaretoken": client.cookies["csrftoken"],
            "action": action,
            "_selected_action": pk,
            "index": "0",
        },
        follow_redirects=True,
    )
    assert response.status_code == 200
    secret = re.search(r"user-select:all'>(mrw_[^<]+)<", response.text)
    outcome = re.search(r"((?:Workers already connected|Disconnected) [^<]+)<", response.text)
    assert secret and outcome, response.text
    return secret.group(1), outcome.group(1)


async def workers_connected(server: LiveServer) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        return int((await client.get("/health")).json()["workers_connected"])


async def listed_by(server: LiveServer, count: int) -> None:
    """Wait until ``server``'s admin API lists ``count`` workers (with Redis: of every
    process, as last published)."""
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=10) as client:
        async with asyncio.timeout(10):
            while len((await client.get("/admin/workers")).json()) != count:
                await asyncio.sleep(0.05)


async def rotate_then_rotate_and_disconnect(admin_at: LiveServer, worker_at: LiveServer) -> None:
    """A worker on ``worker_at``; the operator rotates its secret in ``admin_at``'s admin."""
    await create_superuser(admin_at)
    async with admin_session(admin_at) as admin, await connect(worker_at) as ws:
        await register(ws)
        await listed_by(admin_at, 1)  # what the operator sees before acting
        # Plain rotation: the connected worker is left alone.
        _, outcome = await provider_action(admin, "rotate_secret")
        assert "keep running" in outcome
        assert await workers_connected(worker_at) == 1

        secret, outcome = await provider_action(admin, "rotate_secret_and_disconnect")
        assert "Disconnected 1 connected worker(s)" in outcome, outcome
        assert await closed(ws, timeout=10) == (1008, "provider secret rotated")
    # The evicted worker cannot come back with what it had, only with the new secret.
    async with await connect(worker_at) as ws:
        assert await closed(ws) == (1008, "invalid worker secret")
    async with await connect(worker_at, secret=secret) as ws:
        assert (await register(ws)).models == ["m"]
        await ws.send(protocol.encode(protocol.Pong(current_load=0)))


# --------------------------------------------------------------------------- G: rotation


async def test_rotate_and_disconnect_in_the_admin_evicts_a_connected_worker(
    relay_server_factory,
):
    with relay_server_factory(MODELRELAY_ADMIN_TOKEN=ADMIN_TOKEN) as server:
        await rotate_then_rotate_and_disconnect(server, server)


@pytest.mark.redis
async def test_rotate_and_disconnect_reaches_a_worker_on_another_process(relay_server_factory):
    require_redis()
    common = {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}",
        "MODELRELAY_ADMIN_TOKEN": ADMIN_TOKEN,
        "SYNC_SECS": "60",
        # Processes sharing a database share these (docs/DEPLOY.md).
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    }
    with relay_server_factory(**common) as a:  # noqa: SIM117 (b needs a's database)
        with relay_server_factory(**common, DATABASE_URL=a.env["DATABASE_URL"]) as b:
            await rotate_then_rotate_and_disconnect(a, b)


# --------------------------------------------------------------------------- C: file modes


def modes(directory: Path) -> dict[str, int]:
    """Permission bits of ``directory`` ('.') and of every file in it."""
    found = {".": stat.S_IMODE(directory.stat().st_mode)}
    for path in directory.iterdir():
        found[path.name] = stat.S_IMODE(path.stat().st_mode)
    return found


def test_serve_keeps_data_dir_and_the_sqlite_database_private(relay_server_factory, tmp_path):
    # As `make run` has it: no DATABASE_URL, so SQLite in a DATA_DIR that does not exist yet.
    data_dir = tmp_path / "run" / "var"
    env = {"DATA_DIR": str(data_dir), "DATABASE_URL": "", "WORKER_SECRET": ""}
    with relay_server_factory(**env):
        fresh = modes(data_dir)
    assert fresh["."] == 0o700, fresh
    assert {"db.sqlite3", "secret_key", "pepper", "worker_secret"} <= fresh.keys()
    assert {name: mode for name, mode in fresh.items() if name != "."} == {
        name: 0o600 for name in fresh if name != "."
    }

    # An installation from before: everything world-readable, and a writer holding the
    # database open in WAL mode so that its -wal and -shm files exist too.
    data_dir.chmod(0o755)
    for path in data_dir.iterdir():
        path.chmod(0o644)
    with closing(sqlite3.connect(data_dir / "db.sqlite3")) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS probe (x)")
        db.execute("INSERT INTO probe VALUES (1)")
        db.commit()
        before = modes(data_dir)
        assert before["db.sqlite3-wal"] == before["db.sqlite3-shm"] == 0o644
        with relay_server_factory(**env):
            after = modes(data_dir)
    assert after == {name: 0o700 if name == "." else 0o600 for name in before}, after


# --------------------------------------------------------------------------- D: secrets in logs


def secret(kind: str) -> str:
    return f"{kind}_{secrets.token_urlsafe(24)}"


async def raw_worker(server: LiveServer, secret: str, *, via_query: bool) -> Any:
    query = "provider=local" + (f"&worker_secret={secret}" if via_query else "")
    headers = {} if via_query else {"X-Worker-Secret": secret}
    return await websockets.connect(
        f"{server.ws_url}?{query}", additional_headers=headers, max_size=None
    )


async def answer_one(ws: Any) -> None:
    request = await expect(ws, protocol.Request, timeout=10)
    done = protocol.ResponseComplete(
        request_id=request.request_id,
        status_code=200,
        headers={"content-type": "application/json"},
        body='{"ok": true}',
    )
    await ws.send(protocol.encode(done))


def test_the_banner_shows_a_generated_worker_secret_only_on_the_start_that_made_it(
    relay_server_factory, tmp_path
):
    data_dir = tmp_path / "var"
    with relay_server_factory(DATA_DIR=str(data_dir), WORKER_SECRET="") as server:
        generated = (data_dir / "worker_secret").read_text().strip()
        first = server.log()
        server.restart()
        second = server.log()[len(first) :]
    assert f"WORKER_SECRET={generated} python worker.py --proxy-url" in first
    assert "generated now and kept in" in first
    assert "WORKER_SECRET=<worker secret> python worker.py --proxy-url" in second
    assert f"the worker secret {generated[:12]}… is kept in {data_dir / 'worker_secret'}" in (
        second
    )
    assert generated not in second


@pytest.mark.parametrize("asgi_server", ["daphne", "uvicorn"])
async def test_no_worker_secret_or_api_key_reaches_the_server_log(
    relay_server_factory, monkeypatch, asgi_server
):
    monkeypatch.setattr(live, "SERVER", asgi_server)
    worker_secret, admin_token = secret("mrw"), secret("adm")
    wrong_header, wrong_query = secret("mrw"), secret("mrw")
    env = {
        "LOG_LEVEL": "debug",  # no level may carry a secret
        "WORKER_SECRET": worker_secret,
        "MODELRELAY_ADMIN_TOKEN": admin_token,
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "AUTH_MAX_FAILURES": "100",
    }
    with relay_server_factory(**env) as server:
        admin = {"Authorization": f"Bearer {admin_token}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            key = (await client.post("/admin/keys", json={"name": "a"}, headers=admin)).json()
            revoked = (await client.post("/admin/keys", json={"name": "b"}, headers=admin)).json()
            gone = await client.delete(f"/admin/keys/{revoked['id']}", headers=admin)
            assert gone.status_code == 204
            used = [worker_secret, admin_token, key["secret"], revoked["secret"]]

            # Workers: the secret in the header, and once in the query-string fallback.
            async with (
                await raw_worker(server, worker_secret, via_query=False) as by_header,
                await raw_worker(server, worker_secret, via_query=True) as by_query,
            ):
                assert (await register(by_header, models=["m"])).models == ["m"]
                assert (await register(by_query, models=["q"])).models == ["q"]
                for wrong, via_query in ((wrong_header, False), (wrong_query, True)):
                    used.append(wrong)
                    async with await raw_worker(server, wrong, via_query=via_query) as ws:
                        assert await closed(ws) == (1008, "invalid worker secret")

                # Inference with valid, revoked and made-up keys, both header styles.
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                answering = asyncio.ensure_future(answer_one(by_header))
                valid = {"Authorization": f"Bearer {key['secret']}"}
                response = await client.post("/v1/chat/completions", json=chat, headers=valid)
                assert response.status_code == 200, response.text
                await answering
                answering = asyncio.ensure_future(answer_one(by_query))
                anthropic = {"x-api-key": key["secret"], "anthropic-version": "2023-06-01"}
                message = {**chat, "model": "q", "max_tokens": 5}
                response = await client.post("/v1/messages", json=message, headers=anthropic)
                assert response.status_code == 200, response.text
                await answering
                assert (await client.get("/v1/models", headers=valid)).status_code == 200
                made_up = [secret("mrk"), "sk-" + secrets.token_hex(20)]
                used += made_up
                for bad in [revoked["secret"], *made_up]:
                    for path, headers, body in (
                        ("/v1/chat/completions", {"Authorization": f"Bearer {bad}"}, chat),
                        ("/v1/messages", {"x-api-key": bad}, message),
                    ):
                        response = await client.post(path, json=body, headers=headers)
                        assert response.status_code == 401, response.text
                    models = await client.get("/v1/models", headers={"Authorization": bad})
                    assert models.status_code == 401
        server.stop()  # every line written, shutdown included
        output = server.log()

    assert "worker registered" in output  # the log is the debug-level one
    # Nothing past the 12-character lookup prefix (which the admin shows) may appear:
    # neither what follows it nor the end, so a truncated copy is caught too.
    leaks = {
        credential: [
            line
            for line in output.splitlines()
            if credential[12:24] in line or credential[-12:] in line
        ]
        for credential in used
    }
    assert {c: lines for c, lines in leaks.items() if lines} == {}, output
