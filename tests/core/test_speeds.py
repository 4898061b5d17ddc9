"""Learned speeds and predicted time to first token (SPEC §21), in the core: the rates
converge and decay, a worker with no history borrows the fleet's, predictions choose,
without sockets (times are given, never slept)."""

from __future__ import annotations

import dataclasses
import json
import random

import msgspec
import pytest

from relay.core.affinity import AffinityConfig, Prompt
from relay.core.rates import Rates
from relay.core.relay import Relay
from relay.core.speed import MIN_SECS_PER_TOKEN, SpeedConfig
from relay.core.state import RelayRequest, Worker
from relay.wire import protocol
from tests.corekit import FAST, RecordingLink, attach, make_relay

PREDICTED = dataclasses.replace(FAST, affinity=AffinityConfig(policy="predicted", block_bytes=64))


def worker(name: str) -> Worker:
    return Worker(
        id=f"w-{name}",
        provider="local",
        name=name,
        models=("m",),
        max_concurrent=8,
        link=RecordingLink(),
        connected_at=0.0,
        last_pong=0.0,
    )


def request(tokens: int, *, stream: bool = True, model: str = "m") -> RelayRequest:
    r = RelayRequest(
        id="r", seq=1, provider="local", model=model, endpoint_path="/v1/chat/completions",
        flavor="openai", is_streaming=stream, body="", headers={}, key_id=None,
        created_wall=0.0, now=0.0, deadline=1e9,
    )  # fmt: skip
    r.prompt_bytes = 4 * tokens
    return r


def teach(
    rates: Rates,
    w: Worker,
    now: float,
    *,
    tokens: int,
    ttft: float,
    completion: int = 20,
    decode_secs: float = 1.0,
    counts: protocol.TokenCounts | None = None,
    model: str = "m",
    stream: bool = True,
) -> None:
    """``w`` served a request of ``tokens`` prompt tokens, first byte after ``ttft``,
    then ``completion`` tokens over ``decode_secs``, ending at ``now``."""
    r = request(tokens, stream=stream, model=model)
    r.assigned_at = now - ttft - decode_secs
    r.first_byte_at = r.assigned_at + ttft
    rates.observe(
        r,
        w,
        counts or protocol.TokenCounts(prompt_tokens=tokens, completion_tokens=completion),
        now,
        200,
    )


def test_speeds_converge_to_the_line_through_first_byte_times():
    rates = Rates(SpeedConfig())
    a = worker("a")
    draw = random.Random(7)
    for i in range(60):
        tokens = draw.randint(50, 3000)
        jitter = draw.uniform(0.97, 1.03)
        teach(rates, a, float(i), tokens=tokens, ttft=(0.08 + tokens / 1500) * jitter)
    fit = rates.fit(a, "m", 60.0)
    assert 1500 * 0.95 < 1 / fit.secs_per_token < 1500 * 1.05
    assert abs(fit.overhead - 0.08) < 0.03
    assert 18.5 < fit.decode < 19.5  # 19 tokens after the first, over a second
    assert a.speed["m"].confidence > 0.9


def test_the_backends_own_prefill_time_pins_the_rate_for_prompts_of_one_size():
    rates = Rates(SpeedConfig())
    a = worker("a")
    for i in range(10):
        counts = protocol.TokenCounts(
            prompt_tokens=1000, completion_tokens=20, prefill_ms=500.0, decode_ms=400.0
        )
        teach(rates, a, float(i), tokens=1000, ttft=0.62, counts=counts)
    fit = rates.fit(a, "m", 10.0)
    assert 1900 < 1 / fit.secs_per_token < 2100  # 1000 tokens in 500 ms
    assert 0.08 < fit.overhead < 0.16  # the rest of the 620 ms
    assert 48 < fit.decode < 52  # 20 tokens in 400 ms, as the backend says


def test_a_worker_with_no_history_borrows_the_fleet_median():
    rates = Rates(SpeedConfig())
    for name, rate in (("a", 1000), ("b", 2000), ("c", 4000)):
        w = worker(name)
        for i in range(20):
            tokens = 200 + 100 * i
            teach(rates, w, float(i), tokens=tokens, ttft=0.05 + tokens / rate)
    newcomer = worker("new")
    fit = rates.fit(newcomer, "m", 20.0)
    assert 1800 < 1 / fit.secs_per_token < 2200
    assert "m" not in newcomer.speed  # borrowed, nothing made for it
    # A model no worker served yet: the configured defaults.
    assert rates.fit(newcomer, "other", 20.0) == rates.default


def test_what_was_learned_fades_back_to_the_fleet_as_it_decays():
    rates = Rates(SpeedConfig(half_life=10.0))
    slow = worker("slow")
    for i in range(20):
        teach(rates, slow, float(i), tokens=1000 + 50 * i, ttft=0.05 + (1000 + 50 * i) / 250)
    for name in ("a", "b", "c"):
        w = worker(name)
        for i in range(20):
            teach(rates, w, float(i), tokens=1000 + 50 * i, ttft=0.05 + (1000 + 50 * i) / 2000)
    assert 1 / rates.fit(slow, "m", 20.0).secs_per_token < 300
    # Ten half-lives without a request: its own samples weigh nothing any more.
    fit = rates.fit(slow, "m", 20.0 + 10 * 10.0 + 1.0)
    assert slow.speed["m"].confidence < 0.01
    assert 1 / fit.secs_per_token > 1800


def test_a_box_that_slows_down_is_noticed_within_a_half_life():
    rates = Rates(SpeedConfig(half_life=20.0))
    box = worker("box")
    draw = random.Random(3)
    t = 0.0
    for _ in range(120):  # two minutes at 2,000 tokens/s, a request a second
        tokens = draw.randint(200, 2000)
        teach(rates, box, t, tokens=tokens, ttft=0.05 + tokens / 2000)
        t += 1.0
    assert 1 / rates.fit(box, "m", t).secs_per_token > 1800
    for _ in range(20):  # its GPU is shared now: 500 tokens/s
        tokens = draw.randint(200, 2000)
        teach(rates, box, t, tokens=tokens, ttft=0.05 + tokens / 500)
        t += 1.0
    assert 1 / rates.fit(box, "m", t).secs_per_token < 1000


def test_bytes_per_token_is_learned_per_model_from_reported_usage():
    rates = Rates(SpeedConfig())
    a = worker("a")
    for i in range(5):
        r = request(100)
        r.prompt_bytes = 300  # three bytes a token for this model
        r.assigned_at = float(i)
        rates.observe(r, a, protocol.TokenCounts(prompt_tokens=100), float(i) + 1, 200)
        estimated = request(100, model="n")
        estimated.prompt_bytes = 900
        estimated.assigned_at = float(i)
        # An estimate (no usage reported) teaches nothing of tokens.
        rates.observe(
            estimated,
            a,
            protocol.TokenCounts(prompt_tokens=100, estimated=True),
            float(i) + 1,
            200,
        )
    assert rates.bytes_per_token("m") == pytest.approx(3.0)
    assert rates.bytes_per_token("n") == 4.0
    assert rates.tokens("m", 3000) == pytest.approx(1000)


def test_failures_teach_nothing_and_answers_that_were_not_streamed_teach_no_first_byte():
    rates = Rates(SpeedConfig())
    a = worker("a")
    r = request(1000)
    r.assigned_at, r.first_byte_at = 1.0, 1.1
    rates.observe(r, a, protocol.TokenCounts(prompt_tokens=1000), 2.0, 502)
    assert "m" not in a.speed
    teach(rates, a, 5.0, tokens=1000, ttft=3.0, stream=False)
    speed = a.speed["m"]
    assert speed.samples == 1 and speed.n == 0.0 and speed.vn > 0  # service time only


def test_decayed_sums_never_run_away_whatever_the_order_of_times():
    rates = Rates(SpeedConfig(half_life=1.0))
    a = worker("a")
    teach(rates, a, 100.0, tokens=100, ttft=0.1)
    teach(rates, a, 50.0, tokens=100, ttft=0.1)  # an older time: nothing decays backwards
    fit = rates.fit(a, "m", 100.0)
    assert fit.secs_per_token > 0 and fit.overhead >= 0


# -- predictions through the dispatcher ------------------------------------------------


def chat(text_bytes: int, n: int = 0) -> str:
    content = f"{n} " + "x" * text_bytes
    return json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
    )


def send(relay: Relay, body: str, *, key_id: int | None = None) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=True,
        body=body,
        headers={},
        key_id=key_id,
        prompt=msgspec.json.decode(body, type=Prompt),
    )


def taught(relay: Relay, w: Worker, rate: float, overhead: float = 0.05) -> None:
    now = relay.loop.time()
    for i in range(100):
        tokens = 100 + 45 * i
        teach(relay.rates, w, now, tokens=tokens, ttft=overhead + tokens / rate)


async def test_predicted_routing_sends_a_long_prompt_to_the_fast_worker():
    relay = make_relay(PREDICTED)
    slow, _ = attach(relay, name="slow", max_concurrent=4)
    fast, _ = attach(relay, name="fast", max_concurrent=4)
    taught(relay, slow, 800)
    taught(relay, fast, 3000)
    # ~2,010 tokens each: 0.72 s on the fast one, then 1.39 s, 2.06 s, 2.73 s behind the
    # ones sent before; 2.56 s on the slow one: the first three go to the fast one.
    placed = [send(relay, chat(8000, n)) for n in range(4)]
    assert [r.worker.name for r in placed if r.worker is not None] == ["fast"] * 3 + ["slow"]
    tokens = placed[0].prompt_bytes / 4
    assert placed[0].predicted == pytest.approx(0.05 + tokens / 3000, rel=0.05)
    assert placed[2].predicted == pytest.approx(0.05 + 3 * tokens / 3000, rel=0.05)
    assert placed[3].predicted == pytest.approx(0.05 + tokens / 800, rel=0.05)


async def test_identical_workers_share_back_to_back_requests_by_their_predicted_wait():
    relay = make_relay(PREDICTED)
    a, _ = attach(relay, name="a", max_concurrent=8)
    b, _ = attach(relay, name="b", max_concurrent=8)
    placed = [send(relay, chat(4000, n)).worker for n in range(6)]
    assert [w.name for w in placed if w is not None].count("a") == 3
    assert a.busy_until == pytest.approx(b.busy_until, rel=0.01)


async def test_a_first_byte_reanchors_the_wait_and_a_cancel_gives_it_back():
    relay = make_relay(PREDICTED)
    a, _ = attach(relay, name="a", max_concurrent=8)
    taught(relay, a, 1000)
    first = send(relay, chat(4000, 1))
    second = send(relay, chat(4000, 2))
    assert second.ahead == pytest.approx(first.prefill_secs, rel=0.01)
    waiting = a.busy_until - relay.loop.time()
    relay.on_chunk(a, first.id, "data: {}\n\n")  # the first is through its prompt now
    after = a.busy_until - relay.loop.time()
    assert after == pytest.approx(second.prefill_secs, abs=0.02) and after < waiting
    relay.cancel(second)
    assert a.busy_until <= relay.loop.time() + 0.001


async def test_the_bounded_load_guard_keeps_the_fast_worker_from_taking_everything():
    relay = make_relay(PREDICTED)
    slow, _ = attach(relay, name="slow", max_concurrent=64)
    fast, _ = attach(relay, name="fast", max_concurrent=64)
    taught(relay, slow, 100)  # thirty times slower
    taught(relay, fast, 3000)
    for n in range(12):
        send(relay, chat(40, n))  # short prompts: the fast one is always predicted first
    bound = relay.router.bound([slow, fast])
    # It took what the guard allows (least + 1 + slack = 5, or 1.25 x the mean), no more.
    assert fast.load <= max(bound, 6) and slow.load >= 12 - fast.load > 0


async def test_a_prefix_the_worker_holds_counts_as_prompt_it_need_not_process():
    relay = make_relay(PREDICTED)
    holder, _ = attach(relay, name="holder", max_concurrent=4)
    taught(relay, holder, 1000)
    history = [{"role": "user", "content": "turn 0: " + "y" * 6000}]
    first = send(relay, json.dumps({"model": "m", "stream": True, "messages": history}))
    relay.on_chunk(holder, first.id, "data: {}\n\n")
    relay.on_complete(holder, protocol.ResponseComplete(request_id=first.id, status_code=200))
    other, _ = attach(relay, name="other", max_concurrent=4)
    taught(relay, other, 1500)  # faster, but it would process the whole prompt
    history.append({"role": "assistant", "content": "ok"})
    history.append({"role": "user", "content": "turn 1: short"})
    follow = send(relay, json.dumps({"model": "m", "stream": True, "messages": history}))
    assert follow.worker is holder
    # The whole 64-byte blocks of the first turn (its messages' JSON) are held there.
    assert follow.cached_guess > (6030 // 64 - 1) * 64 / 4
    assert follow.predicted < 0.1 < relay.predictor.ttft(other, follow, relay.loop.time())


async def test_predictions_are_checked_against_what_was_measured():
    relay = make_relay(PREDICTED)
    a, _ = attach(relay, name="a", max_concurrent=4)
    taught(relay, a, 2000)
    r = send(relay, chat(2000))
    r.assigned_at -= 0.5  # it was sent half a second ago
    relay.on_chunk(a, r.id, "data: {}\n\n")
    counts = protocol.TokenCounts(prompt_tokens=500, completion_tokens=1)
    relay.on_complete(
        a, protocol.ResponseComplete(request_id=r.id, status_code=200, token_counts=counts)
    )
    row = a.speed["m"].describe()
    assert row["measured_ttft_ms"] == pytest.approx(500, abs=20)
    assert row["predicted_ttft_ms"] == pytest.approx(1000 * r.predicted, abs=1)


async def test_speeds_are_learned_under_every_policy_and_forgotten_with_their_worker():
    relay = make_relay(FAST)  # cache_aware
    a, _ = attach(relay, name="a")
    r = send(relay, chat(400))
    relay.on_chunk(a, r.id, "data: {}\n\n")
    relay.on_complete(a, protocol.ResponseComplete(request_id=r.id, status_code=200))
    assert a.speed["m"].samples == 1 and relay.rates.models() == ["m"]
    relay.close_worker(a, 1000, "bye")
    assert relay.rates.models() == []


def test_a_change_of_speed_seen_on_other_prompt_sizes_stays_a_rate_not_a_negative_one():
    rates = Rates(SpeedConfig(half_life=30.0))
    box = worker("box")
    for i in range(20):  # long prompts, fast
        teach(rates, box, float(i), tokens=3000, ttft=0.05 + 3000 / 7500)
    for i in range(8):  # then short ones, ten times slower: the line through both falls
        teach(rates, box, 20.0 + i, tokens=400, ttft=0.05 + 400 / 750)
    fit = rates.fit(box, "m", 28.0)
    assert fit.secs_per_token > MIN_SECS_PER_TOKEN and fit.overhead <= 0.06
    assert 1 / fit.secs_per_token < 7500  # slower than it was, whatever the sizes


def predicted_teach(rates: Rates, w: Worker, now: float, tokens: int, ttft: float) -> None:
    """``teach``, the request carrying the prediction the relay would have made."""
    fit = rates.fit(w, "m", now)
    r = request(tokens)
    r.predicted = fit.overhead + tokens * fit.secs_per_token
    r.assigned_at = now - ttft - 0.1
    r.first_byte_at = r.assigned_at + ttft
    rates.observe(r, w, protocol.TokenCounts(prompt_tokens=tokens, completion_tokens=5), now, 200)


def test_a_stall_now_and_then_does_not_make_a_box_look_slow_but_a_slowdown_does():
    rates = Rates(SpeedConfig(half_life=20.0))
    box = worker("box")
    draw = random.Random(5)
    t = 0.0
    for i in range(200):
        tokens = draw.randint(200, 2000)
        stall = 5.0 if i % 20 == 19 else 0.0  # one request in twenty held 5 s
        predicted_teach(rates, box, t, tokens, 0.02 + tokens / 4000 + stall)
        t += 0.5
    assert 1 / rates.fit(box, "m", t).secs_per_token > 3000
    assert rates.fit(box, "m", t).overhead < 0.2
    for _ in range(40):  # now ten times slower, every request: within a half-life
        tokens = draw.randint(200, 2000)
        predicted_teach(rates, box, t, tokens, 0.02 + tokens / 400)
        t += 0.5
    assert 1 / rates.fit(box, "m", t).secs_per_token < 1000


def test_a_busy_box_is_learned_at_its_own_rate_whatever_waits_ahead():
    """A box that processes one prompt at a time, kept 70 % busy: most requests wait
    behind others, and what was predicted to wait is not taken for the box's rate
    (no loop runs away from the truth, from a prior six times off)."""
    import heapq

    from relay.core.affinity import Router
    from relay.core.prediction import Predictor

    rates = Rates(SpeedConfig(half_life=60.0))
    predictor = Predictor(rates, Router(AffinityConfig(policy="predicted")))
    box = worker("box")
    rate, overhead = 12_000.0, 0.01
    draw = random.Random(11)
    t = free = 0.0
    events: list[tuple[float, int, RelayRequest]] = []
    for i in range(400):
        t += draw.expovariate(0.7 / (0.3 * 3000 / rate + 0.7 * 200 / rate))
        while events and events[0][0] <= t:  # first bytes that came meanwhile
            at, _, r = heapq.heappop(events)
            predictor.started(r, box, at)
            rates.observe(r, box, protocol.TokenCounts(prompt_tokens=r.prompt_bytes // 4), at, 200)
        tokens = 3000 if draw.random() < 0.3 else 200
        r = request(tokens)
        r.assigned_at = t
        predictor.assigned(r, box, t)
        free = max(t, free) + tokens / rate  # the box's own queue
        r.first_byte_at = free + overhead
        heapq.heappush(events, (r.first_byte_at, i, r))
    fit = rates.fit(box, "m", t)
    assert 0.85 * rate < 1 / fit.secs_per_token < 1.15 * rate
