"""Resumable responses on a Redis watched by Sentinel (SPEC §18, §20): live processes,
a scripted worker streaming at the test's word, a master, a replica and three sentinels
of the test's own. A stream running across a ``SENTINEL FAILOVER`` is reattached through
the other process, byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from relay.wire import protocol
from tests.clusterkit import CHAT, answer, chunk, cluster, knows, until
from tests.live import LiveServer
from tests.scriptedworker import ScriptedWorker
from tests.sentinelkit import SentinelSet, names_on, sentinel_set
from tests.server.test_cluster_sentinel import FAST, RECOVERY_SECS, all_ok

pytestmark = [pytest.mark.live, pytest.mark.redis]

#: The roles of the connections resumable responses use (``modelrelay:<id>:<role>``).
STREAM_ROLES = {"streams", "streamlog", "follow"}
PARTS = [f'data: {{"n":{n}}}\n\n' for n in range(4)]


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    with sentinel_set(tmp_path_factory.mktemp("sentinel-resume")) as found:
        yield found


async def begin(
    client: httpx.AsyncClient, server: LiveServer, worker: ScriptedWorker, conversation: str
) -> protocol.Request:
    """A chat stream with ``X-Conversation-Id`` through ``server``: its first part is
    read, then its client leaves (the stream runs on)."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    asked = client.build_request(
        "POST", server.url + CHAT, json=body, headers={"x-conversation-id": conversation}
    )
    sending = asyncio.ensure_future(client.send(asked, stream=True))
    request = await worker.next()
    await say(worker, chunk(request.request_id, PARTS[0]))
    response = await sending
    assert response.status_code == 200
    got = b""
    async for piece in response.aiter_raw():
        got += piece
        if len(got) >= len(PARTS[0]):
            break
    await response.aclose()
    assert got == PARTS[0].encode()
    return request


async def say(worker: ScriptedWorker, frame: str) -> None:
    assert worker._ws is not None
    await worker._ws.send(frame)


async def test_a_resumable_stream_is_reattached_through_another_process_after_a_failover(
    relay_server_factory, sentinels
):
    env = {**sentinels.env, **FAST}
    with cluster(relay_server_factory, 2, **env) as (a, b):
        async with httpx.AsyncClient(timeout=30) as client, ScriptedWorker(b, ["m"]) as worker:
            await until(lambda: all_ok(client, [a, b]), RECOVERY_SECS, "the cluster to join")
            await knows(a, "m")
            # Through A, to B's worker: "across" runs across the failover.
            across = await begin(client, a, worker, "across")
            head = len(PARTS[0])
            old = sentinels.master()
            new = await asyncio.to_thread(sentinels.failover)
            for part in PARTS[1:]:
                await say(worker, chunk(across.request_id, part))
            await say(worker, answer(across.request_id, "data: [DONE]\n\n"))

            # Through A, which never had the worker: the rest of "across", byte for byte.
            rest = await client.get(a.url + "/v1/stream/across", params={"from": head})
            assert rest.status_code == 200, rest.text
            assert rest.content == ("".join(PARTS[1:]) + "data: [DONE]\n\n").encode()
            whole = await client.get(b.url + "/v1/stream/across", params={"from": 0})
            assert whole.content == ("".join(PARTS) + "data: [DONE]\n\n").encode()

            # Every connection resumable responses use is on the new master, none on the
            # old one.
            assert {"streams", "streamlog"} <= names_on(new)
            assert not STREAM_ROLES & names_on(old), names_on(old)
            assert worker.requests.empty(), "a request reached the worker twice"
