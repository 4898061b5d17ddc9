"""A real daphne (``manage.py serve``) driven by raw WebSocket workers and HTTP clients."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from relay.wire import protocol
from tests.rawworker import closed, connect, expect, register

pytestmark = pytest.mark.live


async def test_a_raw_websocket_worker_registers_and_is_rejected_with_reasons(relay_server_factory):
    with relay_server_factory(AUTH_MAX_FAILURES="2") as server:
        async with await connect(server) as ws:
            ack = await register(ws, models=["a", "a", " b"])
            assert ack.models == ["a", "b"]
            assert ack.warnings
        async with await connect(server, secret="wrong") as ws:
            assert await closed(ws) == (1008, "invalid worker secret")
        async with await connect(server, secret="wrong") as ws:
            await closed(ws)
        async with await connect(server) as ws:  # right secret, but this address is blocked
            code, reason = await closed(ws)
            assert code == 1008 and "too many failed authentication attempts" in reason


async def test_workers_are_pinged_and_closed_for_silence(relay_server_factory):
    with relay_server_factory(
        HEARTBEAT_INTERVAL_SECS="0.05", HEARTBEAT_TIMEOUT_SECS="0.3", REGISTER_TIMEOUT_SECS="0.2"
    ) as server:
        async with await connect(server) as ws:
            await register(ws)
            ping = protocol.decode_server_message(await asyncio.wait_for(ws.recv(), 5))
            assert isinstance(ping, protocol.Ping)
            assert await closed(ws) == (1001, "worker heartbeat timed out")
        async with await connect(server) as ws:  # connects and says nothing
            assert await closed(ws) == (1002, "no register message within 0.2s")
        server.wait_for_log("worker heartbeat timed out")


async def test_oversized_frames_close_only_that_worker(relay_server_factory):
    with relay_server_factory(MAX_MESSAGE_BYTES="4096") as server:
        async with await connect(server) as good, await connect(server) as bad:
            await register(good)
            await register(bad)
            await bad.send(json.dumps({"type": "pong", "pad": "x" * 10_000}))
            code, _ = await closed(bad)
            assert code == 1009
            async with httpx.AsyncClient(base_url=server.url) as client:
                call = asyncio.ensure_future(
                    client.post("/v1/chat/completions", json={"model": "m"})
                )
                request = await expect(good, protocol.Request)
                await good.send(
                    protocol.encode(
                        protocol.ResponseComplete(
                            request_id=request.request_id, status_code=200, body='{"ok":1}'
                        )
                    )
                )
                assert (await call).json() == {"ok": 1}


async def test_invalid_utf8_in_a_text_frame_closes_only_that_worker(relay_server):
    async with await connect(relay_server) as good, await connect(relay_server) as bad:
        await register(good)
        await register(bad)
        await bad.send(b'{"type":"pong","current_load":0,"x":"\xff"}', text=True)
        code, _ = await closed(bad)
        assert code == 1007
        await good.send(protocol.encode(protocol.Pong(current_load=0)))
        async with httpx.AsyncClient(base_url=relay_server.url) as client:
            assert (await client.get("/health")).json()["workers_connected"] == 1


async def test_streaming_is_flushed_chunk_by_chunk_and_disconnect_cancels(relay_server):
    async with await connect(relay_server) as ws:
        await register(ws)
        async with httpx.AsyncClient(base_url=relay_server.url, timeout=10) as client:
            body = {"model": "m", "stream": True}
            stream = client.stream("POST", "/v1/chat/completions", json=body)
            # Response headers wait for the first chunk (an upstream error before it
            # must still be able to set the status), so open the stream concurrently.
            opening = asyncio.ensure_future(stream.__aenter__())
            request = await expect(ws, protocol.Request)
            assert request.is_streaming
            for n in range(3):
                # Each chunk is produced only after the client saw the previous one:
                # nothing can be sitting in a buffer along the way.
                text = f'data: {{"n":{n}}}\n\n'
                chunk = protocol.ResponseChunk(request_id=request.request_id, chunk=text)
                await ws.send(protocol.encode(chunk))
                if n == 0:
                    response = await opening
                    assert response.headers["content-type"].startswith("text/event-stream")
                    assert response.headers["x-accel-buffering"] == "no"
                    chunks = response.aiter_raw()
                assert await asyncio.wait_for(chunks.__anext__(), 5) == text.encode()
            await stream.__aexit__(None, None, None)  # hang up mid-stream
            cancel = await expect(ws, protocol.Cancel)
            assert cancel == protocol.Cancel(
                request_id=request.request_id, reason="client_disconnect"
            )
            health = (await client.get("/health")).json()
            assert health["workers_connected"] == 1


async def test_a_burst_of_frames_reaches_the_client_whole_and_in_order(relay_server):
    """Frames sent back to back (one read holds many), other frames among them:
    nothing is lost or reordered on the way to the client."""
    async with await connect(relay_server) as ws:
        await register(ws)
        async with httpx.AsyncClient(base_url=relay_server.url, timeout=10) as client:
            body = {"model": "m", "stream": True}
            reply = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            request = await expect(ws, protocol.Request)
            sent = []
            for n in range(300):
                text = f'data: {{"n":{n}}}\n\n'
                sent.append(text)
                await ws.send(protocol.encode(protocol.ResponseChunk(request.request_id, text)))
                if n % 100 == 50:  # other frames in between
                    await ws.send(protocol.encode(protocol.Pong(current_load=1)))
            done = protocol.ResponseComplete(request_id=request.request_id, status_code=200)
            await ws.send(protocol.encode(done))
            response = await reply
            assert response.status_code == 200
            assert response.text == "".join(sent)
            health = (await client.get("/health")).json()
            assert health["workers_connected"] == 1


async def test_sigterm_finishes_in_flight_work_then_closes_workers_1012(relay_server):
    async with await connect(relay_server) as ws:
        await register(ws)
        async with httpx.AsyncClient(base_url=relay_server.url, timeout=10) as client:
            call = asyncio.ensure_future(client.post("/v1/chat/completions", json={"model": "m"}))
            request = await expect(ws, protocol.Request)
            relay_server.signal(signal.SIGTERM)
            relay_server.wait_for_log("shutting down")
            refused = await client.post("/v1/chat/completions", json={"model": "m"})
            assert refused.status_code == 503
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(
                        request_id=request.request_id, status_code=200, body='{"done":1}'
                    )
                )
            )
            assert (await call).json() == {"done": 1}
        assert await closed(ws) == (1012, "server restarting")
    assert relay_server.process is not None
    assert relay_server.process.wait(10) == 0
