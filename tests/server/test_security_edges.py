"""Security edges against live servers: evicting workers by rotating their provider's secret
(in one process and across processes sharing Redis), and who may read the files
``manage.py serve`` keeps in DATA_DIR.
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

import httpx
import pytest

from relay.wire import protocol
from tests.conftest import require_service
from tests.live import ROOT, LiveServer
from tests.rawworker import closed, connect, register

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
    require_service("Redis", "127.0.0.1", 6379)
    common = {
        "REDIS_URL": "redis://127.0.0.1:6379/0",
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
