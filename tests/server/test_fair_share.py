"""Sharing the pool between API keys, through the real ASGI app (SPEC §13): fair
dispatch order, per-key limits at the edge, and who is using the pool."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter, deque

import pytest
from asgiref.sync import sync_to_async

from keys.services import create_key, update_key
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = "fair-share-admin"


@pytest.fixture
async def keyed(fresh_runtime, settings):
    settings.MODELRELAY_REQUIRE_API_KEYS = True
    settings.MODELRELAY_ADMIN_TOKEN = ADMIN
    settings.MAX_QUEUE_LEN = 1000
    await make_provider()


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


async def send(secret: str, tag: str) -> HttpCall:
    return await HttpCall(
        "POST", "/v1/chat/completions", chat(user=tag), headers=bearer(secret)
    ).send()


async def admin_stats():
    return await (await HttpCall("GET", "/admin/stats", headers=bearer(ADMIN)).send()).json()


async def serve(worker: FakeWorker, total: int, capacity: int) -> list[tuple[str, str]]:
    """Answer ``total`` requests, oldest running first, never more than ``capacity`` at
    once; returns the ("dispatch" | "done", tag) events in the order they happened."""
    events: list[tuple[str, str]] = []
    running: deque[tuple[str, str]] = deque()
    received = 0
    while received < total or running:
        while len(running) < capacity and received < total:
            frame = await worker.expect(protocol.Request)
            received += 1
            tag = json.loads(frame.body)["user"]
            events.append(("dispatch", tag))
            running.append((frame.request_id, tag))
        request_id, tag = running.popleft()
        await worker.answer(request_id, prompt_tokens=1, completion_tokens=1)
        events.append(("done", tag))
    return events


async def test_five_requests_of_one_key_are_not_held_back_by_200_of_another(keyed):
    """200 requests of key A, then 5 of key B, one worker with capacity 2.

    Bound (relay.core.fairqueue, every weight 1): B's j-th request (j = 1..5) is
    dispatched after at most 2 + j of A's requests — the two already running when B's
    arrived, then at most one per turn of A. So all of B's are dispatched before A's
    8th, and (answered oldest first) done before A's 9th is dispatched; the weaker
    promise, done before A's 20th-from-last request is dispatched, follows.
    """
    a = await sync_to_async(create_key)("A")
    b = await sync_to_async(create_key)("B")
    relay = runtime.current().relay
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=2)
        calls = [await send(a.secret, f"A{i}") for i in range(200)]
        await until(lambda: relay.queue_depth() == 198, timeout=20)
        calls += [await send(b.secret, f"B{j}") for j in range(5)]
        await until(lambda: relay.queue_depth() == 203)
        events = await serve(worker, total=205, capacity=2)
    for call in calls:
        assert (await call.response())[0] == 200
    dispatched = [tag for kind, tag in events if kind == "dispatch"]
    for j in range(5):
        before = dispatched[: dispatched.index(f"B{j}")]
        assert sum(tag.startswith("A") for tag in before) <= 2 + (j + 1)
    assert all(dispatched.index(f"B{j}") < dispatched.index("A7") for j in range(5))
    a_181st = events.index(("dispatch", "A180"))
    a_9th = events.index(("dispatch", "A8"))
    for j in range(5):
        assert events.index(("done", f"B{j}")) < a_9th < a_181st


async def test_weights_3_to_1_give_a_3_to_1_dispatch_ratio(keyed):
    heavy = await sync_to_async(create_key)("heavy", weight=3)
    light = await sync_to_async(create_key)("light")
    relay = runtime.current().relay
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=1)
        calls = [await send(heavy.secret, f"H{i}") for i in range(60)]
        calls += [await send(light.secret, f"L{i}") for i in range(60)]
        await until(lambda: relay.queue_depth() == 119, timeout=20)
        events = await serve(worker, total=120, capacity=1)
    for call in calls:
        assert (await call.response())[0] == 200
    dispatched = [tag for kind, tag in events if kind == "dispatch"]
    contended = Counter(tag[0] for tag in dispatched[1:41])  # both keys backlogged
    ratio = contended["H"] / contended["L"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, contended


async def test_limits_answer_in_the_endpoints_envelope_and_are_shown_per_key(keyed):
    tight = await sync_to_async(create_key)(
        "tight", max_concurrent=1, allowed_models=["m"], tokens_per_month=10
    )
    rt = runtime.current()
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=4)
        first = await send(tight.secret, "t0")
        frame = await worker.expect(protocol.Request)
        busy = await send(tight.secret, "t1")
        status, headers, body = await busy.response()
        assert status == 429 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        anthropic = await HttpCall(
            "POST",
            "/v1/messages",
            chat("other"),
            headers=[(b"x-api-key", tight.secret.encode()), (b"anthropic-version", b"1")],
        ).send()
        status, document = await anthropic.json()
        assert status == 403
        assert document == {
            "type": "error",
            "error": {
                "type": "permission_error",
                "message": "This API key may not use model 'other'",
            },
        }
        _, stats = await admin_stats()
        (row,) = stats["keys"]
        assert (row["name"], row["in_flight"], row["queued"]) == ("tight", 1, 0)
        assert row["rejected_by"] == {"model_not_allowed": 1, "over_concurrency": 1}
        await worker.answer(frame.request_id, prompt_tokens=8, completion_tokens=4)
        assert (await first.response())[0] == 200
        spent = await send(tight.secret, "t2")
        status, headers, body = await spent.response()
        assert status == 429 and json.loads(body)["error"]["code"] == "insufficient_quota"
        assert int(headers["retry-after"]) >= 1
    _, stats = await admin_stats()
    (row,) = stats["keys"]
    assert (row["in_flight"], row["tokens_today"], row["tokens_month"]) == (0, 12, 12)
    assert row["requests"] == 1 and row["rejected"] == 3
    metrics = (await (await HttpCall("GET", "/metrics").send()).response())[2].decode()
    assert 'modelrelay_key_tokens{key="tight",period="month"} 12.0' in metrics
    assert 'modelrelay_key_rejections_total{key="tight",outcome="over_monthly_budget"} 1.0' in (
        metrics
    )
    assert rt.limiter.open == {}


async def test_an_expired_key_gets_401_everywhere_and_a_key_sees_only_its_models(keyed):
    key = await sync_to_async(create_key)("soon", allowed_models=["m"])
    async with FakeWorker() as worker:
        await worker.register(models=["m", "n"])
        models = HttpCall("GET", "/v1/models", headers=bearer(key.secret))
        _, listed = await (await models.send()).json()
        assert [m["id"] for m in listed["data"]] == ["m"]
        past = dt.datetime.now(tz=dt.UTC) - dt.timedelta(seconds=1)
        await sync_to_async(update_key)(key.key, expires_at=past)
        await runtime.current().sync()
        for call in (
            HttpCall("GET", "/v1/models", headers=bearer(key.secret)),
            HttpCall("POST", "/v1/chat/completions", chat(), headers=bearer(key.secret)),
        ):
            status, document = await (await call.send()).json()
            assert status == 401 and "expired at" in document["error"]["message"]


async def test_budgets_start_from_the_request_log_after_a_restart(keyed):
    from workers_app.models import RequestLog

    key = await sync_to_async(create_key)("restarted", tokens_per_day=100, tokens_per_month=500)
    now = dt.datetime.now(tz=dt.UTC)
    earlier_this_month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    rows = [  # what a previous server process wrote
        (now - dt.timedelta(seconds=5), 70, 40),  # today: 110, over the daily budget
        (now - dt.timedelta(days=40), 900, 900),  # another month: ignored
    ]
    if earlier_this_month.date() != now.date():
        rows.append((earlier_this_month, 100, 0))
    for created, prompt, completion in rows:
        await RequestLog.objects.acreate(
            api_key=key.key,
            endpoint="/v1/chat/completions",
            status=200,
            outcome="ok",
            prompt_tokens=prompt,
            completion_tokens=completion,
            created_at=created,
        )
    rt = runtime.current()
    await rt.ready()
    spend = await rt.limiter.spend([key.key.id])
    if spend.get(key.key.id, (0, 0))[0] != 110:
        pytest.skip("the UTC day changed during the test")
    assert spend == {key.key.id: (110, 110 + (100 if len(rows) == 3 else 0))}
    status, _, body = await (await send(key.secret, "late")).response()
    assert status == 429 and json.loads(body)["error"]["code"] == "insufficient_quota"
