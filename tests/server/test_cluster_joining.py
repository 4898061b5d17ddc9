"""Joined workers across server processes sharing Redis and a database (SPEC §22, §11):
one connection per identity whichever process it reaches, and a revocation made through
one process closes the worker on the process that holds its socket within a heartbeat
interval — through the broadcast, or without it at that process's next sync."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import websockets

from relay.wire import joining, protocol
from tests.clusterkit import AUTH, cluster
from tests.live import ROOT, LiveServer
from tests.rawworker import closed, register

pytestmark = [pytest.mark.live, pytest.mark.redis]

HEARTBEAT = 3.0


async def joined_socket(server: LiveServer, credential: str):
    return await websockets.connect(
        server.ws_url + "?provider=local",
        additional_headers={joining.CREDENTIAL_HEADER: credential},
        max_size=None,
    )


def mint(server: LiveServer) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", "create_join_token", "--provider=local"],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


async def join(server: LiveServer, name: str) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        token = await asyncio.to_thread(mint, server)
        response = await client.post(joining.PATH, json={"token": token, "name": name})
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "sync-only"])
async def test_a_revocation_through_one_process_closes_the_worker_held_by_another(
    relay_server_factory, broadcast
):
    with cluster(relay_server_factory, 2, HEARTBEAT_INTERVAL_SECS=str(HEARTBEAT)) as (a, b):
        one, two = await join(a, "box-1"), await join(a, "box-2")
        first = await joined_socket(b, one["credential"])
        second = await joined_socket(b, two["credential"])
        try:
            await register(first)
            kept = await register(second)
            # The identity is held by b's connection: a process elsewhere refuses it.
            async with await joined_socket(a, one["credential"]) as thief:
                assert await closed(thief) == (
                    1008,
                    f"worker 'box-1' (#{one['worker_id']}) is connected already",
                )
            started = time.monotonic()
            if broadcast:
                async with httpx.AsyncClient(base_url=a.url, headers=AUTH, timeout=10) as admin:
                    revoked = await admin.delete(f"/admin/joined-workers/{one['worker_id']}")
                assert revoked.status_code == 204
            else:  # written to the database only: b finds it at its next sync
                await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-c", _REVOKE_QUIETLY.format(id=one["worker_id"])],
                    cwd=ROOT,
                    env=a.env | {"REDIS_URL": ""},
                    check=True,
                    timeout=60,
                )
            assert await closed(first, timeout=HEARTBEAT) == (1008, "worker credential revoked")
            assert time.monotonic() - started < HEARTBEAT
            await second.send(protocol.encode(protocol.Pong(current_load=0)))
            async with httpx.AsyncClient(base_url=b.url, headers=AUTH, timeout=10) as admin:
                listed = [w["id"] for w in (await admin.get("/admin/workers")).json()]
            assert kept.worker_id in listed and second.close_code is None
        finally:
            await first.close()
            await second.close()


_REVOKE_QUIETLY = """
import os, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "modelrelay_site.settings")
django.setup()
from django.utils import timezone
from workers_app.models import JoinedWorker
JoinedWorker.objects.filter(pk={id}).update(revoked_at=timezone.now())
"""
