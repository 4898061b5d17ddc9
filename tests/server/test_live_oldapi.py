"""The old client API, ``POST /api/chat``, on a live server (SPEC §12): served by a
legacy node and by the real ``worker.py``, with the old error lines, API keys and
the queue and request deadlines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.legacykit import (
    ADMIN,
    CHAT,
    SHARED_ENV,
    modern_worker,
    node,
    serving,
    user,
)
from tests.live import LiveServer, live_server
from tests.upstream import FakeUpstream, expected_text

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the tests that leave it as they found it (each uses its own model)."""
    with live_server(tmp_path_factory.mktemp("oldapi") / "server", **SHARED_ENV) as server:
        yield server


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
        assert rest == [{"err": "node lost"}]


async def test_the_old_api_is_served_by_a_modern_worker(shared: LiveServer) -> None:
    model = "old-api-modern"
    async with (
        FakeUpstream(models=[model]) as upstream,
        modern_worker(shared, upstream, model),
        httpx.AsyncClient(base_url=shared.url) as client,
    ):
        await serving(shared, model)
        old_token = {"authorization": "Bearer the-old-brokers-token"}
        status, lines = await old_chat(
            client, old_token, model=model, system="sys", max_new_tokens=9
        )
        assert status == 200
        assert text_of(lines) == expected_text(5) and lines[-1] == {"done": True}
        assert all(set(line) == {"o"} for line in lines[:-1])
        (seen,) = upstream.requests_to(CHAT)
        sent = seen.json()
        assert sent["messages"] == [{"role": "system", "content": "sys"}, *user("hello")]
        assert (sent["stream"], sent["max_tokens"]) == (True, 9)
        assert "authorization" not in seen.headers

    # A backend that fails (a broken answer: a backend that never answers hands the
    # request back to be requeued instead): the old error line.
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-len")
        writer.close()

    backend = await asyncio.start_server(broken, "127.0.0.1", 0)
    port = backend.sockets[0].getsockname()[1]
    async with (
        modern_worker(shared, f"http://127.0.0.1:{port}", "old-api-dead"),
        httpx.AsyncClient(base_url=shared.url) as client,
    ):
        await serving(shared, "old-api-dead")
        status, lines = await old_chat(client, model="old-api-dead")
        assert (status, lines) == (200, [{"err": "backend error 502"}])
    backend.close()


async def test_the_old_api_with_keys_required_and_its_deadlines(
    relay_server_factory: Any,
) -> None:
    env = {
        **SHARED_ENV,
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "QUEUE_TIMEOUT_SECS": "0.5",
        "REQUEST_TIMEOUT_SECS": "2",
    }
    with relay_server_factory(**env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            made = await client.post("/admin/keys", headers=ADMIN, json={"name": "old-client"})
            key = made.json()["secret"]
            bearer = {"authorization": f"Bearer {key}"}
            made = await client.post(
                "/admin/keys", headers=ADMIN, json={"name": "rpm", "requests_per_minute": 1}
            )
            limited = {"authorization": f"Bearer {made.json()['secret']}"}
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

                # A key over its requests per minute: told so, not of a timeout.
                box.release(2)
                status, lines = await old_chat(client, limited, model="kept")
                assert (status, lines[-1]) == (200, {"done": True})
                response = await client.post(
                    "/api/chat", json={"model": "kept", "messages": user("again")}, headers=limited
                )
                assert response.status_code == 429
                assert int(response.headers["retry-after"]) >= 1
                assert response.json() == {"err": "rate limit of this key exceeded"}
