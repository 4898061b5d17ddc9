"""The cluster's credentials are those of its live processes (SPEC §11, docs/CLUSTER.md).

A process whose credentials (a fingerprint of the token derived from
MODELRELAY_SECRET_PEPPER) differ from those of the processes that live stays out and
says so; once the last of them is gone and its TTL has passed, the credentials are the
next process's. So a deployment whose pepper was changed as docs/DEPLOY.md says forms a
cluster again by itself, and an old process that comes back after a stall stays out.
Timings are shrunk through settings (a tick of 0.2 s, keys outliving a process by 1 s).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import redis.asyncio as aioredis

from relay.server.cluster.state import ClusterState, CredentialsMismatch
from tests.clusterkit import AUTH, cluster, knows, private_redis, until
from tests.conftest import REDIS_URL, require_redis
from tests.live import ROOT, LiveServer
from tests.rawworker import connect, register
from tests.scriptedworker import ScriptedWorker
from tests.server.test_cluster_recovery import FAST, RECOVERY_SECS, chat, health, serving

pytestmark = [pytest.mark.live, pytest.mark.redis]

TTL_SECS = float(FAST["CLUSTER_TTL_SECS"])
#: A pepper change as docs/DEPLOY.md describes it completes within a few TTLs (the old
#: credentials outlive the last old process by one, and a tick or two more to notice).
REFORM_SECS = 5 * TTL_SECS
#: What every process of one deployment shares but the pepper (docs/CLUSTER.md).
SHARED = (
    "DATABASE_URL",
    "REDIS_URL",
    "REDIS_PREFIX",
    "DJANGO_SECRET_KEY",
    "MODELRELAY_ADMIN_TOKEN",
    "HEARTBEAT_INTERVAL_SECS",
)


async def state_of(client: httpx.AsyncClient, server: LiveServer) -> dict[str, str]:
    return (await health(client, server)).get("cluster", {})


async def all_ok(client: httpx.AsyncClient, servers: list[LiveServer]) -> bool:
    return all([(await state_of(client, s)).get("state") == "ok" for s in servers])


async def kept_out(client: httpx.AsyncClient, server: LiveServer) -> bool:
    """``server`` says it stays out for its credentials (not for Redis being away)."""
    state = await state_of(client, server)
    return state.get("state") == "degraded" and "MODELRELAY_SECRET_PEPPER" in state["problem"]


async def cluster_credentials(url: str, prefix: str) -> tuple[str | None, int]:
    """The credentials Redis holds for the cluster, and the milliseconds they have left
    (-1: they never expire, -2: there are none)."""
    key = f"{prefix}:credentials"
    async with aioredis.from_url(url) as redis:
        value, left = await redis.get(key), await redis.pttl(key)
    return (None if value is None else ClusterState.decode(value)), left


def forget_pepper(server: LiveServer) -> None:
    """The step docs/DEPLOY.md asks for before a new pepper: remove its fingerprint."""
    subprocess.run(
        [
            sys.executable,
            "manage.py",
            "shell",
            "-c",
            "from workers_app.models import SiteState; "
            "SiteState.objects.filter(name='pepper_fingerprint').delete()",
        ],
        cwd=ROOT,
        env=server.env,
        check=True,
        capture_output=True,
        timeout=60,
    )


async def test_a_cluster_restarted_with_a_new_pepper_forms_again(relay_server_factory, tmp_path):
    """Every process stopped, the fingerprint removed, every process started with the
    new pepper: the old deployment's credentials went with its last process, so within
    a few TTLs every process says ``ok`` and a request placed across processes is
    served. (They used to stay ``degraded`` for good: Redis kept the old credentials.)"""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        prefix = a.env["REDIS_PREFIX"]
        async with httpx.AsyncClient(timeout=15) as client:
            await until(lambda: all_ok(client, [a, b]), RECOVERY_SECS, "the cluster to form")
            old, _ = await cluster_credentials(url, prefix)
            for server in (a, b):
                assert server.stop() == 0, server.log()
            forget_pepper(a)
            pepper = secrets.token_urlsafe(32)
            for server in (a, b):
                server.env["MODELRELAY_SECRET_PEPPER"] = pepper
                server.start()
            started = time.monotonic()
            await until(lambda: all_ok(client, [a, b]), REFORM_SECS, "the new cluster to form")
            assert time.monotonic() - started < REFORM_SECS
            new, left = await cluster_credentials(url, prefix)
            assert new is not None and new != old
            assert 0 < left <= TTL_SECS * 1000  # they go with the last process that has them
            async with ScriptedWorker(a, ["after-the-change"]) as worker, serving(worker):
                await knows(b, "after-the-change")
                response = await chat(client, b, "after-the-change")
                assert response.status_code == 200, response.text
                assert worker.peak == 1


async def test_a_new_pepper_waits_for_the_old_process_then_takes_over_by_itself(
    relay_server_factory, tmp_path
):
    """While a process with the old pepper lives, one started with the new pepper (the
    fingerprint removed, the same database) stays out and says so in ``/health``, its
    log and ``/admin/stats``; the old one keeps the credentials alive past many TTLs.
    When the old one stops answering for longer than its TTL (stalled here), the new
    one takes over by itself, and the old one, when it runs again, stays out and says
    so: it never takes the credentials back."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 1, REDIS_URL=url, **FAST) as (old,),
    ):
        prefix = old.env["REDIS_PREFIX"]
        forget_pepper(old)
        shared = {name: old.env[name] for name in SHARED}
        with relay_server_factory(
            **shared, **FAST, MODELRELAY_SECRET_PEPPER=secrets.token_urlsafe(32)
        ) as new:
            async with httpx.AsyncClient(timeout=15) as client, await connect(new) as ws:
                await register(ws, models=["only-at-new"])
                await until(lambda: kept_out(client, new), RECOVERY_SECS, "the new one to wait")
                new.wait_for_log("cluster degraded (this process's cluster credentials differ")
                stats = await client.get(new.url + "/admin/stats", headers=AUTH)
                assert "MODELRELAY_SECRET_PEPPER" in stats.json()["cluster"]["problem"]
                held, _ = await cluster_credentials(url, prefix)

                # Many TTLs on, the old process still holds the cluster.
                watched = time.monotonic()
                while time.monotonic() - watched < 3 * TTL_SECS:
                    assert await kept_out(client, new)
                    assert (await state_of(client, old))["state"] == "ok"
                    await asyncio.sleep(0.1)
                listed = (await client.get(old.url + "/v1/models")).json()["data"]
                assert "only-at-new" not in {m["id"] for m in listed}
                assert (await cluster_credentials(url, prefix))[0] == held

                assert old.process is not None
                old.process.send_signal(signal.SIGSTOP)
                try:
                    await until(lambda: all_ok(client, [new]), REFORM_SECS, "the new to take over")
                finally:
                    old.process.send_signal(signal.SIGCONT)
                took_over, _ = await cluster_credentials(url, prefix)
                assert took_over != held
                new.wait_for_log("(no live process has other credentials any more)")

                await until(lambda: kept_out(client, old), RECOVERY_SECS, "the old to stay out")
                old.wait_for_log("cluster degraded (this process's cluster credentials differ")
                assert (await state_of(client, new))["state"] == "ok"
                assert (await cluster_credentials(url, prefix))[0] == took_over
                listed = (await client.get(new.url + "/v1/models")).json()["data"]
                assert "only-at-new" in {m["id"] for m in listed}


async def test_a_process_with_other_credentials_stays_out_and_says_so(
    relay_server_factory, tmp_path
):
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 1, REDIS_URL=url, **FAST) as (a,),
        relay_server_factory(
            REDIS_URL=url,
            REDIS_PREFIX=a.env["REDIS_PREFIX"],
            MODELRELAY_SECRET_PEPPER="another-pepper",
            **FAST,
        ) as rogue,
    ):
        async with httpx.AsyncClient(timeout=15) as client, await connect(rogue) as ws:
            await register(ws, models=["rogue-model"])

            async def refused() -> bool:
                state = (await health(client, rogue))["cluster"]
                return state["state"] == "degraded" and "PEPPER" in state["problem"]

            await until(refused, RECOVERY_SECS, "the other process to refuse to join")
            assert (await health(client, a))["cluster"]["state"] == "ok"
            models = {m["id"] for m in (await client.get(a.url + "/v1/models")).json()["data"]}
            assert "rogue-model" not in models


# -- the announcing script alone, on the tests' Redis ----------------------------------


@asynccontextmanager
async def shared_state() -> AsyncIterator[tuple[ClusterState, aioredis.Redis]]:
    require_redis()
    redis = aioredis.from_url(REDIS_URL)
    state = ClusterState(redis, f"mrtest-{secrets.token_hex(4)}")
    try:
        yield state, redis
    finally:
        keys = [k async for k in redis.scan_iter(match=f"{state.prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def _announce(state: ClusterState, instance: str, credentials: str, ttl_ms: int) -> bool:
    """True when ``instance`` is in the cluster, False when it is kept out."""
    try:
        await state.announce(instance, f"http://{instance}", [], 0, ttl_ms, credentials)
    except CredentialsMismatch:
        return False
    return True


async def test_of_two_processes_with_other_credentials_starting_at_once_one_wins():
    async with shared_state() as (state, redis):
        for round_ in range(20):
            await redis.delete(f"{state.prefix}:credentials")
            joined = await asyncio.gather(
                _announce(state, f"a{round_}", "credentials-a", 60_000),
                _announce(state, f"b{round_}", "credentials-b", 60_000),
            )
            assert sorted(joined) == [False, True]
            winner = "credentials-a" if joined[0] else "credentials-b"
            assert ClusterState.decode(await redis.get(f"{state.prefix}:credentials")) == winner


async def test_the_credentials_live_as_long_as_the_longest_lived_process_that_has_them():
    async with shared_state() as (state, redis):
        key = f"{state.prefix}:credentials"
        assert await _announce(state, "long", "same", 60_000)
        assert await _announce(state, "short", "same", 1_000)
        # A process with a shorter TTL does not cut the others' short.
        assert 1_000 < await redis.pttl(key) <= 60_000
        assert not await _announce(state, "other", "another", 60_000)
        assert 1_000 < await redis.pttl(key) <= 60_000  # nor does one that is kept out
        await redis.delete(key)  # as when the last process that had them lapsed
        assert await _announce(state, "other", "another", 60_000)
        assert not await _announce(state, "long", "same", 60_000)


async def test_credentials_written_without_an_expiry_expire_once_no_process_renews_them():
    """Credentials an older version stored for good are given a TTL: a deployment left
    with a stale fingerprint re-forms once its processes run this version."""
    async with shared_state() as (state, redis):
        key = f"{state.prefix}:credentials"
        await redis.set(key, "of-a-deployment-long-gone")
        assert not await _announce(state, "new", "current", 1_000)
        assert 0 < await redis.pttl(key) <= 1_000
        await redis.set(key, "current")  # a process that has them gives them its TTL
        assert await _announce(state, "new", "current", 1_000)
        assert 0 < await redis.pttl(key) <= 1_000
