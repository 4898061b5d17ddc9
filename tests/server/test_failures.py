"""What happens when workers, clients or the transport misbehave (SPEC §6), through the
real ASGI application: refused sends, hostile frames and bodies, slow readers,
providers deleted under load, workers refusing work while they shut down."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from relay.core import snapshot
from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, app, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


def relay():
    return runtime.current().relay


def total_load() -> int:
    return sum(w.load for w in relay().registry.workers.values())


async def post(body: Any = None, **kwargs: Any) -> HttpCall:
    return await HttpCall(
        "POST", "/v1/chat/completions", chat() if body is None else body, **kwargs
    ).send()


async def sessions_closed(timeout: float = 5.0) -> None:
    """Wait until every worker-session audit row has its disconnect recorded."""
    from workers_app.models import WorkerSession

    async with asyncio.timeout(timeout):
        while await WorkerSession.objects.filter(disconnected_at=None).acount():
            await asyncio.sleep(0.01)


class RefusingSocket:
    """The application behind a socket library that refuses some outgoing frames."""

    def __init__(self, refuse: str) -> None:
        self.refuse = refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def guarded(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.send" and self.refuse in message.get("text", ""):
                raise ValueError("frame refused by the socket library")
            await send(message)

        await app()(scope, receive, guarded)


class SlowReader:
    """The application behind a client connection that takes body parts only while ``open``.

    Both servers make ``send`` wait while a client's connection is full; this stands in
    for that connection (the live tests run the real ones)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def gated(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("more_body"):
                await self.open.wait()
            await send(message)

        await app()(scope, receive, gated)


# -- the worker socket ------------------------------------------------------------


async def test_a_frame_the_socket_refuses_detaches_that_worker_at_once(provider, settings):
    from workers_app.models import WorkerSession

    settings.HEARTBEAT_INTERVAL_SECS = 600  # no help from the heartbeat
    async with FakeWorker(application=RefusingSocket('"type":"request"')) as refusing:
        ack = await refusing.register(name="refusing")
        call = await post()
        assert await refusing.wait_closed() == (1011, "could not send to the worker")
        assert ack.worker_id not in relay().registry.workers
        assert relay().queue_depth() == 1  # requeued: it never reached a worker
    async with FakeWorker(client=("192.0.2.11", 1)) as healthy:
        await healthy.register(name="healthy")
        request = await healthy.expect(protocol.Request)
        await healthy.answer(request.request_id, body="served")
        assert (await call.response())[2] == b"served"
    await sessions_closed()
    row = await WorkerSession.objects.aget(worker_id=ack.worker_id)
    assert row.disconnect_reason == "could not send to the worker"


@pytest.mark.parametrize(
    "frame",
    [
        '{"type":"pong","current_load":0,"x":' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"type":"pong","current_load":1' + "0" * 300 + "}",
        '{"type":"response_complete","request_id":"r","status_code":99999}',
        '{"type":"register","worker_name":"' + "n" * 5000 + '"}',
    ],
    ids=["nested", "huge-load", "huge-status", "long-name"],
)
async def test_hostile_frames_close_only_that_worker_with_a_protocol_error(provider, frame):
    async with FakeWorker() as good, FakeWorker(client=("192.0.2.66", 1)) as bad:
        await good.register(name="good")
        if '"register"' in frame:
            assert await bad.connect()
        else:
            await bad.register(name="bad")
        await bad.send(frame)
        code, _ = await bad.wait_closed()
        assert code == 1002
        assert [w.name for w in relay().registry.workers.values()] == ["good"]
        metrics = await HttpCall("GET", "/metrics").send()
        assert (await metrics.response())[0] == 200
        call = await post()
        request = await good.expect(protocol.Request)
        await good.answer(request.request_id)
        assert (await call.response())[0] == 200
    await sessions_closed()


async def test_a_worker_that_refuses_work_while_shutting_down_loses_no_request(provider):
    async with FakeWorker(client=("192.0.2.1", 1)) as leaving:
        await leaving.register(name="leaving", max_concurrent=2)
        call = await post()
        request = await leaving.expect(protocol.Request)
        await leaving.send(
            protocol.Error(
                request_id=request.request_id,
                code=protocol.WORKER_DRAINING,
                message="worker is shutting down",
            )
        )
        await until(lambda: relay().queue_depth() == 1)
        second = await post()
        await asyncio.sleep(0)
        assert relay().queue_depth() == 2  # no new work for a worker on its way out
        async with FakeWorker(client=("192.0.2.2", 2)) as staying:
            await staying.register(name="staying", max_concurrent=2)
            first_again = await staying.expect(protocol.Request)
            assert first_again.request_id == request.request_id  # back at the front
            await staying.answer(first_again.request_id, body="one")
            other = await staying.expect(protocol.Request)
            await staying.answer(other.request_id, body="two")
            assert (await call.response())[2] == b"one"
            assert (await second.response())[2] == b"two"
    assert relay().stats.requeues == 0  # the client's requeue budget was not spent


# -- the client side --------------------------------------------------------------


async def test_a_deeply_nested_body_is_a_400_in_the_envelope(provider):
    for body in (
        b'{"model":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"model":"m","x":' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
    ):
        status, document = await (await post(body)).json()
        assert status == 400
        assert document["error"]["message"] == "Request body is nested too deeply"


async def test_too_many_or_too_large_headers_get_431(provider):
    many = [(f"x-h{i}".encode(), b"v") for i in range(101)]
    large = [(b"x-big", b"a" * 17_000)]
    for headers in (many, large):
        call = await HttpCall("POST", "/v1/chat/completions", chat(), headers).send()
        status, document = await call.json()
        assert status == 431
        assert document["error"]["code"] == "request_header_fields_too_large"
        call = await HttpCall("POST", "/v1/messages", chat(), headers).send()
        status, document = await call.json()
        assert (status, document["type"]) == (431, "error")


async def test_a_body_whose_frame_would_not_fit_is_refused_with_413(provider, settings):
    settings.MAX_MESSAGE_BYTES = 64 * 1024
    settings.MAX_REQUEST_BYTES = 1024 * 1024
    await runtime.reset()
    async with FakeWorker() as worker:
        await worker.register()
        # 40,000 newlines between JSON tokens: 40 kB of body, 80 kB once escaped in a frame.
        body = b'{"model":"m"' + b"\n" * 40_000 + b"}"
        status, document = await (await post(body)).json()
        assert status == 413
        assert document["error"]["type"] == "invalid_request_error"
        call = await post()  # the worker never saw it and serves the next one
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id)
        assert (await call.response())[0] == 200


async def test_deleting_a_provider_fails_its_requests_in_flight_at_once(provider, settings):
    settings.QUEUE_TIMEOUT_SECS = 600  # a requeue would hang: it must not happen
    async with FakeWorker() as worker, FakeWorker(client=("192.0.2.5", 5)) as sibling:
        await worker.register(name="one")
        await sibling.register(name="two")
        calls = [await post(), await post()]
        await worker.expect(protocol.Request)
        await sibling.expect(protocol.Request)
        await provider.adelete()
        for call in calls:
            status, document = await call.json()
            assert status == 503
            assert document["error"]["message"] == "Service temporarily unavailable, please retry"
        assert (await worker.wait_closed())[0] == 1008
        assert (await sibling.wait_closed())[0] == 1008
    assert relay().stats.requeues == 0


# -- slow readers -----------------------------------------------------------------


async def stream_to(reader: SlowReader) -> HttpCall:
    return await post(chat(stream=True), application=reader)


async def test_a_slow_reader_pauses_its_stream_at_the_worker_and_loses_nothing(provider, settings):
    settings.STREAM_BUFFER_BYTES = 4096
    await runtime.reset()
    reader = SlowReader()
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=2, features=[protocol.FLOW_CONTROL])
        assert worker.ack is not None and worker.ack.features == [protocol.FLOW_CONTROL]
        call = await stream_to(reader)
        request = await worker.expect(protocol.Request)
        parts = [f"data: {i:04d}{'x' * 990}\n\n" for i in range(8)]
        for part in parts[:6]:
            await worker.chunk(request.request_id, part)
        assert await worker.expect(protocol.Pause) == protocol.Pause(request_id=request.request_id)
        # Another client on the same worker socket is not held up meanwhile.
        other = await post()
        other_request = await worker.expect(protocol.Request)
        await worker.answer(other_request.request_id, body="prompt")
        assert (await other.response())[2] == b"prompt"
        assert relay().buffered <= 2 * settings.STREAM_BUFFER_BYTES
        streams = snapshot.stats(relay())["streams"]
        assert (streams["paused"], streams["pauses"]) == (1, 1)
        assert streams["buffered_bytes"] == relay().buffered > settings.STREAM_BUFFER_BYTES
        metrics = (await (await HttpCall("GET", "/metrics").send()).response())[2].decode()
        assert "modelrelay_stream_pauses_total 1.0" in metrics
        reader.open.set()
        assert await worker.expect(protocol.Resume) == protocol.Resume(
            request_id=request.request_id
        )
        for part in parts[6:]:
            await worker.chunk(request.request_id, part)
        await worker.answer(request.request_id, body="data: [DONE]\n\n")
        await call.start()
        assert await call.read_rest() == "".join(parts).encode() + b"data: [DONE]\n\n"
    assert relay().buffered == 0


async def test_a_slow_reader_behind_an_old_worker_is_cut_off_with_a_cancel(provider, settings):
    settings.STREAM_BUFFER_BYTES = 4096
    await runtime.reset()
    reader = SlowReader()
    async with FakeWorker() as worker:
        await worker.register()  # no flow control announced
        call = await stream_to(reader)
        request = await worker.expect(protocol.Request)
        for i in range(6):
            await worker.chunk(request.request_id, f"data: {i}{'x' * 1000}\n\n")
        cancel = await worker.expect(protocol.Cancel)
        assert cancel == protocol.Cancel(request_id=request.request_id, reason="client_disconnect")
        assert total_load() == 0
        reader.open.set()
        await call.start()
        tail = (await call.read_rest()).rsplit(b"\n\n", 2)[-2]
        assert json.loads(tail.split(b"data: ", 1)[1])["error"]["code"] == "slow_client"
    assert relay().buffered == 0
    assert relay().stats.by_outcome["slow_client"] == 1


async def test_the_relay_bounds_what_it_holds_for_all_slow_readers_together(provider, settings):
    settings.STREAM_BUFFER_BYTES = 1 << 20
    settings.STREAM_BUFFER_TOTAL_BYTES = 8192
    await runtime.reset()
    readers = [SlowReader(), SlowReader()]
    async with FakeWorker() as worker:
        await worker.register(max_concurrent=2, features=[protocol.FLOW_CONTROL])
        calls = [await stream_to(r) for r in readers]
        requests = [await worker.expect(protocol.Request) for _ in calls]
        for i in range(5):
            await worker.chunk(requests[0].request_id, f"data: {i}{'x' * 1000}\n\n")
        for i in range(5):
            await worker.chunk(requests[1].request_id, f"data: {i}{'y' * 1000}\n\n")
        paused = await worker.expect(protocol.Pause)
        assert paused.request_id == requests[1].request_id  # the one that crossed the line
        for reader in readers:
            reader.open.set()
        assert (await worker.expect(protocol.Resume)).request_id == requests[1].request_id
        for request, call in zip(requests, calls, strict=True):
            await worker.answer(request.request_id, body="data: [DONE]\n\n")
            await call.start()
            assert (await call.read_rest()).endswith(b"data: [DONE]\n\n")


async def test_a_client_that_reads_nothing_is_cut_off_after_the_stall_timeout(provider, settings):
    settings.STALL_TIMEOUT_SECS = 0.2
    await runtime.reset()
    reader = SlowReader()  # never opens
    async with FakeWorker() as worker:
        await worker.register(features=[protocol.FLOW_CONTROL])
        call = await stream_to(reader)
        request = await worker.expect(protocol.Request)
        await worker.chunk(request.request_id, "data: 1\n\n")
        cancel = await worker.expect(protocol.Cancel, timeout=5)
        assert cancel == protocol.Cancel(request_id=request.request_id, reason="slow_client")
        await call.finished()  # the application let go of the connection
        assert total_load() == 0
    assert relay().stats.by_outcome["slow_client"] == 1
    assert relay().buffered == 0
