"""Priority classes as clients and operators see them (SPEC §15): the openai SDK's
``service_tier``, the ``X-Priority`` header, a key's default and highest class, and a
``flex`` request preempted before its first byte whose client sees one clean response.
A live server, a scripted worker (SPEC §4 frames only), the request log read back."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tests.clusterkit import AUTH, CHAT, cluster, knows, until, waiting
from tests.live import LiveServer
from tests.scriptedworker import ScriptedWorker

pytestmark = pytest.mark.live

ADMIN = "classes-admin"
MESSAGES = [{"role": "user", "content": "hi"}]
#: PRIORITY_AGING_SECS, shrunk: a request waiting longer counts one class higher.
AGING = 0.4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.live import live_server

    with live_server(
        tmp_path_factory.mktemp("classes"),
        MODELRELAY_REQUIRE_API_KEYS="true",
        MODELRELAY_ADMIN_TOKEN=ADMIN,
        REQUEST_LOG_FLUSH_SECS="0.05",
        PRIORITY_AGING_SECS=str(AGING),
    ) as running:
        yield running


@pytest.fixture
async def worker(server: LiveServer) -> AsyncIterator[ScriptedWorker]:
    async with ScriptedWorker(server, ["m"], max_concurrent=1) as scripted:
        yield scripted


async def new_key(server: LiveServer, **fields: Any) -> str:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as admin:
        made = await admin.post(
            "/admin/keys",
            json={"name": "k", **fields},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
    assert made.status_code == 201, made.text
    return made.json()["secret"]


def logged(server: LiveServer, request_id: str) -> tuple[str, int]:
    """(class, preemptions) of a request in the request log, once it is written."""
    database = server.env["DATABASE_URL"]
    if not database.startswith("sqlite:///"):
        pytest.skip("the request log is read back from the SQLite file")
    with sqlite3.connect(database.removeprefix("sqlite:///")) as db:
        return db.execute(
            "SELECT service_class, preemptions FROM workers_app_requestlog WHERE request_id = ?",
            (request_id,),
        ).fetchone()


async def log_row(server: LiveServer, request_id: str) -> tuple[str, int]:
    async with asyncio.timeout(10):
        while True:
            row = await asyncio.to_thread(logged, server, request_id)
            if row is not None:
                return row
            await asyncio.sleep(0.05)


async def test_a_flex_request_preempted_before_its_first_byte_gives_its_client_one_response(
    server, worker
):
    secret = await new_key(server, default_class="default", max_class="priority")
    oa = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0)
    bulk = asyncio.ensure_future(
        oa.chat.completions.create(model="m", messages=MESSAGES, service_tier="flex")  # type: ignore[call-overload]
    )
    first = await worker.next()
    person = asyncio.ensure_future(oa.chat.completions.create(model="m", messages=MESSAGES))  # type: ignore[arg-type]
    second = await worker.next()  # the flex one was cancelled (its slot taken) first
    assert worker.holding == {second.request_id}
    await worker.answer(second, completion_=2)
    answered = await person
    assert answered.usage is not None and answered.usage.completion_tokens == 2
    again = await worker.next()
    assert again.request_id == first.request_id and again.body == first.body
    await worker.answer(again, completion_=3)
    reply = await bulk
    assert reply.usage is not None and reply.usage.completion_tokens == 3  # one clean response
    assert await log_row(server, first.request_id) == ("flex", 1)
    assert await log_row(server, second.request_id) == ("default", 0)
    async with httpx.AsyncClient(timeout=5) as scrape:
        metrics = (await scrape.get(server.url + "/metrics")).text
    assert "modelrelay_preemptions_total 1.0" in metrics


async def aged_flex_then_a_person(
    worker: ScriptedWorker,
    send: Any,
    at: tuple[LiveServer, LiveServer, LiveServer],
    admin: dict[str, str],
) -> tuple[str, str]:
    """Two slots: a flex request G starts at once; a flex request F waits past the aging
    bound behind a default one, then starts (the last to start). A default request that
    arrives then takes G's slot: F counts as default now, it is never preempted, and each
    client gets one response. ``at``: where the default, the flex and the last requests
    are sent (``send(server, class, tag)`` makes the call, ``tag`` in its body); ``admin``
    authenticates ``/admin/stats``. Returns the ids F and G had at the worker."""
    busy = send(at[0], "default", "x")
    x = await worker.next()
    fresh = send(at[1], "flex", "g")
    g = await worker.next()
    aged = send(at[1], "flex", "f")
    await until(lambda: _waiting(at[1], 1), what="the flex request to queue")
    await until(lambda: _aged(at[1], admin), timeout=10, what="the flex request to age")
    await worker.answer(x)
    f = await worker.next()
    assert (await busy).status_code == 200
    person = send(at[2], "default", "p")
    cancelled = await until(lambda: _cancelled(worker, {g.request_id, f.request_id}))
    assert cancelled == {g.request_id}  # the one that counts as flex, not the last started
    p = await worker.next()
    assert json.loads(p.body)["tag"] == "p"
    await worker.answer(f, completion_=5)
    reply = await asyncio.wait_for(aged, 10)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    await worker.answer(p)
    assert (await person).status_code == 200
    again = await worker.next()
    assert json.loads(again.body)["tag"] == "g"  # put back, and run once
    await worker.answer(again, completion_=3)
    assert (await fresh).json()["usage"]["completion_tokens"] == 3
    assert worker.peak == 2
    return f.request_id, g.request_id


async def _waiting(server: LiveServer, count: int) -> bool:
    return await waiting(server) >= count


async def _aged(server: LiveServer, admin: dict[str, str]) -> bool:
    """Whether the one queued request counts as ``default`` now (it was ``flex``)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=5, headers=admin) as client:
        queued = (await client.get("/admin/stats")).json()["queue_by_class"]
    return queued == {"priority": 0, "default": 1, "flex": 0}


async def _cancelled(worker: ScriptedWorker, ids: set[str]) -> set[str]:
    """Which of ``ids`` the worker was told to drop (empty while none)."""
    return {i for i in ids if i not in worker.holding}


async def test_a_flex_request_that_aged_before_it_started_is_never_preempted(server):
    secret = await new_key(server, default_class="default", max_class="priority")
    async with (
        ScriptedWorker(server, ["m"], max_concurrent=2) as worker,
        httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {secret}"}) as client,
    ):

        def send(at: LiveServer, service_class: str, tag: str) -> asyncio.Future[httpx.Response]:
            return asyncio.ensure_future(
                client.post(
                    at.url + CHAT,
                    json={"model": "m", "tag": tag},
                    headers={"x-priority": service_class},
                )
            )

        admin = {"authorization": f"Bearer {ADMIN}"}
        aged, fresh = await aged_flex_then_a_person(worker, send, (server, server, server), admin)
    assert await log_row(server, aged) == ("flex", 0)  # billed as what it asked for
    assert await log_row(server, fresh) == ("flex", 1)


async def test_a_key_asking_above_its_highest_class_is_clamped_not_refused(server, worker):
    secret = await new_key(server, default_class="flex", max_class="default")
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=15, headers=headers) as client:
        for ask, expected in (
            ({"x-priority": "priority"}, "default"),  # clamped
            ({}, "flex"),  # the key's default
            ({"x-priority": "flex"}, "flex"),
        ):
            call = asyncio.ensure_future(client.post(CHAT, json={"model": "m"}, headers=ask))
            request = await worker.next()
            await worker.answer(request)
            assert (await call).status_code == 200
            assert (await log_row(server, request.request_id))[0] == expected
        bad = await client.post(CHAT, json={"model": "m"}, headers={"x-priority": "urgent"})
        assert bad.status_code == 400 and "X-Priority" in bad.json()["error"]["message"]
        bad = await client.post(CHAT, json={"model": "m", "service_tier": "fastest"})
        assert bad.status_code == 400 and "service_tier" in bad.json()["error"]["message"]


async def test_the_admin_api_keeps_a_keys_classes_and_refuses_unknown_ones(server):
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=auth) as admin:
        made = await admin.post("/admin/keys", json={"name": "bulk", "default_class": "flex"})
        assert made.status_code == 201
        key = made.json()
        assert (key["default_class"], key["max_class"]) == ("flex", "default")
        changed = await admin.patch(f"/admin/keys/{key['id']}", json={"max_class": "priority"})
        assert changed.json()["max_class"] == "priority"
        listed = {k["id"]: k for k in (await admin.get("/admin/keys")).json()}
        assert listed[key["id"]]["max_class"] == "priority"
        wrong = await admin.post("/admin/keys", json={"name": "x", "max_class": "urgent"})
        assert wrong.status_code == 400


@pytest.mark.redis
async def test_across_processes_a_person_takes_the_slot_of_bulk_work_elsewhere(
    relay_server_factory,
):
    """The only worker is at A, busy with a flex request of a client of B; a default
    request at A finds no slot: B (which owns the flex request) gives its slot up."""
    with cluster(relay_server_factory, 2) as (a, b):
        async with (
            ScriptedWorker(a, ["m"], max_concurrent=1) as worker,
            httpx.AsyncClient(timeout=30) as client,
        ):
            await knows(b, "m")
            bulk = asyncio.ensure_future(
                client.post(b.url + CHAT, json={"model": "m", "service_tier": "flex"})
            )
            first = await worker.next()
            person = asyncio.ensure_future(client.post(a.url + CHAT, json={"model": "m"}))
            second = await worker.next(timeout=10)
            assert second.request_id != first.request_id
            await worker.answer(second)
            assert (await person).status_code == 200
            again = await worker.next(timeout=10)  # the flex request, placed again
            await worker.answer(again)
            assert (await bulk).status_code == 200
            assert worker.peak == 1


@pytest.mark.redis
async def test_across_processes_a_flex_request_that_aged_before_it_started_is_never_preempted(
    relay_server_factory,
):
    """The same across processes: the worker is at A, the flex requests are clients of B
    (which judges them: it owns them), the default ones of A; the shared queue ages F."""
    with cluster(relay_server_factory, 2, PRIORITY_AGING_SECS=str(AGING)) as (a, b):
        async with (
            ScriptedWorker(a, ["m"], max_concurrent=2) as worker,
            httpx.AsyncClient(timeout=30) as client,
        ):
            await knows(b, "m")

            def send(
                at: LiveServer, service_class: str, tag: str
            ) -> asyncio.Future[httpx.Response]:
                return asyncio.ensure_future(
                    client.post(
                        at.url + CHAT,
                        json={"model": "m", "tag": tag},
                        headers={"x-priority": service_class},
                    )
                )

            await aged_flex_then_a_person(worker, send, (a, b, a), AUTH)
