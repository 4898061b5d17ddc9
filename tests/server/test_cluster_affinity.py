"""Cache-aware routing across server processes (SPEC §14, §11): whichever process a
turn arrives at, the conversation stays on its worker."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import pytest

from tests.cacheupstream import caching_upstreams
from tests.clusterkit import AUTH, cluster
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
