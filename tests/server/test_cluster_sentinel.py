"""Cluster mode on a Redis that fails over: Sentinel (SPEC §20).

One master, one replica and three sentinels of the module's own (``tests/sentinelkit.py``,
shared by its tests), with the sentinels' timings shrunk; live server processes found
it through ``REDIS_SENTINELS``. What is checked: discovery at start, a ``SENTINEL
FAILOVER`` and a ``kill -9`` of the master under load (no request lost or answered
twice, every process ``ok`` again, every use of Redis — placement, the lean client,
limits, control orders, the channel layer — on the new master), a ``-READONLY`` from a
demoted master, a sentinel down, a wrong master name, and a Redis that stops answering.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from relay.server.cluster.leanredis import LeanRedis, Script
from relay.server.cluster.redisconf import RedisTarget
from relay.server.cluster.redissource import MasterUnknown, RedisSource
from tests.batchkit import jsonl, line
from tests.clusterkit import AUTH, CHAT, cluster, knows, private_redis, until
from tests.live import ROOT, LiveServer
from tests.rawworker import closed, register
from tests.scriptedworker import ScriptedWorker
from tests.sentinelkit import SentinelSet, free_ports, names_on, sentinel_set, wait_for
from tests.server.test_cluster_joining import join, joined_socket

pytestmark = [pytest.mark.live, pytest.mark.redis]

FAST = {
    "CLUSTER_TICK_SECS": "0.2",
    "CLUSTER_TTL_SECS": "1",
    "REDIS_TIMEOUT_SECS": "0.5",
    "QUEUE_TIMEOUT_SECS": "20",
    "REQUEST_TIMEOUT_SECS": "30",
    "SYNC_SECS": "0.2",
    "LIMITS_LEASE_SECS": "1.5",
    "BATCH_POLL_SECS": "0.2",
}
#: How long every process may take to be ``ok`` again once the new master takes writes
#: (the master's down-after and a couple of ticks, generous for a busy machine).
RECOVERY_SECS = 10.0
#: Every role a process's own connections carry in CLIENT LIST (keys required).
ROLES = {"cluster", "place", "control", "limits", "admit"}


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    with sentinel_set(tmp_path_factory.mktemp("sentinel")) as found:
        yield found


async def states(client: httpx.AsyncClient, servers: list[LiveServer]) -> list[str]:
    found = []
    for server in servers:
        body = (await client.get(server.url + "/health")).json()
        found.append(body.get("cluster", {}).get("state", ""))
    return found


async def all_ok(client: httpx.AsyncClient, servers: list[LiveServer]) -> bool:
    return await states(client, servers) == ["ok"] * len(servers)


async def new_key(client: httpx.AsyncClient, server: LiveServer, **limits: Any) -> str:
    made = await client.post(server.url + "/admin/keys", json={"name": "k", **limits}, headers=AUTH)
    assert made.status_code == 201, made.text
    return str(made.json()["secret"])


async def key_known(client: httpx.AsyncClient, secret: str, *servers: LiveServer) -> None:
    for server in servers:

        async def loaded(server: LiveServer = server) -> bool:
            listed = await client.get(
                server.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}
            )
            return listed.status_code == 200

        await until(loaded, RECOVERY_SECS, "the key to be known")


def master_roles(sentinels: SentinelSet) -> set[str]:
    return names_on(sentinels.master())


async def test_every_use_of_redis_follows_the_master_through_a_failover_and_a_kill(
    relay_server_factory, sentinels
):
    """Under steady load at both processes (each process's requests are placed on both
    workers): ``SENTINEL FAILOVER``, then ``kill -9`` of the master. Every request is
    answered once, 200; every process is ``ok`` again; every connection is on the new
    master and none on the old one; per-key limits, control orders and the channel
    layer work there."""
    env = {**sentinels.env, **FAST, "MODELRELAY_REQUIRE_API_KEYS": "true"}
    with cluster(relay_server_factory, 2, **env) as (a, b):
        servers = [a, b]
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["m"], max_concurrent=2) as wa,
            ScriptedWorker(b, ["m", "held"], max_concurrent=2) as wb,
        ):
            await until(lambda: all_ok(client, servers), RECOVERY_SECS, "the cluster to join")
            # (The admission's connection is made by the first request with a key.)
            assert ROLES - {"admit"} <= master_roles(sentinels)
            assert not names_on(sentinels.replica()), "a connection on the replica"
            # A counted limit, so that every request is admitted through Redis too.
            secret = await new_key(client, a, max_concurrent=100)
            auth = {"Authorization": f"Bearer {secret}"}
            await key_known(client, secret, a, b)
            answered: Counter[str] = Counter()
            outcomes: list[int | str] = []
            stop = asyncio.Event()

            async def answer(worker: ScriptedWorker) -> None:
                while True:
                    request = await worker.requests.get()
                    answered[request.request_id] += 1
                    await worker.answer(request)

            async def steady(server: LiveServer) -> None:
                while not stop.is_set():
                    try:
                        response = await client.post(
                            server.url + CHAT, json={"model": "m"}, headers=auth
                        )
                        outcomes.append(response.status_code)
                    except httpx.HTTPError as exc:
                        outcomes.append(type(exc).__name__)

            serving = [asyncio.ensure_future(answer(w)) for w in (wa, wb)]
            load = [asyncio.ensure_future(steady(s)) for s in servers for _ in range(3)]
            try:
                for fault, act in (
                    ("SENTINEL FAILOVER", sentinels.failover),
                    ("kill -9 of the master", sentinels.kill_master),
                ):
                    before = len(outcomes)
                    old = sentinels.master()
                    new = await asyncio.to_thread(act)
                    answers = time.monotonic()
                    await until(lambda: all_ok(client, servers), RECOVERY_SECS, f"ok after {fault}")
                    took = time.monotonic() - answers
                    try:
                        await until(
                            lambda new=new: _true(names_on(new) >= ROLES),
                            RECOVERY_SECS,
                            f"every connection on the new master after {fault}",
                        )
                    except TimeoutError:
                        raise AssertionError(
                            f"{fault}: on the new master {names_on(new)}, the old {names_on(old)}"
                            + a.log()[-6000:]
                        ) from None
                    if fault == "SENTINEL FAILOVER":
                        await until(
                            lambda old=old: _true(not names_on(old)),
                            RECOVERY_SECS,
                            "no connection left on the old master",
                        )
                    await until(
                        lambda before=before: _more(outcomes, before + 20),
                        RECOVERY_SECS,
                        f"requests to flow after {fault}",
                    )
                    print(f"{fault}: every process ok {took:.2f}s after the new master answered")
            finally:
                stop.set()
                await asyncio.gather(*load)
                for task in serving:
                    task.cancel()
            failed = [o for o in outcomes if o != 200]
            assert len(outcomes) > 50
            assert failed == [], f"{len(failed)} of {len(outcomes)} failed: {failed[:10]}"
            assert max(answered.values()) == 1, "a request reached a worker twice"
            assert wa.peak <= 2 and wb.peak <= 2

            # Per-key limits on the new master: one slot held at A, none more at B.
            one = await new_key(client, a, max_concurrent=1)
            await key_known(client, one, a, b)

            async def listed() -> bool:
                models = await client.get(
                    a.url + "/v1/models", headers={"Authorization": f"Bearer {one}"}
                )
                return any(m["id"] == "held" for m in models.json()["data"])

            await until(listed, RECOVERY_SECS, "B's model to be known at A")
            held = asyncio.ensure_future(
                client.post(
                    a.url + CHAT,
                    json={"model": "held"},
                    headers={"Authorization": f"Bearer {one}"},
                )
            )
            request = await wb.next()
            refused = await client.post(
                b.url + CHAT, json={"model": "m"}, headers={"Authorization": f"Bearer {one}"}
            )
            assert refused.status_code == 429, refused.text
            await wb.answer(request)
            assert (await held).status_code == 200

            # The channel layer's group lives on the new master, with both processes.
            prefix = a.env["REDIS_PREFIX"]
            with sentinels.client(sentinels.master()) as node:
                group = f"{prefix}:asgi::group:modelrelay.control"
                await until(
                    lambda: _true(node.zcard(group) >= 2), RECOVERY_SECS, "the layer's group"
                )

            # Every key the cluster keeps on the new master expires by itself, but the
            # shared queue's own structures (they empty themselves) and the process list
            # (pruned on reading).
            with sentinels.client(sentinels.master()) as node:
                lasting = [
                    key
                    for key in node.scan_iter(match=f"{prefix}:*")
                    if node.pttl(key) == -1 and not _structural(key, prefix)
                ]
            assert lasting == []

            # A batch sent to A after both faults: its lines are claimed and placed (on
            # either worker) through the new master.
            serving = [asyncio.ensure_future(_answer_all(w)) for w in (wa, wb)]
            try:
                await _batch_runs(client, a, auth)
            finally:
                for task in serving:
                    task.cancel()

            # A drain sent through A reaches B's worker (an order, read back from Redis).
            drained = await client.post(
                a.url + f"/admin/workers/{wb.worker_id}/drain", headers=AUTH, json={}
            )
            assert drained.status_code == 202, drained.text + b.log()[-4000:]
            # (An idle worker drains at once: it is told, and closed.)
            await asyncio.to_thread(b.wait_for_log, f"draining raw ({wb.worker_id})")


async def _batch_runs(client: httpx.AsyncClient, server: LiveServer, auth: dict[str, str]) -> None:
    lines = jsonl(*(line(f"after-failover-{n}") for n in range(3)))
    uploaded = await client.post(
        server.url + "/v1/files",
        files={"file": ("in.jsonl", lines, "application/jsonl")},
        data={"purpose": "batch"},
        headers=auth,
    )
    assert uploaded.status_code == 200, uploaded.text
    made = await client.post(
        server.url + "/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
        headers=auth,
    )
    assert made.status_code == 200, made.text

    async def completed() -> dict[str, Any] | None:
        batch = await client.get(server.url + f"/v1/batches/{made.json()['id']}", headers=auth)
        document: dict[str, Any] = batch.json()
        return document if document["status"] in ("completed", "failed") else None

    batch = await until(completed, RECOVERY_SECS, "the batch to complete")
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, batch


def _structural(key: str, prefix: str) -> bool:
    kind = key[len(prefix) + 1 :].split(":", 1)[0]
    return kind in {"procs", "q", "ql", "qm", "qk", "qr", "qc", "qw"}


async def _true(value: bool) -> bool:
    return value


async def _more(outcomes: list[Any], than: int) -> bool:
    return len(outcomes) > than


async def test_an_order_whose_message_was_lost_is_read_back_from_redis(
    relay_server_factory, sentinels
):
    """A drain recorded for a process whose control message never came (sent during a
    failover) is applied within a second all the same, once."""
    with cluster(relay_server_factory, 1, **sentinels.env, **FAST) as (a,):
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["m"], max_concurrent=1) as worker,
        ):
            await until(lambda: all_ok(client, [a]), RECOVERY_SECS, "the process to join")
            instance = (await client.get(a.url + "/health")).json()["cluster"]["instance"]
            key = f"{a.env['REDIS_PREFIX']}:orders:{instance}"
            order = json.dumps(
                {"type": "relay.drain", "worker_id": worker.worker_id, "reason": "maintenance"}
            )
            with sentinels.client(sentinels.master()) as node:
                node.hset(key, "lost-message", order)
                node.pexpire(key, 60_000)
                await asyncio.to_thread(a.wait_for_log, f"draining raw ({worker.worker_id})")
                await until(lambda: _true(not node.exists(key)), 5, "the order to be taken")


async def test_a_process_starting_on_sentinel_leaves_joined_workers_holds_alone(
    relay_server_factory, sentinels
):
    """A process found the cluster through the sentinels (no ``REDIS_URL``): when it
    starts it is not the only process, so it lets go of no joined worker's hold, and
    refuses an identity another process's connection holds."""
    with cluster(relay_server_factory, 2, **sentinels.env, **FAST) as (a, b):
        b.stop()
        joined = await join(a, "box-1")
        held = await joined_socket(a, joined["credential"])
        try:
            await register(held)
            await asyncio.to_thread(b.start)
            async with await joined_socket(b, joined["credential"]) as thief:
                assert await closed(thief) == (
                    1008,
                    f"worker 'box-1' (#{joined['worker_id']}) is connected already",
                )
            assert held.close_code is None
        finally:
            await held.close()


async def test_a_demoted_master_replying_readonly_counts_as_a_lost_connection(sentinels):
    """The lean client on a node that is a replica now (a demoted master) gets
    ``-READONLY`` to a write: the call fails as a lost connection, and the connection is
    dropped. Behind Sentinel, a node named master by a sentinel that has not heard of
    the failover yet is refused at connect (``ROLE``), and the next call asks again."""
    master, replica = sentinels.master(), sentinels.replica()
    source = "return redis.call('INCR', KEYS[1])"
    demoted = LeanRedis(f"redis://127.0.0.1:{replica}/0", 1.0, "modelrelay:test:place")
    try:
        with pytest.raises(redis.ConnectionError, match="replica now: READONLY"):
            await Script(demoted, source)(keys=["readonly-test"])
        assert demoted._proto is None
    finally:
        await demoted.aclose()
    answers = iter([replica, master])

    async def locate() -> tuple[str, int]:
        return "127.0.0.1", next(answers)

    client = LeanRedis("redis://", 1.0, "modelrelay:test:place", locate=locate)
    write = Script(client, source)
    try:
        with pytest.raises(redis.ConnectionError, match="not the master"):
            await write(keys=["readonly-test"])
        assert await write(keys=["readonly-test"]) >= 1
        assert client.port == master
    finally:
        await client.aclose()


async def test_the_master_is_found_with_a_sentinel_down_and_a_wrong_name_is_said(sentinels):
    """One sentinel stopped (it hangs) and one gone (nothing listens there): another one
    answers, within the bound of one call per sentinel. A master name no sentinel knows
    is a clear error."""
    hung, alive = sentinels.sentinel_ports[:2]
    (dead,) = free_ports(1)
    target = RedisTarget(
        sentinels=tuple(("127.0.0.1", p) for p in (hung, dead, alive)),
        master=sentinels.name,
        timeout=0.5,
    )
    master = sentinels.master()
    sentinels.signal(hung, signal.SIGSTOP)
    try:
        source = RedisSource(target)
        started = time.monotonic()
        try:
            assert await source.locate() == ("127.0.0.1", master)
        finally:
            await source.aclose()
        assert time.monotonic() - started < 3 * target.timeout + 0.5
    finally:
        sentinels.signal(hung, signal.SIGCONT)
    wrong = RedisSource(RedisTarget(sentinels=target.sentinels, master="nope", timeout=0.5))
    try:
        with pytest.raises(MasterUnknown, match=f"named 'nope'.*{sentinels.name}"):
            await wrong.locate()
    finally:
        await wrong.aclose()


def test_a_server_with_a_wrong_master_name_does_not_start(sentinels, tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "DATA_DIR": str(tmp_path),
        **sentinels.env,
        "REDIS_SENTINEL_MASTER": "not-the-master",
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "serve", "--listen", "127.0.0.1:0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "no sentinel monitors a master named 'not-the-master'" in result.stderr, result.stderr
    assert sentinels.name in result.stderr


def test_redis_url_and_sentinels_are_exclusive(tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "DATA_DIR": str(tmp_path),
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "REDIS_SENTINELS": "127.0.0.1:26379",
            "REDIS_SENTINEL_MASTER": "mymaster",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "REDIS_URL and REDIS_SENTINELS/REDIS_SENTINEL_MASTER are exclusive" in result.stderr


async def test_a_redis_that_stops_answering_holds_no_request_up(relay_server_factory, tmp_path):
    """The master stopped (``SIGSTOP``, no failover): each process serves its own
    workers' requests, each within the Redis timeout and a tick of being sent, and goes
    ``degraded`` meanwhile; ``ok`` again once Redis runs."""
    timeout = float(FAST["REDIS_TIMEOUT_SECS"])
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["at-a"]) as wa,
            ScriptedWorker(b, ["at-b"]) as wb,
        ):
            await knows(a, "at-b")
            await knows(b, "at-a")
            async with aioredis.from_url(url) as node:
                pid = int((await node.info("server"))["process_id"])
            serving = [asyncio.ensure_future(_answer_all(w)) for w in (wa, wb)]
            os.kill(pid, signal.SIGSTOP)
            try:
                for server, model in ((a, "at-a"), (b, "at-b"), (a, "at-a"), (b, "at-b")):
                    started = time.monotonic()
                    response = await client.post(server.url + CHAT, json={"model": model})
                    took = time.monotonic() - started
                    assert response.status_code == 200, response.text
                    assert took < timeout + 1.0, (server.url, took)
                assert await states(client, [a, b]) == ["degraded", "degraded"]
            finally:
                os.kill(pid, signal.SIGCONT)
            await until(lambda: all_ok(client, [a, b]), RECOVERY_SECS, "ok again")
            for task in serving:
                task.cancel()


async def _answer_all(worker: ScriptedWorker) -> None:
    while True:
        await worker.answer(await worker.requests.get())


def test_the_kit_waits_for_a_promoted_master(sentinels):
    """(The kit itself: the master it names takes writes.)"""
    assert wait_for(lambda: sentinels.writable(sentinels.master()), 5, "a writable master")


_PICK = """
import sys
from tests.sentinelkit import free_ports
print(" ".join(map(str, free_ports(3))), flush=True)
sys.stdin.read()
"""


def test_the_kit_gives_each_test_process_ports_of_its_own():
    """(The kit itself: two test processes of one run, as pytest-xdist starts them, pick
    from the same ``RELAY_TEST_REDIS_PORTS`` at once; each holds its ports until it ends,
    so none is picked twice.)"""
    span = os.environ.get("RELAY_TEST_REDIS_PORTS")
    if not span:
        (first,) = free_ports(1)
        first = min(first, 65_000)
        span = f"{first}-{first + 49}"
    env = {**os.environ, "RELAY_TEST_REDIS_PORTS": span}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PICK],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        picked = []
        for child in children:
            assert child.stdout is not None
            picked.append(set(child.stdout.readline().split()))
    finally:
        for child in children:
            child.communicate("", timeout=30)
    assert all(len(ports) == 3 for ports in picked), picked
    assert not picked[0] & picked[1], picked


async def test_valkey_behind_sentinel_is_a_drop_in(relay_server_factory, tmp_path):
    """The same with Valkey's server and sentinels (``make valkey`` installs one;
    skipped, saying so, without it): found at start, followed through a failover."""
    with (
        sentinel_set(tmp_path / "valkey", flavor="valkey") as valkey,
        cluster(relay_server_factory, 2, **valkey.env, **FAST) as (a, b),
    ):
        with valkey.client(valkey.master()) as node:
            assert "valkey_version" in node.info("server")
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["at-a"]) as worker,
        ):
            serving = asyncio.ensure_future(_answer_all(worker))
            try:
                await knows(b, "at-a")
                assert (await client.post(b.url + CHAT, json={"model": "at-a"})).status_code == 200
                new = await asyncio.to_thread(valkey.failover)
                await until(lambda: all_ok(client, [a, b]), RECOVERY_SECS, "ok after failover")
                response = await client.post(b.url + CHAT, json={"model": "at-a"})
                assert response.status_code == 200, response.text
                await until(
                    lambda: _true(names_on(new) >= ROLES - {"limits", "admit"}),
                    RECOVERY_SECS,
                    "every connection on the new master",
                )
            finally:
                serving.cancel()
