"""Cache-aware routing across server processes (SPEC §14, §11): whichever process a
turn arrives at, the conversation stays on its worker."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import pytest
import redis

from tests.cacheupstream import caching_upstreams
from tests.clusterkit import AUTH, cluster
from tests.conftest import REDIS_URL
from tests.test_e2e import poll, running_worker

pytestmark = [pytest.mark.live, pytest.mark.redis]

MODEL = "mock-model"


def conversation(n: int, replies: list[str]) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": "Shared rules. " * 8}]
    for t, reply in enumerate([*replies, None]):
        messages.append({"role": "user", "content": f"Turn {t} of conversation {n}."})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return {"model": MODEL, "messages": messages}


def test_two_processes_send_each_conversation_to_the_same_worker(relay_server_factory):
    with (
        caching_upstreams(2, model=MODEL) as pool,
        cluster(relay_server_factory, 2, AFFINITY_BLOCK_BYTES="64") as (a, b),
        running_worker(a, pool.upstreams[0].url, "--models", MODEL, "--max-concurrent", "8"),
        running_worker(b, pool.upstreams[1].url, "--models", MODEL, "--max-concurrent", "8"),
    ):

        def both_listed() -> bool:
            workers = httpx.get(a.url + "/admin/workers", headers=AUTH, timeout=5).json()
            return len(workers) == 2

        poll(both_listed, timeout=20, what="both workers, cluster-wide")
        replies: dict[int, list[str]] = defaultdict(list)
        where: dict[int, list[int]] = defaultdict(list)
        with httpx.Client(timeout=20) as client:
            for turn in range(4):
                for n in range(8):
                    server = (a, b)[(turn + n) % 2]  # turns alternate between processes
                    body = conversation(n, replies[n])
                    raw = json.dumps(body).encode()
                    response = client.post(
                        server.url + "/v1/chat/completions",
                        content=raw,
                        headers={"content-type": "application/json"},
                    )
                    assert response.status_code == 200, response.text
                    replies[n].append(response.json()["choices"][0]["message"]["content"])
                    where[n].append(next(s.index for s in pool.served if s.body == raw))
        assert all(len(set(w)) == 1 for w in where.values()), where
        assert {w[0] for w in where.values()} == {0, 1}  # conversations spread over both
        later = [s for s in pool.served if len(json.loads(s.body)["messages"]) > 2]
        assert len(later) == 8 * 3 and all(s.cached_tokens > 0 for s in later)


@pytest.mark.parametrize("shared", [False, True], ids=["per-key", "shared"])
def test_across_processes_another_keys_copies_follow_a_keys_worker_only_if_shared(
    relay_server_factory, shared: bool
):
    """Key A's conversations arrive at process a, whose own worker takes them (least
    load prefers it); key B sends copies of A's prompts and prompt_cache_keys to process
    b. Per key, b places them by least load (on its own worker); shared, the
    conversation map sends them to A's."""
    env = {"AFFINITY_BLOCK_BYTES": "64", "MODELRELAY_REQUIRE_API_KEYS": "true"}
    if shared:
        env["AFFINITY_SHARE_ACROSS_KEYS"] = "true"
    with (
        caching_upstreams(2, model=MODEL) as pool,
        cluster(relay_server_factory, 2, **env) as (a, b),
        running_worker(a, pool.upstreams[0].url, "--models", MODEL, "--max-concurrent", "8"),
        running_worker(b, pool.upstreams[1].url, "--models", MODEL, "--max-concurrent", "8"),
        httpx.Client(timeout=20) as client,
    ):
        keys = {}
        for name in ("A", "B"):
            made = client.post(a.url + "/admin/keys", json={"name": name}, headers=AUTH)
            assert made.status_code == 201, made.text
            keys[name] = made.json()["secret"]

        def send(server: Any, body: dict[str, Any], key: str) -> httpx.Response:
            return client.post(
                server.url + "/v1/chat/completions",
                content=json.dumps(body).encode(),
                headers={
                    "content-type": "application/json",
                    "authorization": f"Bearer {keys[key]}",
                },
            )

        def ready() -> bool:
            workers = httpx.get(a.url + "/admin/workers", headers=AUTH, timeout=5).json()
            probe = {"model": MODEL, "messages": [{"role": "user", "content": "ready?"}]}
            return len(workers) == 2 and send(b, probe, "B").status_code == 200

        poll(ready, timeout=20, what="both workers, and key B known at b")

        def backend(body: dict[str, Any]) -> int:
            raw = json.dumps(body).encode()
            return next(s.index for s in pool.served if s.body == raw)

        same = []
        for n in range(8):
            body = conversation(100 + n, ["A reply."])
            mine, theirs = body | {"user": "a"}, body | {"user": "b"}
            if n >= 4:  # the prompt_cache_key instead, on another conversation
                mine = conversation(200 + n, []) | {"prompt_cache_key": f"p{n}"}
                theirs = conversation(300 + n, []) | {"prompt_cache_key": f"p{n}"}
            assert send(a, mine, "A").status_code == 200
            assert send(b, theirs, "B").status_code == 200
            same.append(backend(theirs) == backend(mine))
        assert backend(conversation(100, ["A reply."]) | {"user": "a"}) == 0  # a's own worker
        if shared:
            assert same == [True] * 8
        else:  # least-load (b's own worker on a tie): never more than half, whatever the ties
            assert sum(same) <= 4, same
        # The conversation map: B's copies name conversations of their own (the probe
        # that found b ready is one more), or, shared, A's.
        with redis.Redis.from_url(REDIS_URL) as store:
            anchors = list(store.scan_iter(match=f"{a.env['REDIS_PREFIX']}:aff:*"))
        assert len(anchors) == (8 if shared else 16) + 1
