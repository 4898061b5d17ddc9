"""Models on demand through live servers (SPEC §19): raw workers that speak the
``model_states`` extension (tests/statesworker.py), one process and two processes
sharing Redis; the relay decides what is loaded where."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.wire.protocol import LOADABLE, LOADED
from tests.clusterkit import CHAT, cluster, knows, until
from tests.clusterkit import waiting as queued
from tests.statesworker import StatesWorker

pytestmark = pytest.mark.live


async def waiting(server, count: int) -> bool:
    return await queued(server) == count


async def chat(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post(CHAT, json={"model": model, "messages": []})


async def test_ten_requests_for_a_model_loaded_nowhere_cause_one_load_and_all_succeed(
    relay_server_factory,
):
    with relay_server_factory() as server:
        async with (
            StatesWorker(server, {"a": LOADED, "c": LOADABLE}, name="one", hold_loads=True) as one,
            StatesWorker(server, {"b": LOADED, "c": LOADABLE}, name="two", hold_loads=True) as two,
            httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        ):
            listed = {
                m["id"]: m.get("state") for m in (await client.get("/v1/models")).json()["data"]
            }
            assert listed == {"a": LOADED, "b": LOADED, "c": LOADABLE}
            calls = asyncio.gather(*(chat(client, "c") for _ in range(10)))
            await until(lambda: waiting(server, 10), what="ten requests waiting for the load")
            one.finish_loads()
            two.finish_loads()
            answers = await calls
            assert [r.status_code for r in answers] == [200] * 10
            assert sorted(one.loads() + two.loads()) == ["c"]
            assert not one.misrouted and not two.misrouted
            listed = {
                m["id"]: m.get("state") for m in (await client.get("/v1/models")).json()["data"]
            }
            assert listed["c"] == LOADED
            samples = [
                s
                for family in text_string_to_metric_families((await client.get("/metrics")).text)
                for s in family.samples
                if s.labels.get("model") == "c"
            ]
            states = {
                (s.labels["worker"], s.labels["state"])
                for s in samples
                if s.name == "modelrelay_worker_model_state"
            }
            loaded_at = "one" if one.loads() else "two"
            assert states == {
                (loaded_at, LOADED),
                ({"one": "two", "two": "one"}[loaded_at], LOADABLE),
            }
            loads = {
                s.labels["worker"]: s.value
                for s in samples
                if s.name == "modelrelay_model_loads_total"
            }
            assert loads == {loaded_at: 1.0}
            waited = [s for s in samples if s.name == "modelrelay_model_load_waited_requests_total"]
            assert sum(s.value for s in waited) == 10


async def test_a_full_box_unloads_its_idle_model_and_requests_never_reach_the_wrong_box(
    relay_server_factory,
):
    with relay_server_factory(MODELRELAY_ADMIN_TOKEN="admin-token") as server:
        async with (
            StatesWorker(server, {"a": LOADED, "b": LOADABLE}, capacity=1, name="box") as box,
            httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        ):
            for model in ["a", "b", "b", "a"]:
                assert (await chat(client, model)).status_code == 200
            assert box.ops == [("unload", "a"), ("load", "b"), ("unload", "b"), ("load", "a")]
            assert not box.misrouted
            workers = (
                await client.get("/admin/workers", headers={"Authorization": "Bearer admin-token"})
            ).json()
            (shown,) = workers["workers"] if isinstance(workers, dict) else workers
            assert shown["model_capacity"] == 1
            rows = {row["model"]: row for row in shown["model_states"]}
            assert rows["a"]["state"] == LOADED and rows["b"]["state"] == LOADABLE
            assert rows["a"]["loads"] == 1 and rows["a"]["unloads"] == 1
            assert rows["b"]["loads"] == 1 and rows["b"]["unloads"] == 1
            assert rows["b"]["waited_for_load"] == 1 and rows["b"]["last_load_secs"] is not None


async def test_a_load_that_never_ends_gives_504_within_the_load_timeout(relay_server_factory):
    env = {"MODEL_LOAD_TIMEOUT_SECS": "0.5", "QUEUE_TIMEOUT_SECS": "0.1"}
    with relay_server_factory(**env) as server:
        async with (
            StatesWorker(server, {"c": LOADABLE}, answer_loads=False) as box,
            httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        ):
            answer = await chat(client, "c")
            assert answer.status_code == 504
            assert "could not be loaded in time" in answer.json()["error"]["message"]
            assert box.loads() == ["c"]


async def test_a_load_every_box_fails_answers_503_saying_so(relay_server_factory):
    with relay_server_factory() as server:
        async with (
            StatesWorker(server, {"c": LOADABLE}, fail_loads=True, name="one") as one,
            StatesWorker(server, {"c": LOADABLE}, fail_loads=True, name="two") as two,
            httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        ):
            answer = await chat(client, "c")
            assert answer.status_code == 503 and answer.headers["retry-after"]
            assert "could not be loaded" in answer.json()["error"]["message"]
            assert one.loads() == ["c"] and two.loads() == ["c"]  # each tried once


@pytest.mark.redis
async def test_two_processes_load_a_model_once_between_them_and_serve_every_request(
    relay_server_factory,
):
    with cluster(relay_server_factory, 2) as (a, b):
        async with (
            StatesWorker(a, {"x": LOADED, "c": LOADABLE}, capacity=1, name="at-a") as at_a,
            StatesWorker(b, {"y": LOADED, "c": LOADABLE}, capacity=1, name="at-b") as at_b,
            httpx.AsyncClient(base_url=a.url, timeout=20) as to_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as to_b,
        ):
            await knows(a, "c")
            await knows(b, "c")
            calls = [chat(to_a, "c") for _ in range(5)] + [chat(to_b, "c") for _ in range(5)]
            answers = await asyncio.gather(*calls)
            assert [r.status_code for r in answers] == [200] * 10
            # One box unloaded its idle model and loaded c; the other did nothing.
            ops = sorted([*at_a.ops, *at_b.ops])
            assert ops == [("load", "c"), ("unload", "x")] or ops == [
                ("load", "c"),
                ("unload", "y"),
            ]
            assert not at_a.misrouted and not at_b.misrouted
            loaded_at = at_a if at_a.loads() else at_b
            assert loaded_at.served == ["c"] * 10

            async def listed_loaded() -> bool:
                models = (await to_b.get("/v1/models")).json()["data"]
                return any(m["id"] == "c" for m in models)

            await until(listed_loaded, what="c listed at b")
