"""Speed-aware routing across server processes (SPEC §21, §11): the processes share what
they learned, predict from the same numbers, and place by prediction."""

from __future__ import annotations

import secrets
import threading
from typing import Any

import httpx
import msgspec
import pytest

from relay.server.cluster.convergence import now_ms
from relay.server.cluster.state import ClusterState, WorkerRow
from tests.cacheupstream import caching_upstreams
from tests.clusterkit import AUTH, cluster
from tests.conftest import REDIS_URL, require_redis
from tests.test_e2e import poll, running_worker

pytestmark = [pytest.mark.live, pytest.mark.redis]

MODEL = "mock-model"
RATE = 2000.0


def chat(url: str, size: int) -> int:
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": secrets.token_hex(4) + " " + "w" * size}],
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        response.read()
        return response.status_code


def stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/admin/stats", headers=AUTH, timeout=5).json())


def speeds_of(url: str) -> dict[str, dict[str, Any]]:
    workers = httpx.get(url + "/admin/workers", headers=AUTH, timeout=5).json()
    return {w["name"]: w["speeds"][0] for w in workers}


def test_processes_share_speeds_predict_alike_and_place_by_prediction(relay_server_factory):
    flags = ("--models", MODEL, "--max-concurrent", "4")
    with (
        caching_upstreams(
            3,
            speeds=[1.0, 4.0, 2.0],
            model=MODEL,
            cost_per_token=1 / RATE,
            serial_prefill=True,
            reply_tokens=2,
        ) as pool,
        cluster(
            relay_server_factory,
            2,
            ROUTING_POLICY="predicted",
            RATES_SHARE_SECS="0.3",
            RATES_HALF_LIFE_SECS="120",
        ) as (a, b),
        running_worker(a, pool.upstreams[0].url, *flags, "--worker-name", "slow"),
        running_worker(b, pool.upstreams[1].url, *flags, "--worker-name", "fast"),
    ):
        poll(lambda: len(speeds_of(a.url)) == 2, timeout=20, what="both workers, cluster-wide")
        # Requests through both processes, four at a time: both workers learn.
        for turn in range(8):
            threads = [
                threading.Thread(target=chat, args=((a, b)[(turn + i) % 2].url, size))
                for i, size in enumerate((400, 3200, 6400, 1600))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        learned = speeds_of(a.url)
        assert learned["slow"]["learned"] and learned["fast"]["learned"]
        assert (
            learned["fast"]["prefill_tokens_per_sec"]
            > 2 * learned["slow"]["prefill_tokens_per_sec"]
        )

        def agreed() -> bool:
            mine, theirs = stats(a.url)["cluster"]["speeds"], stats(b.url)["cluster"]["speeds"]
            return len(mine) == 2 and mine == theirs

        poll(agreed, timeout=10, what="both processes predicting from the same speeds")
        shared = stats(a.url)["cluster"]["speeds"]
        by_name = {row["instance"]: row for row in shared.values()}
        assert len(by_name) == 2  # one worker of each process

        # Long prompts sent to the process whose own worker is the slow one are placed
        # on the other process's fast worker (least load would keep them local).
        before = len(pool.served)
        for _ in range(4):
            assert chat(a.url, 6400) == 200
        assert [s.index for s in pool.served[before:]] == [1] * 4

        # A worker with no history borrows the cluster's median (both processes' workers).
        with running_worker(a, pool.upstreams[2].url, *flags, "--worker-name", "new"):
            poll(lambda: "new" in speeds_of(a.url), timeout=20, what="the new worker")
            new = speeds_of(a.url)["new"]
            assert not new["learned"] and new["confidence"] == 0
            spts = sorted(
                1 / m[MODEL]["prefill_tokens_per_sec"]
                for m in (row["models"] for row in shared.values())
            )
            median = 1 / (sum(spts) / 2)
            assert new["prefill_tokens_per_sec"] == pytest.approx(median, rel=0.1)


async def test_the_placement_script_follows_the_predicted_costs_within_the_guard():
    """``place.lua`` alone, on the tests' Redis: given costs, the cheapest worker within
    the bounded-load guard, its load read in the script; a worker without a cost costs
    the default; the conversation's worker saves what its cache holds."""
    import redis.asyncio as aioredis

    require_redis()
    redis = aioredis.from_url(REDIS_URL)
    state = ClusterState(redis, f"mrtest-{secrets.token_hex(4)}")
    now = now_ms()
    try:
        rows = [
            WorkerRow(wid, "local", 8, False, False, ("m",), {}) for wid in ("slow", "fast", "new")
        ]
        await state.announce("p", "http://127.0.0.1:1", rows, now, 60_000, "c")
        n = iter(range(100))

        async def place(
            costs: str, default: tuple[float, float], anchor: str = "", slack: int = 2
        ) -> str:
            kind, placed, _, _ = await state.place(
                provider="local", model="m", entry=f"p|r{next(n)}", origin="p", now_ms=now,
                deadline_ms=now + 60_000, hold_ms=60_000, seq=0, max_queue=-1,
                costs=costs, default_cost=default, anchor=anchor, load_slack=slack,
            )  # fmt: skip
            assert kind == "placed" and placed is not None
            return placed.worker_id

        costs = "slow 900 100 0;fast 300 100 0"
        # The new worker (no cost given) costs the default: 2,000 ms, never chosen here.
        # fast: 300 + load x 100: it takes requests until the guard (least + 1 + 2: 3).
        chosen = [await place(costs, (2000.0, 0.0)) for _ in range(4)]
        assert chosen == ["fast", "fast", "fast", "slow"]
        # Cheap enough, a worker without history is chosen too.
        assert await place(costs, (100.0, 0.0)) == "new"
        # The conversation's worker saves what it holds (the guard set wide for this):
        # the slow one, holding it, wins; then the conversation's worker is the one chosen.
        hit = "slow 900 0 700;fast 300 0 0"
        assert await place(hit, (5000.0, 0.0), anchor="c1", slack=20) == "fast"  # new to it
        await redis.set(f"{state.prefix}:aff:local:c1", "slow")
        assert await place(hit, (5000.0, 0.0), anchor="c1", slack=20) == "slow"
        assert await place("slow 900 0 500;fast 300 0 0", (5000.0, 0.0), "c1", 20) == "fast"
        assert await redis.get(f"{state.prefix}:aff:local:c1") == b"fast"
    finally:
        keys = [key async for key in redis.scan_iter(match=f"{state.prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def test_the_largest_speeds_document_is_taken_without_holding_up_the_loop():
    """Another process's speeds (the cluster's own, bounded all the same): one at the
    bound is read a slice at a time; one byte over it is skipped."""
    from relay.server.cluster.speeds import MAX_DOCUMENT_BYTES, ClusterSpeeds, _Document, _Shared
    from tests.corekit import make_relay
    from tests.stall import STALL_BUDGET_MS, LoopStalls

    relay = make_relay()
    speeds = ClusterSpeeds()
    speeds.relay = relay
    speeds.instance = "me"
    speeds._init_speeds(1.0)
    numbers = [0.0002, 0.01, 40.0, 1.5, 0.9, 100.0, 0.02, 0.0002, 0.01, 40.0, 1.5]
    workers: dict[str, _Shared] = {}
    encode = msgspec.json.Encoder().encode
    raw = b""
    while True:  # as many workers as fit under the bound
        grown = dict(workers)
        for i in range(len(workers), len(workers) + 500):
            grown[f"w-p{i:08x}"] = _Shared("local", 3, {"mock-model": numbers})
        candidate = encode(_Document(workers=grown, bpt={"mock-model": 4.0}))
        if len(candidate) > MAX_DOCUMENT_BYTES:
            break
        workers, raw = grown, candidate
    assert len(raw) > MAX_DOCUMENT_BYTES * 0.9
    async with LoopStalls() as stalls:
        await speeds._take_speeds([("other", raw)], relay.loop.time())
    assert len(speeds.shared) == len(workers) > 2000
    assert stalls.longest_ms < STALL_BUDGET_MS, stalls.longest_ms
    over = raw[:-1] + b" " * (MAX_DOCUMENT_BYTES - len(raw) + 1) + b"}"
    assert len(over) == MAX_DOCUMENT_BYTES + 1
    await speeds._take_speeds([("other", over)], relay.loop.time())
    assert speeds.shared == {}
