"""Nodes and clients of the older broker against a live server (SPEC §12).

A real ``manage.py serve`` on 127.0.0.1, the fake legacy node of
:mod:`tests.legacynode`, and — for the mixed pools and the old client API — the real
``worker.py`` in front of :mod:`tests.upstream`'s fake backend. Clients are httpx and
the official ``openai`` and ``anthropic`` SDKs. Timings are shrunk through env; tests
wait on what the node, the backend or the server saw, never on time.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.legacynode import LegacyNode
from tests.live import ROOT, LiveServer, live_server
from tests.test_e2e import FAST as WORKER_FAST
from tests.upstream import FakeUpstream, expected_text

pytestmark = pytest.mark.live

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
JSON = {"content-type": "application/json"}
ADMIN = {"authorization": "Bearer admin-token"}
#: Every fake node beats ten times a second: far inside HEARTBEAT_TIMEOUT_SECS below.
BEAT = 0.1
SHARED_ENV = {
    "HEARTBEAT_INTERVAL_SECS": "0.3",
    "HEARTBEAT_TIMEOUT_SECS": "2",
    "QUEUE_TIMEOUT_SECS": "10",
    "REQUEST_TIMEOUT_SECS": "30",
    "MODELRELAY_ADMIN_TOKEN": "admin-token",
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the tests that leave it as they found it (each uses its own model)."""
    with live_server(tmp_path_factory.mktemp("legacy") / "server", **SHARED_ENV) as server:
        yield server


def node(server: LiveServer, model: str, **options: Any) -> LegacyNode:
    options.setdefault("heartbeat", BEAT)
    options.setdefault("token", server.secret)
    return LegacyNode(server.url, model=model, **options)


async def poll(check: Any, timeout: float = 10.0, what: str = "condition") -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.02)


async def workers(server: LiveServer) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        return (await client.get("/admin/workers", headers=ADMIN)).json()


async def serving(server: LiveServer, model: str, count: int = 1) -> None:
    """Wait until ``count`` connected workers serve ``model``."""

    async def ready() -> bool:
        return sum(model in w["models"] for w in await workers(server)) == count

    await poll(ready, what=f"{count} worker(s) for {model}")


async def dropped_frames(server: LiveServer) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        stats = (await client.get("/admin/stats", headers=ADMIN)).json()
    return int(stats["dropped_worker_frames"])


def oai(server: LiveServer, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="sk-test", max_retries=0, default_headers=headers
    )


def ant(server: LiveServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-ant", max_retries=0)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- the SDKs


async def test_the_openai_sdk_gets_answers_from_a_legacy_node(shared: LiveServer) -> None:
    # Three bytes a piece: every "€" arrives split across two binary frames.
    async with node(shared, "oa-legacy", max_concurrency=2, piece_bytes=3) as box:
        await serving(shared, "oa-legacy")
        client = oai(shared)
        messages: Any = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "price in €?"}]},
        ]
        completion = await client.chat.completions.create(
            model="oa-legacy", messages=messages, max_tokens=40, temperature=0.25
        )
        assert completion.choices[0].message.content == "echo: price in €?"
        assert completion.choices[0].finish_reason == "stop"
        assert completion.model == "oa-legacy" and completion.id.startswith("chatcmpl-")
        assert completion.usage is not None and completion.usage.model_extra == {"estimated": True}
        task = box.tasks[0]
        assert task["state"] == 0 and task["system"] == "be brief"
        assert task["messages"] == [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "price in €?"},
        ]
        assert (task["max_new_tokens"], task["temperature"]) == (40, 0.25)
        assert isinstance(task["created_at"], int)

        stream = await client.chat.completions.create(
            model="oa-legacy",
            messages=user("streamed €€"),
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for chunk in stream:
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(parts) == "echo: streamed €€"
        assert usage is not None and usage.completion_tokens > 0
        assert usage.model_extra == {"estimated": True}
        assert box.tasks[1]["max_new_tokens"] == 1024  # LEGACY_DEFAULT_MAX_NEW_TOKENS
        assert box.tasks[1]["id"] != box.tasks[0]["id"]


async def test_the_anthropic_sdk_gets_answers_from_a_legacy_node(shared: LiveServer) -> None:
    async with node(shared, "an-legacy") as box:
        await serving(shared, "an-legacy")
        client = ant(shared)
        message = await client.messages.create(
            model="an-legacy",
            max_tokens=64,
            system=[{"type": "text", "text": "you are old"}],
            messages=user("hello there"),
        )
        assert message.content[0].type == "text"
        assert message.content[0].text == "echo: hello there"
        assert message.stop_reason == "end_turn" and message.model == "an-legacy"
        assert message.usage.output_tokens > 0
        assert (box.tasks[0]["system"], box.tasks[0]["max_new_tokens"]) == ("you are old", 64)

        async with client.messages.stream(
            model="an-legacy", max_tokens=64, messages=user("stream me please")
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "echo: stream me please"
        assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


async def test_what_legacy_nodes_cannot_take_is_a_clear_400(shared: LiveServer) -> None:
    async with node(shared, "text-only"):
        await serving(shared, "text-only")
        image: Any = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]
        with pytest.raises(openai.BadRequestError, match="served only by legacy nodes"):
            await oai(shared).chat.completions.create(model="text-only", messages=image)
        tool: Any = [{"name": "f", "input_schema": {"type": "object"}}]
        with pytest.raises(anthropic.BadRequestError, match="cannot use tools"):
            await ant(shared).messages.create(
                model="text-only", max_tokens=8, messages=user("x"), tools=tool
            )
        with pytest.raises(openai.BadRequestError, match="not /v1/responses"):
            await oai(shared).responses.create(model="text-only", input="x")


# --------------------------------------------------------------------------- §6 semantics


async def stream_chat(client: httpx.AsyncClient, model: str, text: str = "go") -> Any:
    """A streaming chat request; entering it waits for the first byte (the headers come
    with it), so a stepped node must be released first."""
    body = {"model": model, "stream": True, "messages": user(text)}
    return client.stream("POST", CHAT, json=body, timeout=15)


def read_all(client: httpx.AsyncClient, model: str, text: str) -> asyncio.Task[bytes]:
    """A streaming chat request read to its end in the background."""

    async def run() -> bytes:
        async with await stream_chat(client, model, text) as response:
            return b"".join([part async for part in response.aiter_raw()])

    return asyncio.create_task(run())


def streamed_text(received: bytes) -> str:
    return "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in received.decode().splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    )


async def test_a_client_disconnect_stops_the_task_and_frees_the_slot(shared: LiveServer) -> None:
    async with (
        node(shared, "cancel-me", max_concurrency=1, stepped=True) as box,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "cancel-me")
        box.release()  # the first piece only
        async with await stream_chat(client, "cancel-me", "one two three") as response:
            task = await box.wait_task()
            first = await response.aiter_raw().__anext__()
            assert b'"role":"assistant"' in first
        await box.wait_stop(task["id"])
        (listed,) = [w for w in await workers(shared) if "cancel-me" in w["models"]]
        assert listed["load"] == 0
        box.stepped = False
        answer = await client.post(
            CHAT, json={"model": "cancel-me", "messages": user("again")}, timeout=10
        )
        assert answer.json()["choices"][0]["message"]["content"] == "echo: again"
        assert box.tasks[1]["id"] != task["id"]


async def test_a_node_lost_before_the_first_byte_hands_the_task_to_another(
    shared: LiveServer,
) -> None:
    async with (
        node(shared, "requeue-me", name="first", stepped=True) as first,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "requeue-me")
        call = read_all(client, "requeue-me", "survive this")
        await first.wait_task()
        async with node(shared, "requeue-me", name="second") as second:
            await serving(shared, "requeue-me", 2)
            first.kill()
            received = await call
            assert second.tasks[0]["messages"] == user("survive this")
        assert streamed_text(received) == "echo: survive this"


async def test_a_node_lost_after_the_first_byte_ends_the_stream_with_an_error_event(
    shared: LiveServer,
) -> None:
    async with (
        node(shared, "lose-me", stepped=True) as box,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "lose-me")
        box.release()
        async with await stream_chat(client, "lose-me", "a b c") as response:
            chunks = response.aiter_raw()
            first = await chunks.__anext__()
            assert b"echo:" in first or b"assistant" in first
            box.kill()
            rest = b"".join([part async for part in chunks])
        assert b'"code":"worker_lost"' in rest and b"[DONE]" not in rest
        body = {"model": "lose-me", "stream": True, "max_tokens": 8, "messages": user("x")}
        async with node(shared, "lose-me", name="again", stepped=True) as other:
            await serving(shared, "lose-me")
            other.release()
            async with client.stream("POST", MESSAGES, json=body) as response:
                chunks = response.aiter_raw()
                assert b"message_start" in await chunks.__anext__()
                other.kill()
                rest = b"".join([part async for part in chunks])
            assert b"event: error" in rest and b"message_stop" not in rest


@asynccontextmanager
async def modern_worker(
    server: LiveServer, upstream: FakeUpstream, model: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The real ``worker.py`` serving ``model`` from the fake upstream."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "worker.py",
        "--proxy-url",
        server.url,
        "--worker-secret",
        server.secret,
        "--backend-url",
        upstream.url,
        "--worker-name",
        "modern-box",
        "--models",
        model,
        "--max-concurrent",
        "1",
        *WORKER_FAST,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_two_nodes_and_a_modern_worker_share_one_model(shared: LiveServer) -> None:
    model = "mixed-pool"
    async with (
        FakeUpstream(models=[model]) as upstream,
        modern_worker(shared, upstream, model),
        node(shared, model, name="old-a", stepped=True) as a,
        node(shared, model, name="old-b", stepped=True) as b,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, model, 3)
        listed = {w["name"]: w for w in await workers(shared) if model in w["models"]}
        assert {n: w["protocol_version"] for n, w in listed.items()} == {
            "old-a": "legacy",
            "old-b": "legacy",
            "modern-box": "1",
        }
        # One request each: the three are equally idle, and capacity is one apiece.
        body = {"model": model, "messages": user("share"), "mock": {"stepped": True}}
        calls = [asyncio.create_task(client.post(CHAT, json=body)) for _ in range(3)]
        await a.wait_task()
        await b.wait_task()
        await upstream.wait_requests(1, path=CHAT)
        a.release(2)
        b.release(2)
        upstream.release(10)
        answers = [(await call).json() for call in calls]
        texts = sorted(answer["choices"][0]["message"]["content"] for answer in answers)
        assert texts == sorted(["echo: share", "echo: share", expected_text(5)])

        # What a node cannot take goes to the modern worker only, even while the
        # nodes are idle: images, tools, and any other endpoint.
        a.stepped = b.stepped = False
        image: Any = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
        ]
        pictured = await client.post(CHAT, json={"model": model, "messages": image})
        assert pictured.json()["choices"][0]["message"]["content"] == expected_text(5)
        responses = await client.post("/v1/responses", json={"model": model, "input": "x"})
        assert responses.status_code == 200
        assert [r.path for r in upstream.requests if r.method == "POST"] == [
            CHAT,
            CHAT,
            "/v1/responses",
        ]
        assert (len(a.tasks), len(b.tasks)) == (1, 1)


# --------------------------------------------------------------------------- bad nodes


async def test_bad_frames_are_dropped_and_counted_and_never_delivered(shared: LiveServer) -> None:
    async with (
        node(shared, "bad-frames", stepped=True) as box,
        httpx.AsyncClient(base_url=shared.url, timeout=15) as client,
    ):
        await serving(shared, "bad-frames")
        before = await dropped_frames(shared)
        call = read_all(client, "bad-frames", "clean")
        task_id = (await box.wait_task())["id"]
        await box.send_raw(b"\x00\x01")  # shorter than a task id
        await box.send_raw((task_id + 1000).to_bytes(4, "big") + b"stray")  # unknown id
        await box.send_raw(task_id.to_bytes(4, "big") + b"\xff\xfe\xfd")  # not UTF-8
        await box.send_raw("what the old nodes log")  # other text: only logged
        box.release(5)
        received = await call
        await box.wait_finished(task_id)
        await box.send_raw(task_id.to_bytes(4, "big") + b"after the end")  # finished id
        await poll(lambda: _equals(dropped_frames(shared), before + 4), what="four dropped frames")
        assert b"stray" not in received and b"after" not in received
        assert streamed_text(received) == "echo: clean" and b"data: [DONE]" in received
        assert box.closed_with is None
        shared.wait_for_log("says: what the old nodes log")


async def _equals(value: Any, expected: int) -> bool:
    return await value == expected


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
        (before,) = [w for w in await workers(shared) if "twin" in w["models"]]
        async with node(shared, "twin", name="box", path="/v1/worker/legacy") as new:
            assert await old.wait_closed() == (4003, "replaced by a new connection")
            await poll(
                lambda: _workers_for(
                    shared, "twin", lambda ws: len(ws) == 1 and ws[0]["id"] != before["id"]
                ),
                what="the new connection to be the only one",
            )
            async with node(shared, "twin", name="other-box"):  # another name: no replacing
                await serving(shared, "twin", 2)
                assert new.closed_with is None


async def _workers_for(server: LiveServer, model: str, check: Any) -> bool:
    return bool(check([w for w in await workers(server) if model in w["models"]]))


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
        (listed,) = [w for w in await workers(shared) if "drain-me" in w["models"]]
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
        env = {**shared.env, "MODELRELAY_ADMIN_TOKEN": "admin-token"}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "manage.py",
            "workers",
            "--server",
            shared.url,
            cwd=ROOT,
            env=env,
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


# --------------------------------------------------------------------------- connecting


async def test_nodes_with_missing_parameters_or_bad_tokens_get_the_old_close_codes(
    relay_server_factory: Any,
) -> None:
    with relay_server_factory(
        AUTH_MAX_FAILURES="2", MODELRELAY_ADMIN_TOKEN="admin-token"
    ) as server:
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
    with relay_server_factory(MODELRELAY_ADMIN_TOKEN="admin-token") as server:
        async with node(server, "m", path="/v1/worker/legacy", provider="local", heartbeat=BEAT):
            await serving(server, "m")
            (listed,) = await workers(server)
            assert (listed["provider"], listed["protocol_version"]) == ("local", "legacy")


# --------------------------------------------------------------------------- the old API


async def old_chat(
    client: httpx.AsyncClient, headers: dict[str, str] | None = None, **document: Any
) -> tuple[int, list[dict[str, Any]]]:
    document.setdefault("messages", user("hello"))
    response = await client.post("/api/chat", json=document, headers=headers or {}, timeout=20)
    assert response.headers["content-type"].startswith("text/event-stream")
    return response.status_code, [json.loads(line) for line in response.text.splitlines()]


def text_of(lines: list[dict[str, Any]]) -> str:
    return "".join(line["o"] for line in lines if "o" in line)


async def test_the_old_api_is_served_by_a_legacy_node(shared: LiveServer) -> None:
    async with (
        node(shared, "old-api-node", piece_bytes=2) as box,
        httpx.AsyncClient(base_url=shared.url) as client,
    ):
        await serving(shared, "old-api-node")
        status, lines = await old_chat(
            client,
            model="old-api-node",
            system="sys",
            temperature=0.5,
            max_new_tokens=33,
            conversation_id="conv-1",
            user_id=7,
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "ça va €"},
            ],
        )
        assert status == 200
        assert text_of(lines) == "echo: ça va €" and lines[-1] == {"done": True}
        assert all(set(line) == {"o"} for line in lines[:-1])
        task = box.tasks[0]
        assert (task["system"], task["max_new_tokens"], task["temperature"]) == ("sys", 33, 0.5)
        assert task["messages"][-1] == {"role": "user", "content": "ça va €"}
        shared.wait_for_log("conversation_id=conv-1 user_id=7")

        assert (await old_chat(client, model="nobody-serves-this"))[1] == [{"err": "unknown model"}]
        assert (await old_chat(client, model="old-api-node", messages="hi"))[1] == [
            {"err": "invalid request"}
        ]
        # A node lost mid-answer: the text so far, then the old error.
        box.stepped, box.piece_bytes = True, None
        box.release()
        body = {"model": "old-api-node", "messages": user("x y z")}
        async with client.stream("POST", "/api/chat", json=body, timeout=20) as response:
            incoming = response.aiter_lines()
            assert json.loads(await incoming.__anext__()) == {"o": "echo: "}
            box.kill()
            rest = [json.loads(line) async for line in incoming if line]
        assert rest == [{"err": "timeout waiting for finish"}]


async def test_the_old_api_is_served_by_a_modern_worker(shared: LiveServer) -> None:
    model = "old-api-modern"
    async with (
        FakeUpstream(models=[model]) as upstream,
        modern_worker(shared, upstream, model),
        httpx.AsyncClient(base_url=shared.url) as client,
    ):
        await serving(shared, model)
        status, lines = await old_chat(client, model=model, system="sys", max_new_tokens=9)
        assert status == 200
        assert text_of(lines) == expected_text(5) and lines[-1] == {"done": True}
        (seen,) = upstream.requests_to(CHAT)
        sent = seen.json()
        assert sent["messages"] == [{"role": "system", "content": "sys"}, *user("hello")]
        assert (sent["stream"], sent["max_tokens"]) == (True, 9)
        assert "authorization" not in seen.headers


async def test_the_old_api_with_keys_required_and_its_timeouts_and_the_stream_ceiling(
    relay_server_factory: Any,
) -> None:
    env = {
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "MODELRELAY_ADMIN_TOKEN": "admin-token",
        "QUEUE_TIMEOUT_SECS": "0.5",
        "REQUEST_TIMEOUT_SECS": "2",
        "MAX_STREAM_BYTES": "4096",
    }
    with relay_server_factory(**env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            made = await client.post("/admin/keys", headers=ADMIN, json={"name": "old-client"})
            key = made.json()["secret"]
            bearer = {"authorization": f"Bearer {key}"}
            async with node(server, "kept", stepped=True) as box:
                await serving(server, "kept")
                assert (await old_chat(client, model="kept"))[1] == [{"err": "unauthorized"}]
                wrong = {"authorization": "Bearer mrk_not-a-key"}
                assert (await old_chat(client, wrong, model="kept"))[1] == [{"err": "unauthorized"}]
                box.release(2)
                status, lines = await old_chat(client, bearer, model="kept")
                assert (status, lines) == (200, [{"o": "echo: "}, {"o": "hello"}, {"done": True}])
                box.release(2)
                sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
                answer = await sdk.chat.completions.create(model="kept", messages=user("sdk"))
                assert answer.choices[0].message.content == "echo: sdk"

                # One slot: the first request holds it past REQUEST_TIMEOUT_SECS, the
                # second finds no node within QUEUE_TIMEOUT_SECS.
                held = asyncio.create_task(old_chat(client, bearer, model="kept"))
                task = await box.wait_task(3)
                waiting = await old_chat(client, bearer, model="kept")
                assert waiting[1] == [{"err": "timeout waiting for node"}]
                assert (await held)[1] == [{"err": "timeout waiting for finish"}]
                await box.wait_stop(task["id"])

            # The stream ceiling: the client gets the error event, the node a stop.
            long = node(server, "chatty", reply=lambda task: "word " * 1000)
            async with long as chatty:
                await serving(server, "chatty")
                body = {"model": "chatty", "stream": True, "messages": user("talk")}
                async with client.stream("POST", CHAT, json=body, headers=bearer) as response:
                    received = b"".join([part async for part in response.aiter_raw()])
                assert b'"code":"stream_too_large"' in received
                assert len(received) < 8192
                await chatty.wait_stop(chatty.tasks[0]["id"])
