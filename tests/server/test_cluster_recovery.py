"""Cluster mode converges back by itself after any partial failure (SPEC §11).

Two live server processes on a redis-server of the test's own, which the test flushes,
restarts, feeds an error, cuts the connections of, or starves by stopping a process.
Workers are scripted and speak only the SPEC §4 message set (no extensions), and requests
go out the moment a worker is acked; the real ``worker.py`` too where it matters. After
each fault, within the recovery bound: every process says ``ok``, routes to every
worker and lists the same workers; an idle cluster holds no reservation; no worker was
ever handed more than its ``max_concurrent``; every request sent meanwhile was served.
Timings are shrunk through settings (a tick of 0.2 s, keys outliving a process by 1 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from relay.wire import protocol
from tests.clusterkit import AUTH, CHAT, cluster, knows, nginx_round_robin, private_redis, until
from tests.conftest import REDIS_URL
from tests.live import LiveServer
from tests.rawworker import closed, connect, expect, register
from tests.scriptedworker import ScriptedWorker
from tests.test_e2e import running_worker
from tests.upstream import upstream_in_thread

pytestmark = [pytest.mark.live, pytest.mark.redis]

FAST = {
    "CLUSTER_TICK_SECS": "0.2",
    "CLUSTER_TTL_SECS": "1",
    "QUEUE_TIMEOUT_SECS": "20",
    "REQUEST_TIMEOUT_SECS": "30",
    "SYNC_SECS": "0.2",
}
#: How long every process may take to converge after Redis answers again (many ticks).
RECOVERY_SECS = 10.0


async def chat(client: httpx.AsyncClient, server: LiveServer, model: str) -> httpx.Response:
    return await client.post(server.url + CHAT, json={"model": model})


@asynccontextmanager
async def serving(*workers: ScriptedWorker) -> AsyncIterator[None]:
    """Answer every request the workers get, as it comes."""

    async def answer_all(worker: ScriptedWorker) -> None:
        while True:
            await worker.answer(await worker.requests.get())

    tasks = [asyncio.ensure_future(answer_all(w)) for w in workers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def health(client: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    return (await client.get(server.url + "/health")).json()


async def converged(
    client: httpx.AsyncClient,
    url: str,
    prefix: str,
    servers: list[LiveServer],
    routes: dict[str, str],
    what: str,
) -> None:
    """Every process is ``ok``, lists the same workers, routes every model (each served
    by one worker) from every process, and the idle cluster holds no reservation."""

    async def all_ok() -> bool:
        states = [(await health(client, s)).get("cluster", {}).get("state") for s in servers]
        return states == ["ok"] * len(servers)

    await until(all_ok, RECOVERY_SECS, f"every process ok after {what}")

    async def same_workers() -> bool:
        listed = []
        for server in servers:
            response = await client.get(server.url + "/admin/workers", headers=AUTH)
            assert response.status_code == 200, response.text
            listed.append(sorted(w["id"] for w in response.json()))
        return all(ids == listed[0] for ids in listed) and len(listed[0]) == len(routes)

    await until(same_workers, RECOVERY_SECS, f"/admin/workers to agree after {what}")
    for server in servers:
        for model in routes:
            response = await chat(client, server, model)
            assert response.status_code == 200, (what, server.url, model, response.text)

    async def no_leases() -> bool:
        async with aioredis.from_url(url) as redis:  # (a fresh connection: Redis restarts)
            keys = [k async for k in redis.scan_iter(match=f"{prefix}:l:*")]
            return [await redis.zcard(k) for k in keys] == [0] * len(keys)

    await until(no_leases, RECOVERY_SECS, f"an idle cluster to hold no lease after {what}")


async def test_a_model_is_routable_at_every_process_the_moment_its_worker_is_acked(
    relay_server_factory, tmp_path
):
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        async with httpx.AsyncClient(timeout=15) as client:
            await until(lambda: _all_ok(client, [a, b]), RECOVERY_SECS, "the cluster to join")
            for round_ in range(5):
                model = f"fresh-{round_}"
                async with await connect(a) as ws:
                    await register(ws, models=[model])  # the ack is in: ask B at once
                    call = asyncio.ensure_future(chat(client, b, model))
                    listed = await client.get(f"{b.url}/v1/models/{model}")
                    assert listed.status_code == 200, listed.text
                    request = await expect(ws, protocol.Request)
                    await ws.send(_answer(request.request_id))
                    assert (await call).status_code == 200
            # The real worker.py: a request sent to the other process the moment the
            # worker logs its registration is served, not 404.
            with upstream_in_thread() as up, running_worker(a, up.url) as worker:
                worker.wait_for_log("registered as worker")
                response = await chat(client, b, "mock-model")
                assert response.status_code == 200, response.text


async def _all_ok(client: httpx.AsyncClient, servers: list[LiveServer]) -> bool:
    for server in servers:
        if (await health(client, server)).get("cluster", {}).get("state") != "ok":
            return False
    return True


def _answer(request_id: str) -> str:
    return protocol.encode(
        protocol.ResponseComplete(
            request_id=request_id,
            status_code=200,
            headers={"content-type": "application/json"},
            body="{}",
        )
    )


async def test_a_dead_processes_models_stop_being_listed_within_the_ttl(
    relay_server_factory, tmp_path
):
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        async with httpx.AsyncClient(timeout=15) as client, await connect(a) as ws:
            await register(ws, models=["only-at-a"])
            await knows(b, "only-at-a")
            a.kill()

            async def unlisted() -> bool:
                models = (await client.get(b.url + "/v1/models")).json()["data"]
                return all(m["id"] != "only-at-a" for m in models)

            # Keys outlive a process by CLUSTER_TTL_SECS (1 s); a few ticks more at most.
            await until(unlisted, 5, "B to stop listing the dead process's model")


async def test_every_process_converges_after_each_partial_failure(relay_server_factory, tmp_path):
    """Redis flushed, restarted, every kind of connection killed, an error reply, a
    process stalled past its TTL: after each, everything converges back by itself."""
    with (
        private_redis(tmp_path / "redis") as (url, (start, stop)),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        prefix = a.env["REDIS_PREFIX"]
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["at-a"], max_concurrent=1) as wa,
            ScriptedWorker(b, ["at-b"], max_concurrent=1) as wb,
            serving(wa, wb),
        ):
            routes = {"at-a": "a", "at-b": "b"}
            await converged(client, url, prefix, [a, b], routes, "start")
            credentials = await _credentials(url, prefix)

            async def through(fault: str, act: Any) -> None:
                await act()
                # Requests sent while the cluster recovers are served, none lost.
                calls = [
                    asyncio.ensure_future(chat(client, server, model))
                    for server in (a, b)
                    for model in routes
                ]
                await converged(client, url, prefix, [a, b], routes, fault)
                for call in calls:
                    assert (await call).status_code == 200, fault
                # The cluster's credentials are back (the same: its processes'), and go
                # with its last process.
                assert await _credentials(url, prefix) == credentials, fault

            async def flush() -> None:
                async with aioredis.from_url(url) as redis:
                    await redis.flushall()

            await through("FLUSHALL", flush)

            async def restart() -> None:
                stop()
                start()

            await through("a Redis restart", restart)
            await through("CLIENT KILL TYPE normal", lambda: _kill(url, "normal"))
            await through("CLIENT KILL TYPE pubsub", lambda: _kill(url, "pubsub"))

            async def error_reply() -> None:
                # Every script that looks at this provider's queue now gets WRONGTYPE.
                async with aioredis.from_url(url) as redis:
                    await redis.set(f"{prefix}:q:local", "not a sorted set")
                    await until(
                        lambda: _degraded(client, a), RECOVERY_SECS, "the error to be noticed"
                    )
                    await redis.delete(f"{prefix}:q:local")

            await through("an error reply", error_reply)

            async def stall() -> None:
                assert a.process is not None
                a.process.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(2.0)  # twice CLUSTER_TTL_SECS: A's keys lapse
                finally:
                    a.process.send_signal(signal.SIGCONT)

            await through("A stalled past its TTL", stall)
            assert wa.peak <= 1 and wb.peak <= 1, (wa.peak, wb.peak)


async def _credentials(url: str, prefix: str) -> str:
    """The cluster's credentials in Redis, which must expire within the processes' TTL."""
    key = f"{prefix}:credentials"
    async with aioredis.from_url(url, decode_responses=True) as redis:
        value, left = await redis.get(key), await redis.pttl(key)
    assert value is not None and 0 < left <= float(FAST["CLUSTER_TTL_SECS"]) * 1000, (value, left)
    return str(value)


async def _kill(url: str, kind: str) -> None:
    async with aioredis.from_url(url) as redis:
        await redis.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes")


async def _degraded(client: httpx.AsyncClient, server: LiveServer) -> bool:
    return (await health(client, server))["cluster"]["state"] == "degraded"


async def test_capacity_holds_when_redis_lost_the_reservations(relay_server_factory, tmp_path):
    """A worker with one slot, busy: after a flush, Redis thinks it is free, but the
    process that holds it refuses a second request and puts its reservation back."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        redis = aioredis.from_url(url)
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["one"], max_concurrent=1) as worker,
        ):
            await knows(b, "one")
            first = asyncio.ensure_future(chat(client, a, "one"))
            held = await worker.next()
            await redis.flushall()
            others = [asyncio.ensure_future(chat(client, s, "one")) for s in (b, a, b)]

            async def queued() -> bool:
                body = await health(client, b)
                return body["cluster"]["queue_depth"] >= 3

            await until(queued, RECOVERY_SECS, "the other requests to wait in the queue")
            assert worker.holding == {held.request_id}
            await worker.answer(held)
            assert (await first).status_code == 200
            for _ in others:
                await worker.answer(await worker.next(timeout=RECOVERY_SECS))
            for call in others:
                assert (await call).status_code == 200
            assert worker.peak == 1
        await redis.aclose()


async def test_a_slot_redis_offers_on_a_full_local_worker_is_not_taken(
    relay_server_factory, tmp_path
):
    """Redis lost a reservation of a busy local worker (an eviction) and offers its slot
    to a request of the same process: the process knows the worker is full, keeps the
    request waiting, and serves it when the slot really frees. (A tick of 5 s: the lost
    reservation is not re-asserted by the loop before the request is placed.)"""
    slow = {**FAST, "CLUSTER_TICK_SECS": "5", "CLUSTER_TTL_SECS": "15"}
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 1, REDIS_URL=url, **slow) as (a,),
    ):
        redis = aioredis.from_url(url)
        prefix = a.env["REDIS_PREFIX"]
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["one"], max_concurrent=1) as worker,
        ):
            first = asyncio.ensure_future(chat(client, a, "one"))
            held = await worker.next()
            evicted = [k async for k in redis.scan_iter(match=f"{prefix}:l:*")]
            assert len(evicted) == 1
            await redis.delete(*evicted)
            second = asyncio.ensure_future(chat(client, a, "one"))

            async def waits() -> bool:
                return (await health(client, a))["queue_depth"] == 1

            await until(waits, RECOVERY_SECS, "the second request to wait")
            assert worker.holding == {held.request_id}
            await worker.answer(held)
            assert (await first).status_code == 200
            await worker.answer(await worker.next(timeout=RECOVERY_SECS))
            assert (await second).status_code == 200
            assert worker.peak == 1
        await redis.aclose()


async def test_a_refused_placement_gives_its_slot_back_even_when_redis_failed_meanwhile(
    tmp_path,
):
    """A request another process placed on our worker found it full here (this process
    had taken work for it while degraded). The resync that should come first fails (an
    error reply): the reservation is still given back at the next pass Redis hears,
    not held on an idle worker until its pending lease lapses (15 s)."""
    from relay.server.cluster.convergence import now_ms

    prefix = "mrtest-refused"
    async with one_process(tmp_path, prefix, max_concurrent=1) as (placement, worker, redis):
        leases = f"{prefix}:l:{worker.id}"
        lease = "other|r-placed-there"
        await redis.zadd(leases, {lease: now_ms() + 15_000})
        await redis.delete(f"{prefix}:credentials")
        await redis.rpush(f"{prefix}:credentials", "not a string")  # every pass: WRONGTYPE
        before = set(placement._tasks)
        placement.refused(worker.id, lease)
        await asyncio.gather(*(placement._tasks - before))  # its resync met the error
        assert placement.status == "degraded"
        await redis.delete(f"{prefix}:credentials")
        await until(lambda: _state(placement, "ok"), RECOVERY_SECS, "the next pass")

        async def given_back() -> bool:
            return await redis.zscore(leases, lease) is None

        await until(given_back, RECOVERY_SECS, "the refused reservation to be given back")


@asynccontextmanager
async def one_process(
    tmp_path: Any, prefix: str, *, max_concurrent: int
) -> AsyncIterator[tuple[Any, Any, aioredis.Redis]]:
    """One process's placement on a private Redis, in this process, joined; one worker
    for model ``m`` attached without a socket (no heartbeat may drop it meanwhile)."""
    from relay.server.cluster.placement import RedisPlacement
    from tests.corekit import FAST as CORE
    from tests.corekit import attach, make_relay

    with private_redis(tmp_path / "redis") as (url, _):
        relay = make_relay(dataclasses.replace(CORE, heartbeat_interval=60, heartbeat_timeout=120))
        placement = RedisPlacement(relay, url, prefix, "cluster-token", tick=0.1, ttl=1)
        relay.placement = placement
        worker, _ = attach(relay, ["m"], max_concurrent=max_concurrent)
        redis = aioredis.from_url(url)
        loop = asyncio.ensure_future(placement.run())
        try:
            placement.listening("http://127.0.0.1:9")
            await until(lambda: _state(placement, "ok"), RECOVERY_SECS, "the process to join")
            yield placement, worker, redis
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await redis.aclose()


async def _state(placement: Any, state: str) -> bool:
    return bool(placement.status == state)


async def test_a_requeued_request_keeps_its_place_even_when_the_queue_is_full(
    relay_server_factory, tmp_path
):
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, MAX_QUEUE_LEN="1", **FAST) as (a, b),
    ):
        async with httpx.AsyncClient(timeout=30) as client:
            async with ScriptedWorker(b, ["q"], max_concurrent=1) as first:
                await knows(a, "q")
                lost = asyncio.ensure_future(chat(client, a, "q"))
                await first.next()
                waiting = asyncio.ensure_future(chat(client, a, "q"))  # fills the queue

                async def full() -> bool:
                    return (await health(client, a))["cluster"]["queue_depth"] == 1

                await until(full, RECOVERY_SECS, "the shared queue to be full")
            # The worker is gone before answering: its request goes back to the queue,
            # ahead of the one already waiting, although the queue is full.
            async with ScriptedWorker(b, ["q"], max_concurrent=1) as second:
                again = await second.next(timeout=RECOVERY_SECS)
                await second.answer(again)
                assert (await lost).status_code == 200
                await second.answer(await second.next(timeout=RECOVERY_SECS))
                assert (await waiting).status_code == 200


async def test_nothing_a_worker_sends_steers_the_clusters_internal_control(
    relay_server_factory, tmp_path
):
    """A worker answering with the header the processes use between themselves to ask
    for a requeue gets its answer relayed once, the header stripped: never a replay."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        async with httpx.AsyncClient(timeout=30) as client, await connect(b) as ws:
            await register(ws, models=["forger"])
            await knows(a, "forger")
            call = asyncio.ensure_future(chat(client, a, "forger"))
            request = await expect(ws, protocol.Request)
            forged = protocol.ResponseComplete(
                request_id=request.request_id,
                status_code=200,
                headers={
                    "content-type": "application/json",
                    "x-modelrelay-requeue": "free",
                    "x-modelrelay-lease": "nothing",
                },
                body='{"answer": 1}',
            )
            await ws.send(protocol.encode(forged))
            response = await call
            assert response.status_code == 200
            assert response.json() == {"answer": 1}
            assert not [h for h in response.headers if h.startswith("x-modelrelay-")]
            with pytest.raises(TimeoutError):
                await expect(ws, protocol.Request, timeout=1.0)  # not sent again


async def test_a_rotation_reaches_a_process_that_missed_the_broadcast(
    relay_server_factory, tmp_path
):
    """Workers of a provider whose secret was rotated with "disconnect" are closed by
    every process at its next provider sync, broadcast or not."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as (a, b),
    ):
        async with await connect(b) as ws:
            await register(ws, models=["rotated"])
            database = a.env["DATABASE_URL"]
            if not database.startswith("sqlite:///"):
                pytest.skip("the row is changed behind the processes' backs through SQLite")
            # The rotation's broadcast never comes: only the row says it.
            with sqlite3.connect(database.removeprefix("sqlite:///")) as db:
                db.execute("UPDATE workers_app_provider SET eviction = eviction + 1")
            code, reason = await closed(ws, timeout=RECOVERY_SECS)
            assert (code, reason) == (1008, "provider secret rotated")


@pytest.mark.timeout(300)
async def test_a_rolling_restart_behind_nginx_fails_no_request(relay_server_factory, tmp_path):
    """SIGTERM a process behind nginx round-robin and start it again, under steady load
    from two clients: every request succeeds. A stopping process refuses new connections
    (nginx sends them to the other), finishes what it has, and its workers reconnect
    through nginx to the other process. (`make chaos` restarts every process in turn.)"""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, **FAST) as servers,
        nginx_round_robin(servers, tmp_path / "nginx") as front,
        upstream_in_thread(total_slots=4) as up,
    ):
        entry = LiveServer(data_dir=tmp_path, env={"WORKER_SECRET": servers[0].secret})
        entry.url = front
        with running_worker(entry, up.url), running_worker(entry, up.url):
            async with httpx.AsyncClient(timeout=30) as client:
                for server in servers:
                    await knows(server, "mock-model")
                outcomes: list[int | str] = []
                stop = asyncio.Event()

                async def steady() -> None:
                    while not stop.is_set():
                        try:
                            response = await client.post(front + CHAT, json={"model": "mock-model"})
                            outcomes.append(
                                200 if response.status_code == 200 else response.text[:300]
                            )
                        except httpx.HTTPError as exc:
                            outcomes.append(type(exc).__name__)

                load = [asyncio.ensure_future(steady()) for _ in range(2)]
                try:
                    for server in servers[:1]:
                        before = len(outcomes)
                        # SIGTERM: it exits by itself, 0, within its grace (never killed).
                        assert await asyncio.to_thread(server.stop) == 0, server.log()[-3000:]
                        await asyncio.to_thread(server.start)
                        await knows(server, "mock-model")
                        await until(
                            lambda before=before: _more(outcomes, before + 20),
                            RECOVERY_SECS,
                            "requests to flow again",
                        )
                finally:
                    stop.set()
                    await asyncio.gather(*load)
                failed = [o for o in outcomes if o != 200]
                assert len(outcomes) > 50
                assert failed == [], f"{len(failed)} of {len(outcomes)} failed: {failed[:10]}"


async def test_a_stopped_process_refuses_new_connections_and_exits_by_itself(
    relay_server_factory, tmp_path
):
    """SIGTERM in cluster mode: the process stops listening at once (the balancer sends
    new connections to the others), closes its workers with 1012 and exits 0 within its
    grace, not killed after it."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 1, REDIS_URL=url, SHUTDOWN_GRACE_SECS="2", **FAST) as (a,),
    ):
        async with httpx.AsyncClient(timeout=15) as client:
            await until(lambda: _all_ok(client, [a]), RECOVERY_SECS, "the process to join")
        async with await connect(a) as ws:
            await register(ws, models=["stopping"])
            a.signal(signal.SIGTERM)

            async def refused() -> bool:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", a.port)
                except ConnectionRefusedError:
                    return True
                writer.close()
                return False

            await until(refused, 5, "the stopping process to refuse new connections")
            code, reason = await closed(ws, timeout=RECOVERY_SECS)
            assert (code, reason) == (1012, "server restarting")
        assert a.process is not None
        code = await asyncio.to_thread(a.process.wait, 10)  # grace 2 s
        assert code == 0, a.log()[-3000:]
        # (Nothing failed in the signal handler; under uvicorn a probe meeting the socket
        # as it closes may log uvloop's own traceback, which is not this.)
        assert "_on_signal" not in a.log() and "could not stop listening" not in a.log()


async def test_a_stopping_process_still_serves_its_own_waiting_requests_on_its_workers(
    relay_server_factory, tmp_path
):
    """SIGTERM a process whose worker is the cluster's only one, with a request of its
    own waiting behind a busy slot: no other process is offered that worker any more,
    but the waiting request takes it when it frees (not a 503 at the end of the grace)."""
    with (
        private_redis(tmp_path / "redis") as (url, _),
        cluster(relay_server_factory, 2, REDIS_URL=url, SHUTDOWN_GRACE_SECS="20", **FAST) as (
            a,
            b,
        ),
    ):
        async with (
            httpx.AsyncClient(timeout=30) as client,
            ScriptedWorker(a, ["only"], max_concurrent=1) as worker,
        ):
            await knows(b, "only")
            first = asyncio.ensure_future(chat(client, a, "only"))
            held = await worker.next()
            second = asyncio.ensure_future(chat(client, a, "only"))

            async def waits() -> bool:
                return (await health(client, a))["queue_depth"] == 1

            await until(waits, RECOVERY_SECS, "the second request to wait")
            a.signal(signal.SIGTERM)
            a.wait_for_log("shutting down")
            await worker.answer(held)
            assert (await first).status_code == 200
            await worker.answer(await worker.next(timeout=RECOVERY_SECS))
            response = await second
            assert response.status_code == 200, response.text
            assert worker.peak == 1


async def _more(outcomes: list[Any], than: int) -> bool:
    return len(outcomes) > than


def test_a_process_stopped_while_it_joins_the_cluster_exits_by_itself(relay_server_factory):
    """SIGTERM right after the server listens, while its first tick is under way: the
    control loops stop even when the cancellation meets a Redis call (it used to be
    swallowed there: the process kept ticking until it was killed). Several starts, as
    the first tick and the signal race."""
    env = {**FAST, "REDIS_URL": REDIS_URL}
    for _ in range(4):
        with cluster(relay_server_factory, 1, **env) as (server,):
            assert server.process is not None
            server.signal(signal.SIGTERM)
            assert server.process.wait(timeout=10) == 0, server.log()


async def test_a_reservation_whose_request_never_came_is_dropped_within_a_ttl(tmp_path):
    """A slot reserved on our worker for a request that never arrives (its process lost
    the reply, or died right after placing it) is given back once its process has
    announced the worker without it for one TTL, not held until its far expiry; the
    reservations of requests the process does hold stay."""
    from relay.server.cluster.convergence import now_ms

    prefix = "mrtest-ghost"
    async with one_process(tmp_path, prefix, max_concurrent=2) as (placement, worker, redis):
        held = placement.relay.submit(
            model="m",
            endpoint_path=CHAT,
            flavor="openai",
            is_streaming=False,
            body='{"model":"m"}',
            headers={},
        )
        await until(lambda: _running(held), RECOVERY_SECS, "the request to be sent")
        leases = f"{prefix}:l:{worker.id}"
        ghost = "gone|r-never-came"
        await redis.zadd(leases, {ghost: now_ms() + 600_000})
        started = now_ms()

        async def dropped() -> bool:
            return await redis.zscore(leases, ghost) is None

        await until(dropped, RECOVERY_SECS, "the reservation nobody holds to be dropped")
        assert now_ms() - started >= 1000  # kept for one TTL: it may have been in transit
        assert held.lease is not None
        assert await redis.zscore(leases, held.lease) is not None


async def _running(request: Any) -> bool:
    return bool(request.worker_id is not None and request.lease)
