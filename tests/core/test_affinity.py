"""Cache-aware routing in the core (SPEC §14): keys, the bounded index, the guard and
the closed loop, without sockets."""

from __future__ import annotations

import dataclasses
import json
import math
import tracemalloc
from collections import Counter

import msgspec
import pytest

from relay.core.affinity import AffinityConfig, Prompt, Router, affinity_of
from relay.core.relay import Relay
from relay.core.state import RelayRequest, Worker
from relay.wire import protocol
from tests.corekit import FAST, attach, make_relay

BLOCK = 64
CHAT = "/v1/chat/completions"
USER = "x" * 300
CONFIG = dataclasses.replace(FAST, affinity=AffinityConfig(block_bytes=BLOCK))


def chat(turns: list[str], system: str = "You are terse. " * 8) -> str:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return json.dumps({"model": "m", "messages": messages})


def send(
    relay: Relay,
    body: str,
    headers: dict[str, str] | None = None,
    path: str = CHAT,
    key_id: int | None = None,
) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path=path,
        flavor="openai",
        is_streaming=False,
        body=body,
        headers={},
        key_id=key_id,
        prompt=msgspec.json.decode(body, type=Prompt),
        session=(headers or {}).get("x-session-id"),
    )


def finish(relay: Relay, request: RelayRequest, cached: int | None = None) -> Worker:
    worker = request.worker
    assert worker is not None
    counts = protocol.TokenCounts(prompt_tokens=100, cached_tokens=cached)
    relay.on_complete(
        worker,
        protocol.ResponseComplete(
            request_id=request.id, status_code=200, body="{}", token_counts=counts
        ),
    )
    return worker


def conversation(n: int) -> list[str]:
    return [f"conversation {n} turn {t}: " + "words " * 20 for t in range(6)]


async def test_turns_of_a_conversation_follow_their_worker():
    relay = make_relay(CONFIG)
    for name in ("a", "b", "c"):
        attach(relay, name=name, max_concurrent=4)
    homes: dict[int, set[str]] = {}
    for turn in range(1, 6):
        for n in range(6):
            request = send(relay, chat(conversation(n)[:turn], system=f"Persona {n}. " * 8))
            homes.setdefault(n, set()).add(finish(relay, request).name)
    assert all(len(names) == 1 for names in homes.values()), homes
    assert len(set().union(*homes.values())) == 3  # new conversations still spread
    assert relay.router.decisions["hit"] == 6 * 4
    assert relay.router.decisions["miss"] == 6


async def test_a_shared_system_prompt_alone_does_not_draw_new_conversations():
    relay = make_relay(CONFIG)
    attach(relay, name="a", max_concurrent=8)
    attach(relay, name="b", max_concurrent=8)

    def task(n: int) -> str:
        return chat([f"task {n}: " + "the details of the task " * 20])

    finish(relay, send(relay, task(0)))
    running = [send(relay, task(n)) for n in range(1, 9)]
    # Their common system prompt covers less than half of each first turn (min_match):
    # least-load spreads them, so each conversation has a home before it grows.
    names = [r.worker.name for r in running if r.worker is not None]
    assert sorted(Counter(names).values()) == [4, 4]
    assert relay.router.decisions["hit"] == 0


async def test_a_long_shared_prefix_draws_new_conversations_until_the_guard():
    relay = make_relay(CONFIG)
    a, _ = attach(relay, name="a", max_concurrent=8)
    b, _ = attach(relay, name="b", max_concurrent=8)
    document = "A long shared document. " * 50
    finish(relay, send(relay, chat(conversation(0)[:1], system=document)))
    holder = a if relay.router.blocks_of(a.id) else b
    loads = []
    for n in range(1, 9):
        before = relay.router.bound([a, b])
        request = send(relay, chat(conversation(n)[:1], system=document))
        loads.append((request.worker is holder, holder.load, before))
    # The holder takes each while its load after it stays within the guard: 1.25 x the
    # mean, or the least load + 1 + slack (4): five. The sixth spills, and from then on
    # the less loaded of the two holders wins.
    assert all(mine <= bound for took, mine, bound in loads if took), loads
    assert holder.load == 5 and relay.router.decisions["guard"] == 1
    assert [took for took, _, _ in loads] == [True] * 5 + [False] * 3


async def test_the_slack_keeps_a_turn_home_where_the_factor_alone_would_move_it():
    strict = dataclasses.replace(FAST, affinity=AffinityConfig(block_bytes=BLOCK, load_slack=0))
    for config, stays in ((strict, False), (CONFIG, True)):
        relay = make_relay(config)
        attach(relay, name="a", max_concurrent=8)
        attach(relay, name="b", max_concurrent=8)
        home = finish(relay, send(relay, chat(conversation(1)[:3])))
        other = next(w for w in relay.registry.workers.values() if w is not home)
        home.extra_load, other.extra_load = 4, 1  # what the workers report running
        # ceil(1.25 x 6 / 2) = 4 would move the turn (and its prefix) for a difference of
        # three requests; within least + 1 + slack (4) it stays.
        turn = send(relay, chat(conversation(1)[:5]))
        assert (turn.worker is home) is stays
        assert turn.affinity is not None
        assert turn.affinity.decision == ("hit" if stays else "guard")


async def test_an_explicit_key_wins_over_the_prompt_blocks():
    relay = make_relay(CONFIG)
    attach(relay, name="a", max_concurrent=4)
    attach(relay, name="b", max_concurrent=4)
    body = chat(conversation(1)[:3])
    first = finish(relay, send(relay, body, {"x-session-id": "s1"}))
    unrelated = chat(conversation(2)[:1], system="Another persona. " * 8)
    other = finish(relay, send(relay, unrelated, {"x-session-id": "s2"}))
    assert other is not first
    # The same prompt (its blocks are on ``first``) under the other session's key.
    assert finish(relay, send(relay, body, {"x-session-id": "s2"})) is other
    keyed = json.loads(body) | {"prompt_cache_key": "s2"}
    assert finish(relay, send(relay, json.dumps(keyed))) is other
    # prompt_cache_key comes before the header.
    keyed["prompt_cache_key"] = "s1"
    assert finish(relay, send(relay, json.dumps(keyed), {"x-session-id": "s2"})) is first


KEY_A, KEY_B = 7, 8
SHARED = dataclasses.replace(
    FAST, affinity=AffinityConfig(block_bytes=BLOCK, share_across_keys=True)
)


def with_cache_key(body: str, key: str) -> str:
    return json.dumps(json.loads(body) | {"prompt_cache_key": key})


@pytest.mark.parametrize("shared", [False, True], ids=["per-key", "shared"])
async def test_another_keys_prefix_cache_key_and_session_lead_to_its_worker_only_if_shared(
    shared: bool,
):
    relay = make_relay(SHARED if shared else CONFIG)
    attach(relay, name="a", max_concurrent=4)
    attach(relay, name="b", max_concurrent=4)

    def probe(body: str, headers: dict[str, str] | None = None) -> tuple[Worker, Worker]:
        """Key A sends ``body`` and keeps its worker the busier one (least-load alone
        would send anything else to the other worker); then key B sends the same."""
        home = finish(relay, send(relay, body, headers, key_id=KEY_A))
        home.extra_load = 1
        theirs = send(relay, body, headers, key_id=KEY_B)
        assert theirs.affinity is not None
        assert theirs.affinity.decision == ("hit" if shared else "miss")
        took = finish(relay, theirs)
        home.extra_load = 0
        return home, took

    def talk(n: int, turns: int = 1) -> str:
        return chat(conversation(n)[:turns], system=f"Persona {n}. " * 8)

    for body, headers in (
        (talk(1, 3), None),  # the same prompt
        (with_cache_key(talk(2), "ck"), None),  # the same prompt_cache_key
        (talk(3), {"x-session-id": "sa"}),  # the same session
    ):
        home, took = probe(body, headers)
        assert (took is home) is shared
    # A request without a key is in a scope of its own (shared: every key's).
    again = send(relay, talk(1, 3))
    assert again.affinity is not None and again.affinity.decision == ("hit" if shared else "miss")
    await relay.aclose()


async def test_a_miss_reported_under_one_key_leaves_another_keys_prefix():
    relay = make_relay(CONFIG)
    home, _ = attach(relay, name="a", max_concurrent=4)
    other, _ = attach(relay, name="b", max_concurrent=4)
    body = chat(conversation(1)[:3])
    assert finish(relay, send(relay, body, key_id=KEY_A)) is home
    other.extra_load = 1  # key B's turns land on ``home`` too (least-load)
    assert finish(relay, send(relay, body, key_id=KEY_B), cached=0) is home
    second = send(relay, body, key_id=KEY_B)  # B's own prefix, predicted there
    assert second.worker is home and second.affinity is not None and second.affinity.predicted
    held = relay.router.blocks_of(home.id)
    finish(relay, second, cached=0)  # refuted: B's blocks go, and only B's
    assert 0 < relay.router.blocks_of(home.id) < held
    other.extra_load = 0
    home.extra_load = 1
    mine = send(relay, body, key_id=KEY_A)
    assert mine.worker is home and mine.affinity is not None and mine.affinity.decision == "hit"
    await relay.aclose()


def test_each_key_hashes_in_a_scope_of_its_own():
    config = AffinityConfig(block_bytes=BLOCK)
    shared = AffinityConfig(block_bytes=BLOCK, share_across_keys=True)
    raw = json.dumps(
        {"model": "m", "prompt_cache_key": "k", "messages": [{"role": "user", "content": USER}]}
    )

    def of(key_id: int | None, cfg: AffinityConfig = config) -> tuple[int | None, list[int], str]:
        affinity = affinity_of(msgspec.json.decode(raw, type=Prompt), "m", "s", key_id, cfg)
        assert affinity is not None
        return affinity.key, affinity.blocks, affinity.anchor()

    scopes = [of(None), of(1), of(2)]
    for i, one in enumerate(scopes):
        for two in scopes[i + 1 :]:
            assert one[0] != two[0] and not set(one[1]) & set(two[1]) and one[2] != two[2]
    assert of(1) == of(1)  # the same key, the same hashes (any process: the anchor)
    # Shared: every key hashes as a request without a key does.
    assert of(1, shared) == of(2, shared) == of(None, shared) == of(None)
    assert len(of(1)[1]) == len(of(None)[1])


async def test_the_guard_spills_a_hot_conversation_to_another_worker():
    relay = make_relay(CONFIG)
    attach(relay, name="a", max_concurrent=8)
    attach(relay, name="b", max_concurrent=8)
    body = chat(conversation(1)[:3])
    home = finish(relay, send(relay, body))
    loads = []
    for _ in range(6):  # all in flight at once
        send(relay, body)
        loads.append((home.load, sum(w.load for w in relay.registry.workers.values())))
    # Its worker takes it while max(ceil(1.25 * total / 2), least + 1 + 4) allows, the
    # other the rest.
    assert all(mine <= max(math.ceil(1.25 * total / 2), 5) for mine, total in loads), loads
    assert 0 < home.load < 6
    assert relay.router.decisions["guard"] >= 1


async def test_a_worker_reporting_a_miss_loses_those_blocks():
    relay = make_relay(CONFIG)
    attach(relay, name="a", max_concurrent=4)
    attach(relay, name="b", max_concurrent=4)
    body = chat(conversation(1)[:3])
    home = finish(relay, send(relay, body))
    held = relay.router.blocks_of(home.id)
    assert held > 0
    again = send(relay, body)
    assert again.worker is home and again.affinity is not None and again.affinity.predicted > 0
    finish(relay, again, cached=0)  # the backend says: nothing reused
    assert relay.router.blocks_of(home.id) == 0
    described = relay.router.describe()
    assert described["predicted_hits_refuted"] == 1
    assert described["workers"][home.name]["reported_cached_tokens"] == 0
    confirmed = send(relay, body)
    finish(relay, confirmed, cached=90)
    assert relay.router.describe()["predicted_hits_confirmed"] == 0  # it was a miss


async def test_a_confirmed_hit_is_counted_with_its_tokens():
    relay = make_relay(CONFIG)
    attach(relay, name="a", max_concurrent=4)
    body = chat(conversation(1)[:3])
    finish(relay, send(relay, body), cached=0)
    finish(relay, send(relay, body), cached=80)
    row = relay.router.describe()["workers"]["a"]
    assert row["confirmed"] == 1 and row["reported_cached_tokens"] == 80
    assert row["predicted_cached_tokens"] > 0


async def test_a_worker_leaving_drops_its_entries():
    relay = make_relay(CONFIG)
    worker, _ = attach(relay, name="a", max_concurrent=4)
    body = chat(conversation(1)[:3])
    finish(relay, send(relay, body, {"x-session-id": "s"}))
    assert relay.router.blocks_of(worker.id) > 0
    relay.close_worker(worker, 1000, "bye")
    assert relay.router.blocks_of(worker.id) == 0
    assert relay.router.describe()["blocks"] == 0
    successor, _ = attach(relay, name="a", max_concurrent=4)
    request = send(relay, body, {"x-session-id": "s"})
    assert request.worker is successor and request.affinity is not None
    assert request.affinity.predicted == 0 and request.affinity.decision == "miss"


async def test_least_load_policy_reads_nothing():
    config = dataclasses.replace(FAST, affinity=AffinityConfig(policy="least_load"))
    relay = make_relay(config)
    attach(relay, name="a", max_concurrent=4)
    attach(relay, name="b", max_concurrent=4)
    body = chat(conversation(1)[:3])
    names = [finish(relay, send(relay, body)).name for _ in range(4)]
    assert names == ["a", "b", "a", "b"]
    assert relay.router.describe()["blocks"] == 0


def test_memory_stays_bounded_under_churn_of_distinct_prompts():
    config = AffinityConfig(block_bytes=BLOCK, worker_blocks=1_000, max_keys=500)
    router = Router(config)
    workers = [
        Worker(
            id=f"w{i}",
            provider="p",
            name=f"w{i}",
            models=("m",),
            max_concurrent=1,
            link=None,  # type: ignore[arg-type]
            connected_at=0.0,
            last_pong=0.0,
        )
        for i in range(4)
    ]
    tracemalloc.start()
    sizes = []
    for n in range(8_000):
        body = chat([f"distinct prompt {n} " * 10])
        request = RelayRequest(
            id=str(n), seq=n, provider="p", model="m", endpoint_path="/v1/chat/completions",
            flavor="openai", is_streaming=False, body="", headers={}, key_id=None,
            created_wall=0.0, now=0.0, deadline=1.0,
        )  # fmt: skip
        request.affinity = router.affinity(
            msgspec.json.decode(body, type=Prompt), "m", f"k{n}", None
        )
        router.assigned(request, workers[n % 4])
        if n in (3_000, 7_999):
            sizes.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert router.entries() <= 4 * 1_000 + 500
    assert all(router.blocks_of(w.id) <= 1_000 for w in workers)
    assert sizes[1] < sizes[0] * 1.05  # full since long before: no growth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}),
        ("/v1/messages", {"system": "s" * 99, "messages": [{"role": "user", "content": USER}]}),
        ("/v1/responses", {"instructions": "be brief", "input": "x" * 300}),
        ("/v1/completions", {"prompt": "x" * 300}),
    ],
)
def test_every_prompt_shape_is_cut_into_blocks_and_a_longer_turn_extends_them(path, body):
    config = AffinityConfig(block_bytes=BLOCK)

    def of(doc: dict) -> list[int]:
        raw = json.dumps({"model": "m", **doc})
        affinity = affinity_of(msgspec.json.decode(raw, type=Prompt), "m", None, None, config)
        assert affinity is not None
        return affinity.blocks

    blocks = of(body)
    assert len(blocks) >= 4
    longer = json.loads(json.dumps(body))
    if "messages" in longer:
        longer["messages"].append({"role": "assistant", "content": "y" * 200})
    else:
        key = "input" if "input" in longer else "prompt"
        longer[key] += "y" * 200
    extended = of(longer)
    assert extended[: len(blocks) - 1] == blocks[:-1] and len(extended) > len(blocks)
    other_model = affinity_of(
        msgspec.json.decode(json.dumps(body), type=Prompt), "n", None, None, config
    )
    assert other_model is not None and not set(other_model.blocks) & set(blocks)


def test_the_anchor_names_a_conversation_not_its_shared_system_prompt():
    config = AffinityConfig(block_bytes=BLOCK)

    def anchor(body: str) -> str:
        affinity = affinity_of(msgspec.json.decode(body, type=Prompt), "m", None, None, config)
        assert affinity is not None
        return affinity.anchor()

    one = conversation(1)
    assert anchor(chat(one[:1])) == anchor(chat(one[:5]))
    assert anchor(chat(one[:1])) != anchor(chat(conversation(2)[:1]))
    keyed = affinity_of(None, "m", "abc", None, config)
    assert keyed is not None and keyed.anchor() == anchor(
        json.dumps({"model": "m", "prompt_cache_key": "abc", "messages": []})
    )


def test_a_body_of_unexpected_shape_gets_no_blocks_and_no_error():
    config = AffinityConfig(block_bytes=BLOCK)
    prompt = msgspec.json.decode(b'{"model": "m", "messages": 5}', type=Prompt)
    affinity = affinity_of(prompt, "m", None, None, config)
    assert affinity is not None and affinity.blocks == [] and affinity.anchor()


def test_a_prefix_is_measured_in_the_prompt_bytes_it_covers():
    config = AffinityConfig(block_bytes=BLOCK)
    system = "s" * 150  # as JSON: 152 bytes, three blocks (64, 64, 24)
    messages = [{"role": "user", "content": "u" * 270}]  # 300 bytes: four full blocks
    raw = json.dumps({"model": "m", "system": system, "messages": messages})
    affinity = affinity_of(msgspec.json.decode(raw, type=Prompt), "m", None, None, config)
    assert affinity is not None and len(affinity.blocks) == 3 + 4
    body = len(json.dumps(messages))
    assert affinity.size == 152 + body
    assert [affinity.covered(d, BLOCK) for d in (0, 1, 3, 4, 7)] == [0, 64, 152, 216, 408]
