"""What a worker can and cannot do to the clients it serves, as docs/DEPLOY.md's
"Security model" promises: it never receives relay credentials, and its answers cannot
switch protocols, set cookies or widen CORS. In process, through the real ASGI app.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from keys.services import create_key
from relay.wire import protocol
from tests.asgikit import SECRET, FakeWorker, HttpCall, chat, make_provider

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def provider(fresh_runtime):
    return await make_provider()


async def test_relay_api_keys_and_worker_secrets_never_reach_a_worker(provider, settings):
    from relay.server import runtime

    settings.MODELRELAY_REQUIRE_API_KEYS = True
    key = (await sync_to_async(create_key)("client")).secret
    await runtime.reset()  # a runtime that requires keys, with this one loaded
    await runtime.current().sync()
    async with FakeWorker() as worker:
        await worker.register(["m"])
        for path, credential, body in (
            ("/v1/chat/completions", (b"authorization", f"Bearer {key}".encode()), chat()),
            ("/v1/messages", (b"x-api-key", key.encode()), {**chat(), "max_tokens": 5}),
        ):
            headers = [credential, (b"x-worker-secret", SECRET.encode())]
            call = await HttpCall("POST", path, body, headers=headers).send()
            request = await worker.expect(protocol.Request)
            assert key not in str(request.headers) and SECRET not in str(request.headers)
            assert set(request.headers) <= {"content-type", "anthropic-version"}
            await worker.answer(request.request_id)
            assert (await call.response())[0] == 200


@pytest.mark.parametrize(
    "status",
    [
        0,
        600,
        999,
        100,
        101,
        199,
    ],
)
async def test_a_worker_answering_outside_the_final_statuses_gets_the_client_a_502(
    provider, status
):
    async with FakeWorker() as worker:
        await worker.register(["m"])
        call = await HttpCall("POST", "/v1/chat/completions", chat()).send()
        request = await worker.expect(protocol.Request)
        await worker.answer(request.request_id, status=status, headers={"upgrade": "tunnel"})
        code, _, _ = await call.response()
        assert code == 502
