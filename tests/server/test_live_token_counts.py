"""A worker's token counts past any real figure, against a live server on a raw worker
socket (a well-behaved worker drops them before sending): the reference's ``u64``
counts are accepted, an absurd one is dropped and the figures marked an estimate, and
the worker keeps serving; what a ``u64`` cannot hold closes it with 1002."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from relay.wire import protocol
from tests.live import LiveServer
from tests.rawworker import closed, connect, expect, register

pytestmark = pytest.mark.live

ADMIN = "counts-admin"
U64_MAX = 2**64 - 1


def complete(request_id: str, counts: str) -> str:
    """A ``response_complete`` frame with ``counts`` as raw JSON (the typed message
    would drop an absurd count before it is sent)."""
    return (
        json.dumps(
            {
                "type": "response_complete",
                "request_id": request_id,
                "status_code": 200,
                "headers": {"content-type": "application/json"},
                "body": '{"ok":true}',
            }
        )[:-1]
        + f',"token_counts":{counts}}}'
    )


def tokens(server: LiveServer, metric: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    found = {}
    for labels, value in re.findall(rf"^{metric}\{{([^}}]*)\}} (\S+)$", text, re.M):
        parsed = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if parsed.get("model") == "m":
            found[parsed["kind"]] = float(value)
    return found


async def dispatched(ws: Any, call: asyncio.Future[httpx.Response]) -> protocol.Request:
    """The request ``call`` sent, as the raw worker receives it; a call answered without
    reaching the worker fails the test with its answer rather than a timeout."""
    got = asyncio.ensure_future(expect(ws, protocol.Request, timeout=30))
    await asyncio.wait({got, call}, return_when=asyncio.FIRST_COMPLETED)
    if not got.done():
        got.cancel()
        response = call.result()
        pytest.fail(f"answered {response.status_code} before reaching the worker: {response.text}")
    request: protocol.Request = got.result()
    return request


async def test_an_absurd_count_is_dropped_and_the_worker_keeps_serving(relay_server_factory):
    with relay_server_factory(
        MODELRELAY_REQUIRE_API_KEYS="true", MODELRELAY_ADMIN_TOKEN=ADMIN
    ) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            made = await http.post(
                "/admin/keys",
                json={"name": "counted", "tokens_per_day": 100},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            assert made.status_code == 201, made.text
            auth = {"Authorization": f"Bearer {made.json()['secret']}"}

            async def chat() -> httpx.Response:
                return await http.post(
                    "/v1/chat/completions", json={"model": "m", "messages": []}, headers=auth
                )

            async with await connect(server) as ws:
                await register(ws)
                answers: list[Any] = []
                for counts in (
                    f'{{"prompt_tokens":{U64_MAX},"completion_tokens":2}}',
                    f'{{"prompt_tokens":{10**13},"completion_tokens":3,'
                    f'"total_tokens":{10**13 + 3},"cached_tokens":{U64_MAX}}}',
                    '{"prompt_tokens":4,"completion_tokens":5}',  # the same socket serves on
                ):
                    call = asyncio.ensure_future(chat())
                    request = await dispatched(ws, call)
                    await ws.send(complete(request.request_id, counts))
                    answers.append(await call)
                assert [a.status_code for a in answers] == [200, 200, 200]
                # Charged 2 + 3 + 9 of its 100 tokens, not 2**64: the key still runs.
                last = asyncio.ensure_future(chat())
                request = await dispatched(ws, last)
                await ws.send(complete(request.request_id, '{"prompt_tokens":1}'))
                assert (await last).status_code == 200
                stats = await http.get("/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"})
                (key,) = [k for k in stats.json()["keys"] if k["name"] == "counted"]
                assert key["tokens_today"] == 15, key

                # A u64 holds no negative count: the frame is malformed (1002).
                await ws.send(complete("not-in-flight", '{"completion_tokens":-1}'))
                code, _ = await closed(ws)
                assert code == 1002
        assert tokens(server, "modelrelay_tokens_total") == {"prompt": 5, "completion": 10}
        # The two requests whose figures are not all the backend's are estimates.
        assert tokens(server, "modelrelay_tokens_estimated_total") == {
            "prompt": 0,
            "completion": 5,
        }
