"""Requests from the official SDKs served by legacy nodes, with §6 semantics (SPEC §12).

A live ``manage.py serve`` on 127.0.0.1, the fake node of :mod:`tests.legacynode` and,
for the mixed pool, the real ``worker.py`` in front of :mod:`tests.upstream`. Timings
are shrunk through env; tests wait on what the node, the backend or the server saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.legacykit import (
    CHAT,
    MESSAGES,
    SHARED_ENV,
    modern_worker,
    node,
    read_all,
    serving,
    stream_chat,
    streamed_text,
    user,
    workers_for,
)
from tests.live import LiveServer, live_server
from tests.upstream import FakeUpstream, expected_text

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the tests that leave it as they found it (each uses its own model)."""
    with live_server(tmp_path_factory.mktemp("legacy") / "server", **SHARED_ENV) as server:
        yield server


def oai(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def ant(server: LiveServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="sk-ant", max_retries=0)


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
        (listed,) = await workers_for(shared, "cancel-me")
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
        listed = {w["name"]: w for w in await workers_for(shared, model)}
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


async def test_deadlines_and_the_stream_ceiling_stop_the_task(relay_server_factory: Any) -> None:
    env = {**SHARED_ENV, "REQUEST_TIMEOUT_SECS": "2", "MAX_STREAM_BYTES": "4096"}
    with relay_server_factory(**env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            async with node(server, "slow", stepped=True) as slow:
                await serving(server, "slow")
                call = asyncio.create_task(
                    client.post(CHAT, json={"model": "slow", "messages": user("never")})
                )
                task = await slow.wait_task()
                answer = await call
                assert answer.status_code == 504
                assert answer.json()["error"]["code"] == "request_timeout"
                await slow.wait_stop(task["id"])

            async with node(server, "chatty", reply=lambda task: "word " * 1000) as chatty:
                await serving(server, "chatty")
                body = {"model": "chatty", "stream": True, "messages": user("talk")}
                async with client.stream("POST", CHAT, json=body) as response:
                    received = b"".join([part async for part in response.aiter_raw()])
                assert b'"code":"stream_too_large"' in received and b"[DONE]" not in received
                assert len(received) < 8192
                await chatty.wait_stop(chatty.tasks[0]["id"])
