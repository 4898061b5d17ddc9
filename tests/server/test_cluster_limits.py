"""Per-key limits held across two server processes sharing Redis (SPEC §11, §13)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio

from tests.conftest import REDIS_URL, require_redis
from tests.live import LiveServer
from tests.scriptedworker import AnyOf, ScriptedWorker
from tests.server.test_cluster import eventually

pytestmark = [pytest.mark.live, pytest.mark.redis]

ADMIN = "cluster-limits-admin"
MESSAGES = [{"role": "user", "content": "hi"}]


def cluster_env() -> dict[str, str]:
    return {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}",
        "MODELRELAY_ADMIN_TOKEN": ADMIN,
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "LIMITS_LEASE_SECS": "0.6",
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    }


async def new_key(server: LiveServer, **limits: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as admin:
        made = await admin.post(
            "/admin/keys",
            json={"name": "shared", **limits},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
    assert made.status_code == 201, made.text
    return made.json()


def client(server: LiveServer, secret: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0)


async def chat(oa: openai.AsyncOpenAI, model: str = "m", **extra: Any) -> Any:
    return await oa.chat.completions.create(model=model, messages=MESSAGES, **extra)  # type: ignore[arg-type]


async def known_everywhere(secret: str, *servers: LiveServer) -> None:
    """Wait until every process loaded the key (the Redis broadcast)."""
    for server in servers:

        async def loaded(server: LiveServer = server) -> bool:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
                listed = await http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
                return listed.status_code == 200

        await eventually(loaded, timeout=10)


async def model_known(server: LiveServer, model: str, secret: str) -> None:
    """Wait until ``server`` learned that another process's worker serves ``model``."""

    async def listed() -> bool:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
            models = await http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
            return model in {entry["id"] for entry in models.json()["data"]}

    await eventually(listed, timeout=10)


async def refused(oa: openai.AsyncOpenAI, **extra: Any) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as caught:
        await asyncio.wait_for(chat(oa, **extra), 10)
    return caught.value


@pytest.fixture
def common() -> Iterator[dict[str, str]]:
    """The two processes' shared settings; their Redis keys are deleted afterwards."""
    require_redis()
    env = cluster_env()
    yield env
    client = redis.Redis.from_url(env["REDIS_URL"])
    try:
        stale = list(client.scan_iter(match=f"{env['REDIS_PREFIX']}:*"))
        if stale:
            client.delete(*stale)
    finally:
        client.close()


async def test_limits_hold_across_two_processes_and_die_with_a_process(
    relay_server_factory, common
):
    with relay_server_factory(**common) as a:  # noqa: SIM117 (b needs a's database)
        with relay_server_factory(**common, DATABASE_URL=a.env["DATABASE_URL"]) as b:
            async with (
                ScriptedWorker(a, ["m", "at-a"]) as on_a,
                ScriptedWorker(b, ["m", "at-b"]) as on_b,
            ):
                # Cluster mode: a request admitted at one process may run on the
                # worker of the other; the limits hold wherever it runs.
                anywhere = AnyOf(on_a, on_b)

                # Concurrency: a request held (admitted at a) counts at b.
                one = (await new_key(a, max_concurrent=1))["secret"]
                await known_everywhere(one, a, b)
                held = asyncio.ensure_future(chat(client(a, one)))
                holder, request = await anywhere.next()
                assert (await refused(client(b, one))).code == "rate_limit_exceeded"
                await holder.answer(request)
                await held
                served = asyncio.ensure_future(anywhere.serve(1))
                await chat(client(b, one))  # freed at a, admitted at b
                await served

                # The request rate: one allowance for both processes.
                rated = (await new_key(a, requests_per_minute=2))["secret"]
                await known_everywhere(rated, a, b)
                served = asyncio.ensure_future(anywhere.serve(2))
                await chat(client(a, rated))
                await chat(client(b, rated))
                await served
                assert (await refused(client(a, rated))).code == "rate_limit_exceeded"

                # A budget spent through one process is spent at both, also when the
                # request ran on the other process's worker (which alone learns its
                # tokens): "at-a" is served only at a, "at-b" only at b.
                await model_known(a, "at-b", one)
                await model_known(b, "at-a", one)
                for through, model in ((a, "at-b"), (b, "at-a")):
                    budget = (await new_key(a, tokens_per_day=100))["secret"]
                    await known_everywhere(budget, a, b)
                    served = asyncio.ensure_future(anywhere.serve(1, prompt=70, completion_=50))
                    await chat(client(through, budget), model)
                    await served
                    for at in (a, b):

                        async def spent(at: LiveServer = at, budget: str = budget) -> bool:
                            try:
                                served = asyncio.ensure_future(anywhere.serve(1))
                                await chat(client(at, budget))
                                await served
                                return False
                            except openai.RateLimitError as exc:
                                served.cancel()
                                return exc.code == "insufficient_quota"

                        await eventually(spent, timeout=5)

                # What a request may cost is reserved against the budget while it runs,
                # for every process: one held at a that may cost 100 leaves nothing of a
                # 10-token budget at b; it cost 4, and the rest comes back as it ends.
                small = (await new_key(a, tokens_per_day=10))["secret"]
                await known_everywhere(small, a, b)
                held = asyncio.ensure_future(chat(client(a, small), max_tokens=100))
                holder, request = await anywhere.next()
                refusal = await refused(client(b, small), max_tokens=100)
                assert refusal.code == "insufficient_quota"
                await holder.answer(request, prompt=2, completion_=2)
                await held

                async def admitted_at_b() -> bool:
                    try:
                        served = asyncio.ensure_future(anywhere.serve(1))
                        await chat(client(b, small), max_tokens=100)
                        await served
                        return True
                    except openai.RateLimitError:
                        served.cancel()
                        return False

                await eventually(admitted_at_b, timeout=5)

                # A process that dies holding a slot and a reservation: neither counts
                # once its lease (LIMITS_LEASE_SECS) runs out.
                last = (await new_key(a, max_concurrent=1, tokens_per_day=10))["secret"]
                await known_everywhere(last, a, b)
                orphan = asyncio.ensure_future(chat(client(a, last), max_tokens=100))
                await anywhere.next()
                assert (await refused(client(b, last))).code == "insufficient_quota"
                a.kill()
                with pytest.raises(openai.APIConnectionError):
                    await orphan

                async def freed_at_b() -> bool:
                    try:
                        served = asyncio.ensure_future(on_b.serve(1))
                        await chat(client(b, last))
                        await served
                        return True
                    except openai.RateLimitError:
                        served.cancel()
                        return False

                await eventually(freed_at_b, timeout=10)


async def test_keys_take_turns_in_the_shared_queue_across_processes(relay_server_factory, common):
    """The fair order of SPEC §13 holds in the cluster's shared queue: requests queued
    at different processes take turns by key, weighted, FIFO within a key."""
    shared = redis.asyncio.Redis.from_url(common["REDIS_URL"])

    async def queued(count: int) -> None:
        async def reached() -> bool:
            keys = [k async for k in shared.scan_iter(match=f"{common['REDIS_PREFIX']}:q:*")]
            return sum([await shared.zcard(k) for k in keys]) == count

        await eventually(reached, timeout=10)

    def send(server: LiveServer, secret: str, tag: str) -> asyncio.Future[Any]:
        return asyncio.ensure_future(
            client(server, secret).chat.completions.create(
                model="m",
                messages=MESSAGES,  # type: ignore[arg-type]
                user=tag,
            )
        )

    async def dispatch_order(worker: ScriptedWorker, count: int) -> list[str]:
        """Answer ``count`` requests one at a time (capacity 1); the tags in order."""
        order = []
        for _ in range(count):
            request = await worker.next()
            order.append(json.loads(request.body)["user"])
            await worker.answer(request)
        return order

    try:
        with relay_server_factory(**common) as a:  # noqa: SIM117 (b needs a's database)
            with relay_server_factory(**common, DATABASE_URL=a.env["DATABASE_URL"]) as b:
                async with ScriptedWorker(b, ["m"], max_concurrent=1) as worker:
                    flood, late, heavy, light = [
                        (await new_key(a, weight=weight))["secret"] for weight in (1, 1, 3, 1)
                    ]
                    for secret in (flood, late, heavy, light):
                        await known_everywhere(secret, a, b)
                    await model_known(a, "m", flood)

                    # Key A floods through process a; key B, later, through process b.
                    calls = [send(a, flood, "A0")]
                    held = await worker.next()
                    for n in range(1, 20):
                        calls.append(send(a, flood, f"A{n}"))
                        await queued(n)  # in arrival order
                    for n in range(3):  # one at a time, so arrival order is tag order
                        calls.append(send(b, late, f"B{n}"))
                        await queued(20 + n)
                    await worker.answer(held)
                    order = await dispatch_order(worker, 22)
                    # B's requests wait behind one request of A per freed slot, not 19.
                    assert order[:7] == ["A1", "B0", "A2", "B1", "A3", "B2", "A4"], order
                    assert order[7:] == [f"A{n}" for n in range(5, 20)]
                    for call in calls:
                        await call

                    # Weights 3:1 under contention: three of C's per one of D's.
                    blocker = send(b, late, "hold")
                    held = await worker.next()
                    calls = []
                    for n in range(24):  # one at a time, so arrival order is tag order
                        calls.append(
                            send(a, heavy, f"C{n}") if n < 12 else send(b, light, f"D{n - 12}")
                        )
                        await queued(n + 1)
                    await worker.answer(held)
                    order = await dispatch_order(worker, 24)
                    assert [tag[0] for tag in order[:16]] == list("CCCD" * 4), order
                    for key in "CD":  # FIFO within a key
                        mine = [int(tag[1:]) for tag in order if tag[0] == key]
                        assert mine == sorted(mine)
                    for call in [blocker, *calls]:
                        await call
    finally:
        await shared.aclose()
