"""Legacy nodes' lives on a live server: connecting with the old close codes,
replacement, heartbeat, bad frames, drain and what operators see (SPEC §12)."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.legacykit import (
    ADMIN,
    CHAT,
    SHARED_ENV,
    dropped_frames,
    node,
    poll,
    read_all,
    serving,
    streamed_text,
    user,
    workers,
    workers_for,
)
from tests.live import ROOT, LiveServer, live_server

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the tests that leave it as they found it (each uses its own model)."""
    with live_server(tmp_path_factory.mktemp("nodes") / "server", **SHARED_ENV) as server:
        yield server


# --------------------------------------------------------------------------- connecting


async def test_nodes_with_missing_parameters_or_bad_tokens_get_the_old_close_codes(
    relay_server_factory: Any,
) -> None:
    with relay_server_factory(**SHARED_ENV, AUTH_MAX_FAILURES="2") as server:
        good = {"name": "n", "model": "m", "token": server.secret, "max_concurrency": "1"}
        for missing in ("name", "model", "token", "max_concurrency"):
            params = {k: v for k, v in good.items() if k != missing}
            async with node(server, "m", params=params) as refused:
                assert await refused.wait_closed() == (4001, f"missing parameter: {missing}")
        async with node(server, "m", params={**good, "max_concurrency": "many"}) as refused:
            assert await refused.wait_closed() == (
                4001,
                "max_concurrency must be a positive integer",
            )
        async with node(server, "m", provider="nobody") as refused:
            assert await refused.wait_closed() == (4002, "unknown provider 'nobody'")
        async with node(server, "m", token="mrw_wrong") as refused:
            assert await refused.wait_closed() == (4002, "invalid token")
        # The modern workers' per-address throttle: two failures block this address.
        async with node(server, "m") as blocked:
            code, reason = await blocked.wait_closed()
            assert code == 4002 and reason.startswith("too many failed authentication attempts")
        assert await workers(server) == []


async def test_the_legacy_path_and_a_named_provider_are_accepted(relay_server_factory: Any) -> None:
    with relay_server_factory(**SHARED_ENV) as server:
        async with node(server, "m", path="/v1/worker/legacy", provider="local"):
            await serving(server, "m")
            (listed,) = await workers(server)
            assert (listed["provider"], listed["protocol_version"]) == ("local", "legacy")


# --------------------------------------------------------------------------- bad nodes


async def test_bad_frames_are_dropped_and_counted_and_never_delivered(shared: LiveServer) -> None:
    async with (
        node(shared, "bad-frames", stepped=True) as box,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "bad-frames")
        before = await dropped_frames(shared)
        logged = len(shared.log())
        call = read_all(client, "bad-frames", "clean")
        task_id = (await box.wait_task())["id"]
        await box.send_raw(b"\x00\x01")  # shorter than a task id
        await box.send_raw((task_id + 1000).to_bytes(4, "big") + b"stray")  # unknown id
        await box.send_raw(task_id.to_bytes(4, "big") + b"\xff\xfe\xfd")  # not UTF-8
        await box.send_raw("what the old nodes log")  # other text: a bad frame too
        box.release(5)
        received = await call
        await box.wait_finished(task_id)
        await box.send_raw(task_id.to_bytes(4, "big") + b"after the end")  # finished id

        async def five_dropped() -> bool:
            return await dropped_frames(shared) == before + 5

        await poll(five_dropped, what="five dropped frames")
        assert b"stray" not in received and b"after" not in received
        assert streamed_text(received) == "echo: clean" and b"data: [DONE]" in received
        assert box.closed_with is None
        # One line for the first; the rest in a summary at the end of the window.
        assert shared.log()[logged:].count("dropped a frame from legacy node") == 1


async def test_a_node_flooding_bad_frames_is_closed_and_the_others_carry_on(
    shared: LiveServer,
) -> None:
    async with (
        node(shared, "flood", name="flooder") as flooder,
        node(shared, "flood", name="calm") as calm,
    ):
        await serving(shared, "flood", 2)
        for _ in range(101):  # LEGACY_BAD_FRAME_LIMIT (100) within the window
            await flooder.send_raw(b"\x01")
        assert await flooder.wait_closed() == (1002, "too many bad frames")
        await serving(shared, "flood", 1)
        async with httpx.AsyncClient(base_url=shared.url, timeout=15) as client:
            answer = await client.post(CHAT, json={"model": "flood", "messages": user("hi")})
        assert answer.json()["choices"][0]["message"]["content"] == "echo: hi"
        assert calm.closed_with is None and len(calm.tasks) == 1


async def test_a_reconnecting_node_replaces_its_old_connection(shared: LiveServer) -> None:
    async with node(shared, "twin", name="box") as old:
        await serving(shared, "twin")
        (before,) = await workers_for(shared, "twin")

        async def only_the_new_one() -> bool:
            listed = await workers_for(shared, "twin")
            return len(listed) == 1 and listed[0]["id"] != before["id"]

        async with node(shared, "twin", name="box", path="/v1/worker/legacy") as new:
            assert await old.wait_closed() == (4003, "replaced by a new connection")
            await poll(only_the_new_one, what="the new connection to be the only one")
            async with node(shared, "twin", name="other-box"):  # another name: no replacing
                await serving(shared, "twin", 2)
                assert new.closed_with is None


async def test_a_silent_node_is_dropped_and_a_beating_one_kept(shared: LiveServer) -> None:
    async with (
        node(shared, "beats", name="beating") as beating,
        node(shared, "beats", name="silent") as silent,
    ):
        await serving(shared, "beats", 2)
        silent.pause_heartbeat()
        assert await silent.wait_closed() == (1001, "worker heartbeat timed out")
        # 2 s of HEARTBEAT_TIMEOUT_SECS and more have passed with the other one beating.
        await beating.wait_heartbeats(beating.heartbeats + 5)
        assert beating.closed_with is None
        await serving(shared, "beats", 1)


async def test_a_drained_node_finishes_its_task_then_is_closed_4000(shared: LiveServer) -> None:
    async with (
        node(shared, "drain-me", stepped=True) as box,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "drain-me")
        (listed,) = await workers_for(shared, "drain-me")
        call = asyncio.create_task(
            client.post(CHAT, json={"model": "drain-me", "messages": user("last one")})
        )
        await box.wait_task()
        drained = await client.post(f"/admin/workers/{listed['id']}/drain", headers=ADMIN, json={})
        assert drained.status_code == 202
        assert box.closed_with is None
        box.release(5)
        assert (await call).json()["choices"][0]["message"]["content"] == "echo: last one"
        assert await box.wait_closed() == (4000, "worker drained")


async def test_operators_see_legacy_nodes_in_the_commands_and_the_audit(shared: LiveServer) -> None:
    async with node(shared, "visible", name="seen-box", max_concurrency=3):
        await serving(shared, "visible")
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "manage.py",
            "workers",
            "--server",
            shared.url,
            cwd=ROOT,
            env=shared.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output = (await process.communicate())[0].decode()
        assert process.returncode == 0, output
        (row,) = [line for line in output.splitlines() if "seen-box" in line]
        assert "0/3" in row and "visible" in row
    await poll(lambda: _audit_closed(shared, "seen-box"), what="the session row to close")


async def _audit_closed(server: LiveServer, name: str) -> bool:
    if "sqlite" not in server.env["DATABASE_URL"]:
        return True  # the PostgreSQL pass checks the same rows elsewhere
    with sqlite3.connect(server.data_dir / "db.sqlite3") as db:
        rows = db.execute(
            "SELECT protocol_version, model_names, max_concurrent, disconnected_at "
            "FROM workers_app_workersession WHERE worker_name = ?",
            (name,),
        ).fetchall()
    return len(rows) == 1 and rows[0][:3] == ("legacy", '["visible"]', 3) and rows[0][3] is not None
