"""Resumable responses through the real ASGI app in-process (SPEC §18): the longest loop
stall a replay of the largest log, or the pump of a large background stream, causes."""

from __future__ import annotations

import asyncio
import json

import pytest

from relay.core.streamlog import Entry
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, make_provider
from tests.stall import STALL_BUDGET_MS, LoopStalls

pytestmark = pytest.mark.django_db(transaction=True)


async def ended(response_id: str) -> dict:
    """The response once it ended (polled, bounded)."""
    async with asyncio.timeout(30):
        while True:
            got = HttpCall("GET", f"/v1/responses/{response_id}")
            await got.send()
            status, document = await got.json(timeout=30)
            assert status == 200
            if document["status"] not in ("queued", "in_progress"):
                return document
            await asyncio.sleep(0.01)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


async def test_replaying_the_largest_log_never_holds_the_loop(provider):
    rt = runtime.current()
    store = rt.streams.store
    bound = store.bounds.max_bytes
    entry = Entry(owner=None, id="big", kind="replay", flavor="openai", created=1.0, gen="g")
    await store.open(entry, replace=True)
    writer = store.writer(entry)
    assert await writer.claim(60) == "ok"
    chunk = b"data: " + b"x" * 4090 + b"\n\n"
    for _ in range(bound // len(chunk) + 16):  # past the bound: the newest 8 MiB are kept
        await writer.append([chunk])
    await writer.end("ok", [])
    kept = await store.get(None, "big")
    assert kept is not None and kept.first > 0
    call = HttpCall("GET", f"/v1/stream/big?from={kept.first}")
    async with LoopStalls() as stalls:
        await call.send()
        status, _, body = await call.response(timeout=30)
    assert status == 200 and len(body) == kept.total - kept.first
    assert stalls.longest_ms < STALL_BUDGET_MS


async def test_the_pump_of_a_large_background_stream_never_holds_the_loop(provider):
    async with FakeWorker() as worker:
        # (As worker.py does: a burst is paused at its source, not cut.)
        await worker.register(["m"], features=[protocol.FLOW_CONTROL])
        call = HttpCall("POST", "/v1/responses", {"model": "m", "input": "hi", "background": True})
        await call.send()
        status, queued = await call.json()
        assert status == 200 and queued["status"] == "queued"
        request = await worker.expect(protocol.Request)
        assert json.loads(request.body)["stream"] is True
        # A long answer (over 1 MiB, one response.completed event): rewritten in steps.
        text = "€" * (400 * 1024)
        item = {"type": "message", "id": "m1", "content": [{"type": "output_text", "text": text}]}
        done = {"type": "response.completed", "response": {"status": "completed", "output": [item]}}
        stream = "event: response.completed\ndata: " + json.dumps(done, ensure_ascii=False) + "\n\n"
        store = runtime.current().streams.store
        async with LoopStalls() as stalls:
            for at in range(0, len(stream), 65536):
                await worker.chunk(request.request_id, stream[at : at + 65536])
                await asyncio.sleep(0)  # frames come from the network, not all at once
            await worker.answer(request.request_id, body="")
            async with asyncio.timeout(30):
                while not (await store.get(None, queued["id"])).done:  # type: ignore[union-attr]
                    await asyncio.sleep(0.005)
        final = await ended(queued["id"])
        assert final["status"] == "completed" and final["id"] == queued["id"]
        assert final["output"][0]["content"][0]["text"] == text
        assert stalls.longest_ms < STALL_BUDGET_MS
