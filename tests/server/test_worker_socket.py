"""The worker WebSocket endpoint through the real ASGI application (SPEC §4)."""

from __future__ import annotations

import pytest

from relay.server import runtime
from relay.wire import protocol
from tests.asgikit import FakeWorker, HttpCall, chat, make_provider, until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


def live_worker(worker_id: str):
    return runtime.current().relay.registry.workers.get(worker_id)


# -- authentication ------------------------------------------------------------


async def test_a_worker_registers_and_is_acked_with_sanitized_models(provider):
    async with FakeWorker() as worker:
        ack = await worker.register([" llama3-8b", "llama3-8b", "", "qwen"], max_concurrent=4)
        assert ack.models == ["llama3-8b", "qwen"]
        assert ack.protocol_version == "1"
        assert ack.worker_id.startswith("w-")
        assert ack.warnings == [
            "trimmed whitespace from 1 model name(s)",
            "dropped 1 empty model name(s)",
            "dropped 1 duplicate model name(s)",
        ]
        registered = live_worker(ack.worker_id)
        assert registered.max_concurrent == 4 and registered.peer == "192.0.2.10"


async def test_the_secret_may_come_in_the_query_string(provider):
    async with FakeWorker(via_query=True) as worker:
        ack = await worker.register()
        assert ack.models == ["m"]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"secret": "mrw_wrong"}, "invalid worker secret"),
        ({"secret": None}, "invalid worker secret"),
        ({"provider": "nope"}, "unknown provider 'nope'"),
    ],
)
async def test_bad_credentials_are_closed_with_1008_and_a_reason(provider, kwargs, reason):
    async with FakeWorker(**kwargs) as worker:
        assert await worker.connect()
        assert await worker.wait_closed() == (1008, reason)


async def test_a_disabled_provider_is_refused(fresh_runtime):
    await make_provider(enabled=False)
    async with FakeWorker() as worker:
        assert await worker.connect()
        assert await worker.wait_closed() == (1008, "provider 'local' is disabled")


async def test_repeated_failures_from_one_address_are_throttled(provider, settings):
    settings.AUTH_MAX_FAILURES = 2
    for _ in range(2):
        async with FakeWorker(secret="bad") as worker:
            await worker.connect()
            assert (await worker.wait_closed())[1] == "invalid worker secret"
    async with FakeWorker() as worker:  # right secret, same address: still blocked
        await worker.connect()
        code, reason = await worker.wait_closed()
        assert code == 1008 and reason.startswith("too many failed authentication attempts")
    async with FakeWorker(client=("192.0.2.99", 1)) as other:  # other addresses carry on
        assert (await other.register()).models == ["m"]


async def test_trusted_proxy_forwarded_address_is_used_for_throttling(provider, settings):
    settings.TRUSTED_PROXIES = ["127.0.0.1/32"]
    settings.AUTH_MAX_FAILURES = 1
    forwarded = [(b"x-forwarded-for", b"203.0.113.5")]
    async with FakeWorker(secret="bad", client=("127.0.0.1", 1), headers=forwarded) as worker:
        await worker.connect()
        await worker.wait_closed()
    assert runtime.current().throttle.blocked("203.0.113.5") > 0
    assert runtime.current().throttle.blocked("127.0.0.1") == 0


async def test_changes_to_providers_apply_to_new_connections_at_once(provider):
    from workers_app.models import Provider

    fresh = await make_provider("team-b", secret="mrw_team-b")
    async with FakeWorker(provider="team-b", secret="mrw_team-b") as worker:
        assert (await worker.register(["x"])).models == ["x"]
    new_secret = fresh.rotate_secret()
    await fresh.asave()
    async with FakeWorker(provider="team-b", secret="mrw_team-b") as worker:
        await worker.connect()
        assert await worker.wait_closed() == (1008, "invalid worker secret")
    async with FakeWorker(provider="team-b", secret=new_secret) as worker:
        assert (await worker.register(["x"])).models == ["x"]
    await Provider.objects.filter(name="team-b").aupdate(enabled=False)
    async with FakeWorker(provider="team-b", secret=new_secret) as worker:
        await worker.connect()
        assert (await worker.wait_closed())[0] == 1008


# -- registration and protocol errors -----------------------------------------


async def test_the_first_frame_must_be_register(provider):
    async with FakeWorker() as worker:
        await worker.connect()
        await worker.send(protocol.Pong(current_load=0))
        assert await worker.wait_closed() == (1002, "expected register, got Pong")


async def test_a_silent_worker_is_closed_after_the_register_timeout(provider, settings):
    settings.REGISTER_TIMEOUT_SECS = 0.05
    async with FakeWorker() as worker:
        await worker.connect()
        assert await worker.wait_closed() == (1002, "no register message within 0.05s")


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("{not json", "malformed JSON"),
        ('{"type":"register","worker_name":"x"}', "duplicate register"),
        ('{"type":"pong","current_load":"high"}', "Expected `int`"),
        ('{"type":"self_destruct"}', "Invalid value 'self_destruct'"),
        ('["response_chunk"]', "Expected `object`"),
    ],
)
async def test_malformed_frames_close_only_that_worker(provider, frame, reason):
    async with (
        FakeWorker(client=("192.0.2.1", 1)) as good,
        FakeWorker(client=("192.0.2.2", 2)) as bad,
    ):
        await good.register(name="good")
        await bad.register(name="bad")
        await bad.send(frame)
        code, text = await bad.wait_closed()
        assert code == 1002 and reason in text
        call = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        request = await good.expect(protocol.Request)
        await good.answer(request.request_id)
        assert (await call.response())[0] == 200


async def test_binary_frames_are_a_protocol_error(provider):
    async with FakeWorker() as worker:
        await worker.register()
        await worker.send_bytes(b"\x00\x01")
        assert await worker.wait_closed() == (1002, "binary frames are not supported")


async def test_protocol_versions(provider, settings):
    async with FakeWorker() as worker:
        ack = await worker.register(protocol_version="2026-04-bridge-v1")
        assert ack.models == ["m"]
    async with FakeWorker() as worker:
        await worker.connect()
        await worker.send({"type": "register", "worker_name": "legacy", "models": ["m"]})
        assert (await worker.expect(protocol.RegisterAck)).models == ["m"]  # tolerated
    async with FakeWorker() as worker:
        await worker.connect()
        await worker.send({"type": "register", "worker_name": "x", "protocol_version": "99"})
        assert await worker.wait_closed() == (1002, "unsupported protocol version '99'")
    settings.REQUIRE_PROTOCOL_VERSION = True
    await runtime.reset()
    async with FakeWorker() as worker:
        await worker.connect()
        await worker.send({"type": "register", "worker_name": "legacy", "models": ["m"]})
        assert await worker.wait_closed() == (1002, "protocol_version is required")


async def test_huge_model_lists_and_names_are_capped_with_warnings(provider):
    models = [f"model-{i}" for i in range(300)] + ["x" * 5000]
    async with FakeWorker() as worker:
        ack = await worker.register(models)
        assert len(ack.models) == 256 and ack.models[0] == "model-0"
        assert "accepted only the first 256 models; dropped 44" in ack.warnings
        assert "dropped 1 model name(s) longer than 256 characters" in ack.warnings


async def test_per_provider_model_cap(fresh_runtime):
    await make_provider(max_models_per_worker=2)
    async with FakeWorker() as worker:
        ack = await worker.register(["a", "b", "c"])
        assert ack.models == ["a", "b"]


# -- heartbeat, load, models --------------------------------------------------


async def test_the_server_pings_and_closes_a_worker_that_stops_ponging(provider, settings):
    settings.HEARTBEAT_INTERVAL_SECS = 0.02
    settings.HEARTBEAT_TIMEOUT_SECS = 0.1
    async with FakeWorker() as worker:
        ack = await worker.register()
        ping = await worker.recv()
        assert isinstance(ping, protocol.Ping) and ping.timestamp_unix_ms
        assert await worker.wait_closed() == (1001, "worker heartbeat timed out")
        assert live_worker(ack.worker_id) is None


async def test_pongs_keep_a_worker_and_update_its_load(provider, settings):
    settings.HEARTBEAT_INTERVAL_SECS = 0.05
    settings.HEARTBEAT_TIMEOUT_SECS = 0.4  # loose enough for a loaded machine
    async with FakeWorker() as worker:
        ack = await worker.register(max_concurrent=4)
        for load in (1, 2) + (3,) * 14:  # 16 pings: twice the timeout, ponging each one
            await worker.expect(protocol.Ping)
            await worker.send(protocol.Pong(current_load=load))
        await until(lambda: live_worker(ack.worker_id).reported_load == 3)
        assert live_worker(ack.worker_id).load == 3  # nothing in flight: all its own
        assert worker.closed is None


async def test_models_update_replaces_the_routable_models(provider):
    async with FakeWorker() as worker:
        await worker.register(["a"])
        await worker.send(protocol.ModelsUpdate(models=["b", " b", "c"], current_load=0))
        await until(lambda: "c" in runtime.current().relay.routable_models())
        call = await HttpCall("GET", "/v1/models").send()
        status, body = await call.json()
        assert status == 200
        assert [m["id"] for m in body["data"]] == ["b", "c"]


async def test_models_refresh_and_graceful_shutdown_reach_the_worker(provider):
    async with FakeWorker() as worker:
        ack = await worker.register()
        relay = runtime.current().relay
        assert relay.refresh_models(ack.worker_id, reason="operator")
        assert await worker.expect(protocol.ModelsRefresh) == protocol.ModelsRefresh(
            reason="operator"
        )
        assert relay.drain_worker(ack.worker_id, timeout=10, reason="maintenance")
        shutdown = await worker.expect(protocol.GracefulShutdown)
        assert shutdown == protocol.GracefulShutdown(reason="maintenance", drain_timeout_secs=10)
        assert await worker.wait_closed() == (1000, "worker drained")


# -- audit ----------------------------------------------------------------------


async def test_sessions_are_audited_on_connect_and_disconnect(provider):
    from workers_app.models import WorkerSession

    async with FakeWorker() as worker:
        ack = await worker.register(["a", "b"], max_concurrent=3, name="box-7")
        call = await HttpCall("POST", "/v1/chat/completions", chat("a")).send()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id)
        await call.response()
    session = await WorkerSession.objects.aget(worker_id=ack.worker_id)
    assert session.worker_name == "box-7"
    assert session.provider_name == "local" and session.provider_id == provider.id
    assert session.model_names == ["a", "b"]
    assert session.max_concurrent == 3
    assert session.peer_address == "192.0.2.10"
    assert session.protocol_version == "1"
    assert session.disconnected_at is not None
    assert session.disconnect_reason == "connection closed by worker (code 1000)"
    assert session.requests_served == 1


async def test_unknown_websocket_paths_are_refused(provider):
    from channels.testing import WebsocketCommunicator

    from tests.asgikit import app

    comm = WebsocketCommunicator(app(), "/somewhere/else")
    connected, _ = await comm.connect()
    assert connected is False
    await comm.disconnect()


async def test_a_secret_rotated_between_handshake_and_register_keeps_the_worker_out(provider):
    from workers_app.models import Provider

    async with FakeWorker() as worker:
        assert await worker.connect()  # authenticated with the old secret...
        fresh = await Provider.objects.aget(name="local")
        fresh.rotate_secret()  # ...which a rotation replaces before it registers
        await fresh.asave()
        await worker.send(protocol.Register(worker_name="late", models=["m"]))
        assert await worker.wait_closed() == (1008, "provider secret rotated")
        assert runtime.current().relay.registry.workers == {}
