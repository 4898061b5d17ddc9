"""Cache-aware routing end to end (SPEC §14): a live server, two real ``worker.py`` and
two fake backends that each keep a prompt cache and report what they reused."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cacheupstream import Served, UpstreamPool, caching_upstreams
from tests.live import LiveServer, live_server
from tests.test_e2e import WorkerProcess, poll, running_worker, workers_connected

pytestmark = pytest.mark.live

MODEL = "mock-model"
CHAT = "/v1/chat/completions"
ADMIN = "affinity-admin-token"
SESSION_HEADER = "X-Conversation"


class Rig:
    def __init__(self, server: LiveServer, pool: UpstreamPool, workers: list[WorkerProcess]):
        self.server = server
        self.pool = pool
        self.workers = workers
        self.client = httpx.Client(base_url=server.url, timeout=20)
        #: Two API keys (keys are required): requests are key A's unless said otherwise.
        self.keys = {name: self._new_key(name) for name in ("A", "B")}

    def _new_key(self, name: str) -> str:
        made = self.client.post(
            "/admin/keys", json={"name": name}, headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert made.status_code == 201, made.text
        return made.json()["secret"]

    def chat(
        self, body: dict[str, Any], headers: dict[str, str] | None = None, key: str = "A"
    ) -> str:
        """Send ``body`` (as these exact bytes) with API key ``key``; returns the reply."""
        raw = json.dumps(body).encode()
        response = self.client.post(
            CHAT,
            content=raw,
            headers={
                "content-type": "application/json",
                "authorization": f"Bearer {self.keys[key]}",
                **(headers or {}),
            },
        )
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def served(self, body: dict[str, Any]) -> Served:
        """The backend's record of the request whose body was ``body``."""
        raw = json.dumps(body).encode()
        found = [s for s in self.pool.served if s.body == raw]
        assert len(found) == 1, "the body did not reach one backend unchanged"
        return found[0]

    def upstream_of(self, raw: bytes) -> int:
        """Which backend served the request whose body was ``raw``."""
        return self.served(json.loads(raw)).index

    def stats(self) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {ADMIN}"}
        return self.client.get("/admin/stats", headers=headers).json()["routing"]


@contextmanager
def running_rig(data_dir: Path, **env: str) -> Iterator[Rig]:
    """A server requiring API keys, and two workers, each with its caching backend."""
    with ExitStack() as stack:
        pool = stack.enter_context(caching_upstreams(2, model=MODEL))
        server = stack.enter_context(
            live_server(
                data_dir,
                MODELRELAY_ADMIN_TOKEN=ADMIN,
                MODELRELAY_REQUIRE_API_KEYS="true",
                AFFINITY_BLOCK_BYTES="64",
                AFFINITY_SESSION_HEADER=SESSION_HEADER,
                **env,
            )
        )
        flags = ["--models", MODEL, "--max-concurrent", "8"]
        workers = [
            stack.enter_context(running_worker(server, up.url, *flags, "--worker-name", f"box-{i}"))
            for i, up in enumerate(pool.upstreams)
        ]
        poll(lambda: workers_connected(server) == 2, what="two workers")
        rig = Rig(server, pool, workers)
        yield rig
        rig.client.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """One server and two workers for the whole module (each test its own
    conversations; the test that stops a worker comes last)."""
    with running_rig(tmp_path_factory.mktemp("affinity") / "server") as running:
        yield running


def conversation(n: int, turns: int, replies: list[str]) -> dict[str, Any]:
    messages = [{"role": "system", "content": f"You are assistant number {n}. " * 4}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} of conversation {n}. " * 3})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": replies[t]})
    return {"model": MODEL, "messages": messages}


def test_turns_follow_their_worker_and_backends_confirm_the_hits(rig: Rig):
    before = len(rig.pool.served)
    replies: dict[int, list[str]] = {n: [] for n in range(4)}
    homes: dict[int, list[int]] = {n: [] for n in range(4)}
    for turn in range(1, 5):
        for n in range(4):
            body = conversation(n, turn, replies[n])
            replies[n].append(rig.chat(body))
            homes[n].append(rig.upstream_of(json.dumps(body).encode()))
    assert all(len(set(h)) == 1 for h in homes.values()), homes
    assert {h[0] for h in homes.values()} == {0, 1}  # new conversations spread
    mine = rig.pool.served[before:]
    # Every turn after the first reused its prefix.
    assert [s.cached_tokens > 0 for s in mine] == [False] * 4 + [True] * 12
    stats = rig.stats()
    assert stats["policy"] == "cache_aware"
    assert stats["decisions"]["hit"] == 12 and stats["decisions"]["miss"] == 4
    assert stats["predicted_hits_confirmed"] == 12 and stats["predicted_hits_refuted"] == 0
    reported = sum(w["reported_cached_tokens"] for w in stats["workers"].values())
    assert reported == sum(s.cached_tokens for s in mine)
    metrics = rig.client.get("/metrics").text
    assert 'modelrelay_affinity_decisions_total{decision="hit"} 12.0' in metrics
    assert 'modelrelay_affinity_reported_cached_tokens_total{worker="box-' in metrics


def test_prompt_cache_key_and_the_session_header_win_over_the_prompt(rig: Rig):
    first = conversation(11, 2, ["Earlier reply."])
    rig.chat(first | {"prompt_cache_key": "alpha"})
    home = rig.upstream_of(json.dumps(first | {"prompt_cache_key": "alpha"}).encode())
    for i in range(4):  # new conversations alternate: find one on the other worker
        session = f"beta-{i}"
        other_body = conversation(20 + i, 1, [])
        rig.chat(other_body, {SESSION_HEADER: session})
        other = rig.upstream_of(json.dumps(other_body).encode())
        if other != home:
            break
    assert other != home
    # The first conversation's prompt (its blocks are on ``home``) under beta's names.
    keyed = first | {"prompt_cache_key": session}
    rig.chat(keyed)
    assert rig.upstream_of(json.dumps(keyed).encode()) == other
    first_again = conversation(11, 2, ["Earlier reply."]) | {"temperature": 0.5}
    rig.chat(first_again, {SESSION_HEADER: session})
    assert rig.upstream_of(json.dumps(first_again).encode()) == other


def test_the_guard_spills_one_hot_conversation_to_the_other_worker(rig: Rig):
    body = conversation(17, 1, [])
    rig.chat(body)
    home = rig.upstream_of(json.dumps(body).encode())
    rig.pool.hold()
    results: list[int] = []
    threads = []
    for i in range(6):  # six turns of one conversation at once
        hot = body | {"user": f"burst-{i}"}

        def send(document: dict[str, Any] = hot) -> None:
            with httpx.Client(base_url=rig.server.url, timeout=20) as client:
                raw = json.dumps(document).encode()  # the same bytes as the first turn's
                response = client.post(
                    CHAT,
                    content=raw,
                    headers={
                        "content-type": "application/json",
                        "authorization": f"Bearer {rig.keys['A']}",
                    },
                )
                results.append(response.status_code)

        threads.append(threading.Thread(target=send))
        threads[-1].start()
    poll(lambda: rig.pool.in_flight() == 6, what="six requests in flight")
    where = Counter(s.index for s in rig.pool.served[-6:])
    rig.pool.release()
    for thread in threads:
        thread.join(20)
    assert results == [200] * 6
    # Its worker takes them while its load stays within the guard, max(ceil(1.25 x the
    # mean), least + 1 + slack), that is five of six; the sixth goes to the other.
    guard = rig.stats()["guard"]
    assert guard == {"load_factor": 1.25, "load_slack": 4}
    assert where[home] == max(math.ceil(1.25 * 6 / 2), 0 + 1 + 4) == 5
    assert where[1 - home] == 1
    assert rig.stats()["decisions"]["guard"] >= 1
    poll(lambda: rig.pool.in_flight() == 0, what="the burst to end")


def key_b_copies_key_a(rig: Rig, tag: int) -> tuple[list[bool], list[bool], int]:
    """Key A sends eight new conversations, then key B each of them again (the same
    prompt, ``user`` aside); then A six more under prompt_cache_keys, and B another
    conversation under each of those keys. Returns, for B's copies of the prompts and of
    the keys, whether each went to A's backend, and the hits the relay counted for B."""
    same_prompt, same_key = [], []
    hits = 0
    for i in range(8):
        body = conversation(tag + i, 2, ["A reply."])
        rig.chat(body | {"user": "a"})
        before = rig.stats()["decisions"]["hit"]
        rig.chat(body | {"user": "b"}, key="B")
        hits += rig.stats()["decisions"]["hit"] - before
        copy = rig.served(body | {"user": "b"})
        same_prompt.append(copy.index == rig.served(body | {"user": "a"}).index)
        assert same_prompt[-1] or copy.cached_tokens == 0  # a backend of its own: nothing
    for i in range(6):
        mine = conversation(tag + 50 + i, 1, []) | {"prompt_cache_key": f"project-{tag}-{i}"}
        rig.chat(mine)
        theirs = conversation(tag + 80 + i, 1, []) | {"prompt_cache_key": f"project-{tag}-{i}"}
        before = rig.stats()["decisions"]["hit"]
        rig.chat(theirs, key="B")
        hits += rig.stats()["decisions"]["hit"] - before
        same_key.append(rig.served(theirs).index == rig.served(mine).index)
    return same_prompt, same_key, hits


def test_another_keys_copy_of_a_prompt_or_cache_key_is_placed_by_least_load(rig: Rig):
    same_prompt, same_key, hits = key_b_copies_key_a(rig, 100)
    # Least-load alternates new conversations between the two workers: B's copy goes
    # where A's request did not (never more than half of them, whatever the ties).
    assert sum(same_prompt) <= 4 and sum(same_key) <= 3, (same_prompt, same_key)
    assert hits == 0
    assert rig.stats()["share_across_keys"] is False


def test_keys_that_share_prefixes_follow_each_others_workers(tmp_path: Path):
    with running_rig(tmp_path / "server", AFFINITY_SHARE_ACROSS_KEYS="true") as shared:
        same_prompt, same_key, hits = key_b_copies_key_a(shared, 100)
        assert all(same_prompt) and all(same_key), (same_prompt, same_key)
        assert hits == 8 + 6
        assert shared.stats()["share_across_keys"] is True
        # The backend reused A's prefix for B: what sharing costs, as documented.
        assert all(
            shared.served(conversation(100 + i, 2, ["A reply."]) | {"user": "b"}).cached_tokens
            for i in range(8)
        )


def test_a_backend_reporting_misses_and_a_worker_leaving_lose_their_entries(rig: Rig):
    body = conversation(13, 2, ["Some reply."])
    rig.chat(body)
    home = rig.upstream_of(json.dumps(body).encode())
    before = rig.stats()
    rig.pool.upstreams[home].cache.blocks.clear()  # the backend restarted: cache gone
    again = body | {"user": "after-restart"}
    rig.chat(again)
    assert rig.upstream_of(json.dumps(again).encode()) == home
    after = rig.stats()
    assert after["predicted_hits_refuted"] == before["predicted_hits_refuted"] + 1
    # The refuted prefix is gone from that worker: the next turn is a new conversation.
    rig.chat(body | {"user": "third"})
    assert rig.stats()["decisions"]["miss"] == after["decisions"]["miss"] + 1
    # A worker leaves: everything it held goes with it.
    held = rig.stats()["blocks_by_worker"]
    assert len(held) == 2
    rig.workers[home].stop()
    poll(lambda: workers_connected(rig.server) == 1, what="the worker to leave")
    left = rig.stats()["blocks_by_worker"]
    assert len(left) == 1 and left.items() <= held.items()
