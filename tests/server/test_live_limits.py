"""Per-key limits as clients see them (SPEC §13): a live server, a scripted worker and
the official ``openai`` and ``anthropic`` SDKs, which raise their own error types for
429, 403 and 401 when the relay answers in their envelope."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live import LiveServer
from tests.scriptedworker import ScriptedWorker

pytestmark = pytest.mark.live

ADMIN = "limits-admin"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.live import live_server

    with live_server(
        tmp_path_factory.mktemp("limits"),
        MODELRELAY_REQUIRE_API_KEYS="true",
        MODELRELAY_ADMIN_TOKEN=ADMIN,
        BATCH_POLL_SECS="0.05",
        BATCH_FLUSH_SECS="0.02",
    ) as running:
        yield running


@pytest.fixture
async def worker(server: LiveServer) -> AsyncIterator[ScriptedWorker]:
    async with ScriptedWorker(server, ["m", "n"]) as scripted:
        yield scripted


async def new_key(server: LiveServer, name: str = "sdk", **limits: Any) -> str:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as admin:
        made = await admin.post(
            "/admin/keys",
            json={"name": name, **limits},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
    assert made.status_code == 201, made.text
    return made.json()["secret"]


def client(server: LiveServer, secret: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=secret, max_retries=0)


async def chat(oa: openai.AsyncOpenAI, model: str = "m") -> Any:
    return await oa.chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]


async def test_too_many_concurrent_requests_get_rate_limit_error_with_retry_after(server, worker):
    oa = client(server, await new_key(server, max_concurrent=1))
    held = asyncio.ensure_future(chat(oa))
    request = await worker.next()
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(oa)
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.response.headers["retry-after"] == "1"
    assert "concurrent" in refused.value.message
    await worker.answer(request)
    assert (await held).choices[0].message.content == "hi"
    served = asyncio.ensure_future(worker.serve(1))
    await chat(oa)  # the slot is free again
    await served


async def test_requests_per_minute_refill_continuously_and_say_when(server, worker):
    oa = client(server, await new_key(server, requests_per_minute=2))
    served = asyncio.ensure_future(worker.serve(2))
    await chat(oa)
    await chat(oa)
    await served
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(oa)
    assert refused.value.code == "rate_limit_exceeded"
    assert 29 <= int(refused.value.response.headers["retry-after"]) <= 30


async def test_a_model_the_key_may_not_use_is_403_in_both_envelopes(server, worker):
    secret = await new_key(server, allowed_models=["m"])
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await chat(client(server, secret), model="n")
    assert refused.value.code == "model_not_allowed"
    an = anthropic.AsyncAnthropic(base_url=server.url, api_key=secret, max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as anthropic_refused:
        await an.messages.create(model="n", max_tokens=8, messages=MESSAGES)  # type: ignore[arg-type]
    assert anthropic_refused.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    models = await client(server, secret).models.list()
    assert [m.id for m in models.data] == ["m"]


async def test_an_expired_key_is_401(server, worker):
    past = (dt.datetime.now(tz=dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    oa = client(server, await new_key(server, expires_at=past))
    with pytest.raises(openai.AuthenticationError) as refused:
        await chat(oa)
    assert "expired" in refused.value.message


async def test_a_token_budget_crossed_midway_finishes_that_request_then_refuses(server, worker):
    day = time.gmtime().tm_yday
    oa = client(server, await new_key(server, tokens_per_day=100))
    served = asyncio.ensure_future(worker.serve(1, prompt=30, completion_=30))
    await chat(oa)
    await served
    served = asyncio.ensure_future(worker.serve(1, prompt=30, completion_=30))
    crossing = await chat(oa)  # started at 60 of 100: it finishes, at 120
    await served
    assert crossing.usage is not None and crossing.usage.total_tokens == 60
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(oa)
    if time.gmtime().tm_yday != day:
        pytest.skip("the UTC day ended during the test: the budget renewed")
    assert refused.value.code == "insufficient_quota"
    assert refused.value.type == "insufficient_quota"
    now = time.time()
    until_midnight = 86_400 - now % 86_400
    assert abs(int(refused.value.response.headers["retry-after"]) - until_midnight) <= 2


async def spent_today(server: LiveServer, name: str) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as admin:
        stats = (
            await admin.get("/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"})
        ).json()
    return sum(k["tokens_today"] for k in stats["keys"] if k["name"] == name)


async def test_a_budget_counts_what_requests_in_flight_may_cost_and_settles_each(server, worker):
    """A 10-token daily budget and requests that may cost 100 tokens: one at a time runs,
    and one that cost less than it might gives the rest back when it ends."""
    oa = client(server, await new_key(server, tokens_per_day=10, name="in-flight"))

    async def chat_100() -> Any:
        call = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100)  # type: ignore[arg-type]
        return await asyncio.wait_for(call, 10)

    held = asyncio.ensure_future(chat_100())
    first = await worker.next()
    with pytest.raises(openai.RateLimitError) as refused:  # 0 spent, but 100 reserved
        await chat_100()
    assert refused.value.code == "insufficient_quota"
    await worker.answer(first, prompt=2, completion_=2)  # it cost 4: 96 come back
    await held
    again = asyncio.ensure_future(chat_100())  # 4 of 10 spent: admitted
    await worker.answer(await worker.next(), prompt=5, completion_=5)
    await again
    with pytest.raises(openai.RateLimitError):  # 14 spent
        await chat_100()
    assert await spent_today(server, "in-flight") == 14


async def batch_metric(server: LiveServer, name: str) -> float:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as scraper:
        text = (await scraper.get("/metrics")).text
    found = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_batch_lines_of_a_budgeted_key_run_no_more_than_its_budget_covers(server, worker):
    """Four lines of 100 tokens at most, four free slots and a 10-token daily budget:
    the first line runs, the others are refused while it may still cost 100."""
    secret = await new_key(server, tokens_per_day=10, name="batch-budget")
    auth = {"Authorization": f"Bearer {secret}"}
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": MESSAGES, "max_tokens": 100},
        }
        for n in range(4)
    ]
    retries = await batch_metric(server, "modelrelay_batch_line_retries")
    async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=10) as api:
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = await api.post(
            "/v1/files",
            files={"file": ("in.jsonl", content, "application/jsonl")},
            data={"purpose": "batch"},
        )
        assert uploaded.status_code == 200, uploaded.text
        made = await api.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert made.status_code == 200, made.text
    first = await worker.next()
    async with asyncio.timeout(10):  # the other lines were tried: refused at admission
        while await batch_metric(server, "modelrelay_batch_line_retries") <= retries:
            await asyncio.sleep(0.02)
    assert worker.requests.empty() and worker.holding == {first.request_id}
    await worker.answer(first, prompt=3, completion_=2)
    async with asyncio.timeout(10):
        while await spent_today(server, "batch-budget") != 5:
            await asyncio.sleep(0.05)
    assert worker.requests.empty()
