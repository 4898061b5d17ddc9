"""Two server processes sharing Redis and one database (SPEC §8, §10, §11)."""

from __future__ import annotations

import asyncio
import functools
import secrets

import httpx
import pytest

from relay.wire import protocol
from tests.clusterkit import cluster
from tests.conftest import REDIS_URL, require_redis
from tests.rawworker import closed, connect, expect, register
from tests.test_e2e import (
    CHAT,
    body_for,
    logged_rows,
    metric,
    new_rows,
    poll,
    read_until,
    routable,
    running_worker,
    went,
)
from tests.upstream import upstream_in_thread

pytestmark = [pytest.mark.live, pytest.mark.redis]

TOKEN = "cluster-admin"


async def eventually(check, timeout: float = 10.0, every: float = 0.05):
    """Poll ``check()`` (an async callable returning a truthy value) until it holds."""
    async with asyncio.timeout(timeout):
        while True:
            result = await check()
            if result:
                return result
            await asyncio.sleep(every)


async def test_admin_actions_and_key_changes_reach_every_process(relay_server_factory):
    require_redis()
    common = {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}",
        "MODELRELAY_ADMIN_TOKEN": TOKEN,
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "SYNC_SECS": "60",  # only the Redis broadcast can make key changes show up quickly
        # Processes sharing a database share these (docs/DEPLOY.md).
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    }
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with relay_server_factory(**common) as a:  # noqa: SIM117 (b needs a's database)
        with relay_server_factory(**common, DATABASE_URL=a.env["DATABASE_URL"]) as b:
            async with (
                httpx.AsyncClient(base_url=a.url, headers=auth, timeout=10) as admin_a,
                httpx.AsyncClient(base_url=b.url, timeout=10) as client_b,
                await connect(b) as ws,
            ):
                ack = await register(ws, models=["llama3-8b"])

                async def listed_on_a():
                    workers = (await admin_a.get("/admin/workers")).json()
                    return [w for w in workers if w["id"] == ack.worker_id]

                (listed,) = await eventually(listed_on_a)
                assert listed["name"] == "raw" and listed["instance"] != ""

                created = (await admin_a.post("/admin/keys", json={"name": "team"})).json()
                key = {"Authorization": f"Bearer {created['secret']}"}

                async def key_works_on_b():
                    return (await client_b.get("/v1/models", headers=key)).status_code == 200

                await eventually(key_works_on_b, timeout=5)

                refresh = await admin_a.post(f"/admin/workers/{ack.worker_id}/refresh")
                assert refresh.status_code == 202
                assert await expect(ws, protocol.ModelsRefresh)
                drain = await admin_a.post(
                    f"/admin/workers/{ack.worker_id}/drain", json={"reason": "move racks"}
                )
                assert drain.status_code == 202
                shutdown = await expect(ws, protocol.GracefulShutdown)
                assert shutdown.reason == "move racks"
                assert await closed(ws) == (1000, "worker drained")

                revoked = await admin_a.delete(f"/admin/keys/{created['id']}")
                assert revoked.status_code == 204

                async def refused_on_b():
                    return (await client_b.get("/v1/models", headers=key)).status_code == 401

                await eventually(refused_on_b, timeout=5)


def test_a_process_with_another_pepper_refuses_to_start(relay_server_factory):
    with relay_server_factory(MODELRELAY_SECRET_PEPPER="first") as a:
        second = relay_server_factory(
            MODELRELAY_SECRET_PEPPER="second", DATABASE_URL=a.env["DATABASE_URL"]
        )
        with pytest.raises(RuntimeError) as failure, second:
            pass
        assert "different MODELRELAY_SECRET_PEPPER" in str(failure.value)


def test_a_stream_served_by_another_process_is_not_cancelled_by_a_client_leaving_after_the_end(
    relay_server_factory,
):
    """The client's process (A) relays a stream from a worker of B's: A's client hangs up
    after [DONE], before the worker's completion. A keeps the exchange with B open, so
    neither process cancels: B logs the request ok with its tokens, A counts it ok."""
    with (
        upstream_in_thread() as up,
        cluster(relay_server_factory, 2, REQUEST_LOG_FLUSH_SECS="0.05") as (a, b),
        running_worker(b, up.url),
    ):
        poll(lambda: routable(a), what="B's worker to be routable at A")
        rows = len(logged_rows(b))
        body = body_for(CHAT, stream=True, tokens=3, prompt_tokens=9, hold_end=True)
        read_until(a, CHAT, body, b"data: [DONE]\n\n").close()
        (seen,) = up.wait_requests(1, path=CHAT)
        poll(functools.partial(went, a, seen, 1), what="A to see its client go")
        assert not seen.disconnected.is_set(), "the backend request was cancelled"
        up.release()
        up.wait_event(seen.finished)
        assert new_rows(b, rows, 1) == [(CHAT, 200, "ok", "", 9, 3)]
        poll(lambda: metric(a, "modelrelay_requests_total", outcome="ok") == 1, what="A: ok")
        assert metric(a, "modelrelay_requests_total", outcome="cancelled") == 0
        assert metric(b, "modelrelay_tokens_total") == 12
        assert metric(a, "modelrelay_cancels_total") == metric(b, "modelrelay_cancels_total") == 0
