"""Several server processes, one worker pool and one queue through Redis (SPEC §11).

Live processes sharing Redis and a database, raw WebSocket workers and the real
``worker.py``, the fake upstream, and nginx round-robin in front where a load
balancer matters. Everything on 127.0.0.1; every process is stopped by its fixture.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
import pytest

from relay.server.cluster.convergence import now_ms
from relay.server.cluster.state import ClusterState, WorkerRow, lane_of
from relay.wire import protocol
from tests.clusterkit import (
    AUTH,
    CHAT,
    answer,
    cluster,
    knows,
    nginx_round_robin,
    private_redis,
    until,
    waiting,
)
from tests.conftest import REDIS_HOST, REDIS_PORT, REDIS_URL, require_redis
from tests.live import LiveServer
from tests.rawworker import connect, expect, register
from tests.scriptedworker import ScriptedWorker
from tests.test_e2e import running_worker
from tests.upstream import expected_text, upstream_in_thread

pytestmark = [pytest.mark.live, pytest.mark.redis]

# -- any process, any worker ----------------------------------------------------------


async def test_clients_of_any_process_are_served_by_workers_of_any_other(
    relay_server_factory, tmp_path
):
    with (
        upstream_in_thread() as upstream,
        cluster(relay_server_factory, 3) as (a, b, c),
        running_worker(c, upstream.url, "--models", "mock-model"),
    ):
        async with await connect(b) as ws:
            await register(ws, models=["m"], max_concurrent=4)
            await knows(a, "m")
            await knows(a, "mock-model")
            await knows(b, "mock-model")
            async with httpx.AsyncClient(base_url=a.url, timeout=15) as client:
                call = asyncio.ensure_future(
                    client.post("/v1/chat/completions", json={"model": "m"})
                )
                request = await expect(ws, protocol.Request)
                await ws.send(answer(request.request_id, '{"from":"b"}'))
                assert (await call).json() == {"from": "b"}

                async def stream() -> bytes:
                    body = {"model": "m", "stream": True}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        return b"".join([part async for part in r.aiter_raw()])

                streamed = asyncio.ensure_future(stream())
                request = await expect(ws, protocol.Request)
                for i in range(3):
                    await ws.send(
                        protocol.encode(
                            protocol.ResponseChunk(request.request_id, f"data: {i}\n\n")
                        )
                    )
                await ws.send(answer(request.request_id, "data: [DONE]\n\n"))
                assert await streamed == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            # The real worker.py behind process C, asked through A and B, streaming and not.
            for server in (a, b):
                async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
                    whole = await client.post(
                        "/v1/chat/completions",
                        json={
                            "model": "mock-model",
                            "messages": [{"role": "user", "content": "x"}],
                        },
                    )
                    assert whole.status_code == 200
                    assert whole.json()["choices"][0]["message"]["content"] == expected_text(
                        upstream.upstream.tokens
                    )
                    body = {"model": "mock-model", "stream": True, "mock": {"tokens": 4}}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        text = b"".join([part async for part in r.aiter_raw()]).decode()
                    assert r.status_code == 200 and text.endswith("data: [DONE]\n\n")
            # And through a load balancer spreading clients over all three.
            with nginx_round_robin([a, b, c], tmp_path / "nginx") as front:
                async with httpx.AsyncClient(base_url=front, timeout=15) as client:
                    for n in range(6):
                        body = {"model": "mock-model", "n": n, "messages": []}
                        response = await client.post("/v1/chat/completions", json=body)
                        assert response.status_code == 200, response.text
            assert len(upstream.upstream.requests_to("/v1/chat/completions")) == 10


async def test_among_equals_the_receiving_processs_own_workers_are_preferred(
    relay_server_factory,
):
    """One idle worker at each process, one request at a time: each process sends its
    own clients to its own worker (no hop between processes while it is as free)."""
    with cluster(relay_server_factory, 2) as (a, b):
        async with (
            ScriptedWorker(a, ["m"], max_concurrent=4) as at_a,
            ScriptedWorker(b, ["m"], max_concurrent=4) as at_b,
            httpx.AsyncClient(timeout=15) as client,
        ):
            await knows(a, "m")
            await knows(b, "m")
            for server, own in ((a, at_a), (b, at_b), (a, at_a), (b, at_b)):
                for _ in range(3):
                    call = asyncio.ensure_future(
                        client.post(server.url + CHAT, json={"model": "m"})
                    )
                    await own.answer(await own.next())
                    assert (await call).status_code == 200
            assert at_a.requests.empty() and at_b.requests.empty()


@pytest.mark.parametrize(("slack", "second_at"), [("0", "b"), ("1", "a")])
async def test_a_process_keeps_its_clients_within_its_local_slack(
    relay_server_factory, slack: str, second_at: str
):
    """Live processes, one worker each: with A's worker busy with one request and B's
    idle, a second request to A crosses to B's worker under least load exactly
    (CLUSTER_LOCAL_SLACK=0) and stays on A's under CLUSTER_LOCAL_SLACK=1."""
    with cluster(relay_server_factory, 2, CLUSTER_LOCAL_SLACK=slack) as (a, b):
        async with (
            ScriptedWorker(a, ["m"], max_concurrent=4) as at_a,
            ScriptedWorker(b, ["m"], max_concurrent=4) as at_b,
            httpx.AsyncClient(timeout=15) as client,
        ):
            await knows(a, "m")
            await knows(b, "m")
            first = asyncio.ensure_future(client.post(a.url + CHAT, json={"model": "m"}))
            held = await at_a.next()  # A's worker is busy with it
            second = asyncio.ensure_future(client.post(a.url + CHAT, json={"model": "m"}))
            worker = at_a if second_at == "a" else at_b
            await worker.answer(await worker.next())
            assert (await second).status_code == 200
            await at_a.answer(held)
            assert (await first).status_code == 200
            assert at_a.requests.empty() and at_b.requests.empty()


async def test_capacity_is_never_exceeded_across_processes(relay_server_factory):
    with (
        upstream_in_thread(token_delay=0.01, tokens=5) as one,
        upstream_in_thread(token_delay=0.01, tokens=5) as two,
        cluster(relay_server_factory, 3, MAX_QUEUE_LEN="500") as (a, b, c),
        running_worker(b, one.url, "--models", "mock-model", "--max-concurrent", "4"),
        running_worker(c, two.url, "--models", "mock-model", "--max-concurrent", "4"),
    ):
        for server in (a, b, c):
            await knows(server, "mock-model")

        async def call(server: LiveServer, client: httpx.AsyncClient, n: int) -> str:
            body = {"model": "mock-model", "stream": True, "n": n}
            async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                return b"".join([part async for part in r.aiter_raw()]).decode()

        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            texts = await asyncio.gather(*(call((a, b, c)[n % 3], client, n) for n in range(200)))
        assert all(
            t.endswith("data: [DONE]\n\n") and expected_text(5) in _content(t) for t in texts
        )
        assert one.upstream.max_in_flight <= 4 and two.upstream.max_in_flight <= 4
        assert len(one.requests) + len(two.requests) == 200
        assert one.requests and two.requests  # both workers took part


def _content(stream: str) -> str:
    out = []
    for line in stream.split("\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


async def test_queued_requests_get_freed_capacity_in_global_arrival_order(relay_server_factory):
    with cluster(relay_server_factory, 3) as (a, b, c):
        async with await connect(b) as ws:
            await register(ws, models=["m"], max_concurrent=1)
            for server in (a, c):
                await knows(server, "m")
            async with httpx.AsyncClient(timeout=30) as client:

                def post(server: LiveServer, n: int) -> asyncio.Future[httpx.Response]:
                    return asyncio.ensure_future(
                        client.post(
                            server.url + "/v1/chat/completions", json={"model": "m", "n": n}
                        )
                    )

                busy = post(a, 0)
                first = await expect(ws, protocol.Request)
                calls = []
                for n, server in enumerate((a, c, b, a, c), start=1):
                    before = await waiting(server)
                    calls.append(post(server, n))
                    await until(lambda s=server, d=before: _more(s, d))
                await ws.send(answer(first.request_id))
                order = []
                for _ in calls:
                    request = await expect(ws, protocol.Request)
                    order.append(json.loads(request.body)["n"])
                    await ws.send(answer(request.request_id))
                assert order == [1, 2, 3, 4, 5]
                assert (await busy).status_code == 200
                assert [(await call).status_code for call in calls] == [200] * 5


async def test_nothing_that_arrived_after_a_request_aged_passes_it_in_the_shared_queue():
    """The shared queue's order (the scripts alone, on the tests' Redis) is the one
    relay.core.classqueue keeps: a flex request that waited the aging bound counts as
    default, among what was put back in that class by arrival, ahead of its keys' lanes."""
    import redis.asyncio as aioredis

    require_redis()
    redis = aioredis.from_url(REDIS_URL)
    state = ClusterState(redis, f"mrtest-{secrets.token_hex(4)}")
    aging = 1_000
    now = now_ms()  # (entries expire at their deadline, in wall-clock time)
    try:
        row = WorkerRow("w1", "local", 1, False, False, ("m",), {"p|busy": now + 60_000})
        await state.announce("p", "http://127.0.0.1:1", [row], now, 60_000, "c")
        seqs: dict[str, int] = {}

        async def place(name: str, at: int, service_class: str, requeued: bool = False) -> None:
            kind, _, seqs[name], _ = await state.place(
                provider="local", model="m", entry=f"p|{name}", origin="p", now_ms=now + at,
                deadline_ms=now + 60_000, hold_ms=60_000, seq=seqs.get(name, 0), max_queue=-1,
                lane=lane_of(service_class, None, requeued), service_class=service_class,
            )  # fmt: skip
            assert kind == "queued"

        await place("early", -10, "default")  # arrives first; later put back (requeued)
        assert await state.withdraw("local", "p|early", lane_of("default", None, False)) is None
        await place("early", 1_400, "default", requeued=True)  # keeps its place
        await place("flex", 0, "flex")  # counts as default from 1 000 (priority from 2 000)
        await place("late", 1_500, "default", requeued=True)  # arrived after it aged
        await place("new", 1_600, "default")
        order: list[str] = []
        lease = "p|busy"
        for _ in range(4):
            popped = await state.release("w1", lease, now + 1_900, aging)
            assert popped is not None, order
            lease = popped[0]
            order.append(lease.partition("|")[2])
        assert order == ["early", "flex", "late", "new"]
    finally:
        keys = [key async for key in redis.scan_iter(match=f"{state.prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


@pytest.mark.parametrize(
    ("slack", "mine", "theirs", "capacity", "chosen"),
    [
        (0, 1, 0, 4, "w-q"),  # least load exactly (SPEC §6): the other process's worker
        (0, 1, 1, 4, "w-p"),  # a tie: this process's own
        (1, 1, 0, 4, "w-p"),  # one more in flight, within the slack: stays here
        (1, 2, 0, 4, "w-q"),  # two more: beyond it
        (1, 1, 0, 1, "w-q"),  # within it but full: never over capacity
        (3, 3, 0, 4, "w-p"),
    ],
)
async def test_a_local_slack_keeps_a_request_on_its_own_process_within_that_many_requests(
    slack: int, mine: int, theirs: int, capacity: int, chosen: str
):
    """CLUSTER_LOCAL_SLACK in the placing script (on the tests' Redis): a worker of the
    process that has the request wins while it has a free slot and at most ``slack``
    requests in flight more than the least loaded; 0 is least load exactly."""
    import redis.asyncio as aioredis

    require_redis()
    redis = aioredis.from_url(REDIS_URL)
    state = ClusterState(redis, f"mrtest-{secrets.token_hex(4)}")
    now = now_ms()
    try:
        for proc, load, cap in (("p", mine, capacity), ("q", theirs, 4)):
            leases = {f"{proc}|busy{i}": now + 60_000 for i in range(load)}
            row = WorkerRow(f"w-{proc}", "local", cap, False, False, ("m",), leases)
            await state.announce(proc, f"http://127.0.0.1:{proc}", [row], now, 60_000, "c")
        kind, placed, _, _ = await state.place(
            provider="local", model="m", entry="p|new", origin="p", now_ms=now,
            deadline_ms=now + 60_000, hold_ms=60_000, seq=0, max_queue=-1,
            lane=lane_of("default", None, False), service_class="default",
            local_slack=slack,
        )  # fmt: skip
        assert kind == "placed" and placed is not None
        assert placed.worker_id == chosen
    finally:
        keys = [key async for key in redis.scan_iter(match=f"{state.prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def _more(server: LiveServer, than: int) -> bool:
    return await waiting(server) > than


async def test_a_client_leaving_on_one_process_frees_the_slot_on_another(relay_server_factory):
    with cluster(relay_server_factory, 3) as (a, b, c):
        async with await connect(b) as ws:
            await register(ws, models=["m"], max_concurrent=1)
            for server in (a, c):
                await knows(server, "m")
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "m", "stream": True, "n": 1}
                hang_up = asyncio.Event()
                leaving = asyncio.ensure_future(
                    _read_one_then_leave(client, a.url + "/v1/chat/completions", body, hang_up)
                )
                first = await expect(ws, protocol.Request)
                await ws.send(
                    protocol.encode(protocol.ResponseChunk(first.request_id, "data: 1\n\n"))
                )
                queued = asyncio.ensure_future(
                    client.post(c.url + "/v1/chat/completions", json={"model": "m", "n": 2})
                )
                await until(lambda: _more(c, 0))
                hang_up.set()
                await leaving
                cancel = await expect(ws, protocol.Cancel)
                assert cancel.request_id == first.request_id
                second = await expect(ws, protocol.Request)  # the freed slot, at once
                assert json.loads(second.body)["n"] == 2
                await ws.send(answer(second.request_id, "second"))
                assert (await queued).text == "second"


async def test_a_slot_on_a_local_worker_is_held_to_the_deadline_in_one_step(
    relay_server_factory,
):
    """Placing on a worker of the receiving process reserves the slot until the
    request's deadline in the placing script itself (no extension round trip); a slot
    on another process's worker is extended there when the request arrives."""
    import hashlib

    import redis.asyncio as aioredis

    from relay.server.cluster import scripts as cluster_scripts

    names = {
        hashlib.sha1(source.encode()).hexdigest(): name
        for name, source in (
            ("place", cluster_scripts.PLACE),
            ("release", cluster_scripts.RELEASE),
            ("extend", cluster_scripts.EXTEND),
        )
    }
    with cluster(relay_server_factory, 2, REQUEST_TIMEOUT_SECS="120") as (a, b):
        prefix = a.env["REDIS_PREFIX"]
        async with await connect(a) as ws:
            await register(ws, models=["m"], max_concurrent=2)
            await knows(b, "m")
            r = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT)
            scripts: list[tuple[str, str]] = []  # (script, its arguments)

            async def watch(ready: asyncio.Event) -> None:
                async with r.monitor() as monitor:
                    ready.set()
                    async for command in monitor.listen():
                        words = command["command"].split(" ")
                        if words[0] == "EVALSHA" and prefix in command["command"]:
                            name = names.get(words[1].strip('"'))
                            if name is not None:  # (not the once-a-second re-assertion)
                                scripts.append((name, command["command"]))

            ready = asyncio.Event()
            watcher = asyncio.ensure_future(watch(ready))
            try:
                await ready.wait()
                async with httpx.AsyncClient(timeout=30) as client:
                    local = asyncio.ensure_future(client.post(a.url + CHAT, json={"model": "m"}))
                    first = await expect(ws, protocol.Request)
                    keys = [k async for k in r.scan_iter(match=f"{prefix}:l:*")]
                    assert len(keys) == 1, keys
                    leases_key = keys[0]
                    now = await r.time()
                    now_ms = now[0] * 1000 + now[1] // 1000

                    async def expiries() -> list[float]:
                        held: Any = await r.zrange(leases_key, 0, -1, withscores=True)
                        return [float(score) for _, score in held]

                    # held to the deadline (120 s) and a margin, from the placement on
                    assert [e > now_ms + 100_000 for e in await expiries()] == [True]

                    def about_first() -> list[str]:
                        return [name for name, args in scripts if first.request_id in args]

                    assert about_first() == ["place"], scripts
                    await ws.send(answer(first.request_id))
                    assert (await local).text == "ok"
                    await until(lambda: _equal(about_first(), ["place", "release"]))

                    remote = asyncio.ensure_future(client.post(b.url + CHAT, json={"model": "m"}))
                    second = await expect(ws, protocol.Request)

                    async def extended() -> bool:
                        return [e > now_ms + 100_000 for e in await expiries()] == [True]

                    await until(extended, what="the cross-process slot extended on arrival")
                    await ws.send(answer(second.request_id, "two"))
                    assert (await remote).text == "two"
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                await r.aclose()


async def _equal(seen: list[str], expected: list[str]) -> bool:
    assert seen == expected[: len(seen)], seen
    return seen == expected


async def _read_one_then_leave(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], hang_up: asyncio.Event
) -> None:
    async with client.stream("POST", url, json=body) as response:
        async for _ in response.aiter_raw():
            await hang_up.wait()
            return  # the first bytes arrived and the test says so: hang up


# -- failures ---------------------------------------------------------------------------


async def test_killing_the_process_of_the_worker_loses_no_request_that_can_be_served(
    relay_server_factory, tmp_path
):
    with (
        upstream_in_thread(token_delay=0.05, tokens=40) as upstream,
        cluster(relay_server_factory, 3, REQUEST_TIMEOUT_SECS="30") as servers,
        nginx_round_robin(servers, tmp_path / "nginx") as front,
    ):
        async with httpx.AsyncClient(timeout=40, headers=AUTH) as admin:
            flags = ("--models", "mock-model", "--max-concurrent", "2")
            front_door = _Front(front, servers[0])
            with running_worker(front_door, upstream.url, *flags):  # type: ignore[arg-type]
                owner = await until(lambda: _owner(servers))
                owner_instance = (await admin.get(owner.url + "/health")).json()["cluster"][
                    "instance"
                ]
                others = [s for s in servers if s is not owner]
                for server in others:
                    await knows(server, "mock-model")

                async def call(server: LiveServer, n: int) -> tuple[int, str]:
                    body = {"model": "mock-model", "stream": True, "n": n}
                    async with admin.stream(
                        "POST", server.url + "/v1/chat/completions", json=body
                    ) as r:
                        text = b"".join([part async for part in r.aiter_raw()]).decode()
                        return r.status_code, text

                calls = [asyncio.ensure_future(call(others[n % 2], n)) for n in range(6)]
                await until(lambda: _started(upstream, 2))
                owner.kill()
                results = await asyncio.gather(*calls)
                for status, text in results:
                    assert status == 200, text
                    # Served whole after a requeue, or cut mid-way with the error event:
                    # never duplicated, never left hanging.
                    ended = text.endswith("data: [DONE]\n\n")
                    assert ended or '"error"' in text.rsplit("data:", 1)[1], text[-300:]
                whole = [t for _, t in results if t.endswith("data: [DONE]\n\n")]
                assert len(whole) >= 4  # the two in flight may be cut; the queued are served
                for text in whole:
                    assert _content(text) == expected_text(40)

                async def gone() -> bool:
                    workers = (await admin.get(others[0].url + "/admin/workers")).json()
                    return all(w.get("instance") != owner_instance for w in workers)

                assert await until(gone, timeout=15)


class _Front:
    """A LiveServer-like target for running_worker: the load balancer's address."""

    def __init__(self, url: str, server: LiveServer) -> None:
        self.url = url
        self.secret = server.secret


async def _owner(servers: list[LiveServer]) -> LiveServer | None:
    for server in servers:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            if (await client.get("/health")).json()["workers_connected"]:
                return server
    return None


async def _started(upstream: Any, count: int) -> bool:
    return len(upstream.requests) >= count


async def test_without_redis_each_process_serves_its_own_workers_and_rejoins(
    relay_server_factory, tmp_path
):
    with (
        private_redis(tmp_path / "redis") as (url, (start, stop)),
        cluster(relay_server_factory, 2, REDIS_URL=url, QUEUE_TIMEOUT_SECS="1") as (a, b),
    ):
        async with await connect(a) as near, await connect(b) as far:
            await register(near, models=["near"], max_concurrent=2)
            await register(far, models=["far"], max_concurrent=2)
            await knows(a, "far")
            async with httpx.AsyncClient(base_url=a.url, timeout=15) as client:

                async def served(model: str, ws: Any) -> int:
                    call = asyncio.ensure_future(
                        client.post("/v1/chat/completions", json={"model": model})
                    )
                    request = await expect(ws, protocol.Request)
                    await ws.send(answer(request.request_id))
                    return (await call).status_code

                assert await served("far", far) == 200  # through B
                stop()

                async def degraded() -> bool:
                    health = (await client.get("/health")).json()
                    return health["cluster"]["state"] == "degraded"

                await until(degraded, timeout=15)
                assert "modelrelay_cluster_up 0.0" in (await client.get("/metrics")).text
                assert await served("near", near) == 200  # A's own worker still serves
                lonely = await client.post("/v1/chat/completions", json={"model": "far"})
                assert lonely.status_code == 504  # B's worker cannot be reached without Redis
                start()

                async def rejoined() -> bool:
                    health = (await client.get("/health")).json()
                    return health["cluster"]["state"] == "ok"

                await until(rejoined, timeout=15)
                assert "modelrelay_cluster_up 1.0" in (await client.get("/metrics")).text
                await knows(a, "far")
                assert await served("far", far) == 200
