"""Resumable responses on a Redis watched by Sentinel (SPEC §18, §20): live processes,
a scripted worker streaming at the test's word, a master, a replica and three sentinels
of the test's own. A stream running across a ``SENTINEL FAILOVER`` is reattached through
the other process, byte for byte; one whose last chunk the new master lacks ends where
the new master holds it, with the error event, and a reattach past that point gets 410.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import redis

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


class Log:
    """A conversation's log as the current master holds it."""

    def __init__(self, sentinels: SentinelSet, prefix: str, conversation: str) -> None:
        self.sentinels = sentinels
        self.keys = [f"{prefix}:rs:-:{conversation}:{part}" for part in ("m", "s")]
        self.kept: list[tuple[str, bytes, int]] = []

    def node(self) -> redis.Redis:
        return redis.Redis(port=self.sentinels.master(), socket_timeout=2)

    async def holds(self, units: int) -> bool:
        def read() -> bool:
            with self.node() as node:
                return node.hget(self.keys[0], "total") == str(units).encode()

        return await asyncio.to_thread(read)

    def dump(self) -> None:
        """Keep the log as it is now (as a replica that falls behind would have it)."""
        with self.node() as node:
            self.kept = [(k, node.dump(k), node.pttl(k)) for k in self.keys]

    def restore(self) -> None:
        """Put back the kept log on the master (the one the failover promoted)."""
        with self.node() as node:
            for key, dumped, ttl in self.kept:
                node.restore(key, ttl, dumped, replace=True)


async def test_a_resumable_stream_is_reattached_through_another_process_after_a_failover(
    relay_server_factory, sentinels
):
    env = {**sentinels.env, **FAST}
    with cluster(relay_server_factory, 2, **env) as (a, b):
        prefix = a.env["REDIS_PREFIX"]
        async with httpx.AsyncClient(timeout=30) as client, ScriptedWorker(b, ["m"]) as worker:
            await until(lambda: all_ok(client, [a, b]), RECOVERY_SECS, "the cluster to join")
            await knows(a, "m")
            # Through A, to B's worker: "across" runs across the failover; the new master
            # will lack the last part "cut" had before it.
            across = await begin(client, a, worker, "across")
            cut = await begin(client, a, worker, "cut")
            log = Log(sentinels, prefix, "cut")
            head = len(PARTS[0])
            await until(lambda: log.holds(head), RECOVERY_SECS, "the first part in Redis")
            log.dump()
            await say(worker, chunk(cut.request_id, PARTS[1]))
            lost_at = head + len(PARTS[1])
            await until(lambda: log.holds(lost_at), RECOVERY_SECS, "the part the replica lacks")

            old = sentinels.master()
            new = await asyncio.to_thread(sentinels.failover)
            await asyncio.to_thread(log.restore)  # the new master lacks PARTS[1] of "cut"

            for part in PARTS[1:]:
                await say(worker, chunk(across.request_id, part))
            await say(worker, answer(across.request_id, "data: [DONE]\n\n"))
            await say(worker, chunk(cut.request_id, PARTS[2]))
            await say(worker, answer(cut.request_id, "data: [DONE]\n\n"))

            # Through A, which never had the worker: the rest of "across", byte for byte.
            rest = await client.get(a.url + "/v1/stream/across", params={"from": head})
            assert rest.status_code == 200, rest.text
            assert rest.content == ("".join(PARTS[1:]) + "data: [DONE]\n\n").encode()
            whole = await client.get(b.url + "/v1/stream/across", params={"from": 0})
            assert whole.content == ("".join(PARTS) + "data: [DONE]\n\n").encode()

            # "cut" ends where the new master holds it, with the error a live client
            # would have seen; past that point (the lost part) a reattach gets 410.
            ended = await client.get(a.url + "/v1/stream/cut", params={"from": head})
            assert ended.status_code == 200, ended.text
            assert ended.content.startswith(b'data: {"error":')
            assert b"stream_lost" in ended.content
            gone = await client.get(a.url + "/v1/stream/cut", params={"from": lost_at})
            assert gone.status_code == 410, gone.text
            assert gone.json()["error"]["code"] == "stream_offset_lost"
            found = await client.post(
                b.url + "/v1/streams/lookup", json={"conversation_ids": ["cut"]}
            )
            (item,) = found.json()
            assert item["is_done"] and item["total_bytes"] == head + len(ended.content)

            # Every connection resumable responses use is on the new master, none on the
            # old one.
            assert {"streams", "streamlog"} <= names_on(new)
            assert not STREAM_ROLES & names_on(old), names_on(old)
            assert worker.requests.empty(), "a request reached the worker twice"
