"""First-token deadlines in the core (SPEC §21): the header's bounds, refusal at
admission and in the queue, and what is counted."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from relay.core import deadlines
from relay.core.affinity import AffinityConfig
from relay.core.relay import Relay
from relay.core.state import RelayRequest, Worker
from relay.core.stats import RequestRecord
from relay.wire import protocol
from relay.wire.errors import BadRequest, DeadlineUnmeetable, error_response
from tests.core.test_speeds import chat, teach
from tests.corekit import FAST, attach, complete, make_relay

#: (Heartbeats slow enough that a worker that never pongs outlives a test.)
LEAST = dataclasses.replace(
    FAST,
    affinity=AffinityConfig(policy="least_load"),
    heartbeat_interval=5.0,
    heartbeat_timeout=10.0,
)


@pytest.mark.parametrize(
    ("value", "ms"),
    [(None, None), (b"1", 1), (b"250", 250), (b" 800 ", 800), (b"3600000", 3_600_000)],
)
def test_a_deadline_header_is_a_whole_number_of_milliseconds(value, ms):
    assert deadlines.parse(value) == ms


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"0",
        b"3600001",  # one over the bound
        b"99999999999999999999",
        b"-5",
        b"+5",
        b"1.5",
        b"1e3",
        b"12 34",
        b"abc",
        b"0x10",
        "١٢٣".encode(),  # Arabic-Indic digits: not ASCII
        "\uff11\uff12".encode(),  # fullwidth digits
        b"\xff\xfe",
    ],
)
def test_a_deadline_header_out_of_bounds_or_not_ascii_digits_is_a_clear_400(value):
    with pytest.raises(BadRequest) as caught:
        deadlines.parse(value)
    assert caught.value.status == 400
    assert "X-Deadline-Ms must be a whole number of milliseconds from 1 to 3600000" in str(
        caught.value
    )


def test_a_stated_deadline_wins_over_the_keys_which_wins_over_the_classs():
    assert deadlines.resolve(100, 200, 300) == 100
    assert deadlines.resolve(None, 200, 300) == 200
    assert deadlines.resolve(None, None, 300) == 300
    assert deadlines.resolve(None, None, None) is None


def send(relay: Relay, text_bytes: int, deadline_ms: int | None, n: int = 0) -> RelayRequest:
    return relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=True,
        body=chat(text_bytes, n),
        headers={},
        deadline_ms=deadline_ms,
    )


def taught(relay: Relay, w: Worker, rate: float, decode: float = 0.05, step: int = 150) -> None:
    """``w`` served 30 requests at ``rate`` prompt tokens a second (100 tokens and
    ``step`` more each time), each decoding for ``decode`` seconds."""
    now = relay.loop.time()
    for i in range(30):
        tokens = 100 + step * i
        teach(relay.rates, w, now, tokens=tokens, ttft=0.02 + tokens / rate, decode_secs=decode)


async def test_a_deadline_no_worker_can_meet_is_refused_at_once_with_the_predicted_wait():
    relay = make_relay(LEAST)
    slow, link = attach(relay, name="slow", max_concurrent=4)
    taught(relay, slow, 1000)
    seen: list[RequestRecord] = []
    relay.observers.append(seen.append)
    with pytest.raises(DeadlineUnmeetable) as caught:
        send(relay, 8000, 500)  # 2,000 tokens: about two seconds
    err = caught.value
    status, headers, body = error_response(err, "openai")
    assert status == 503 and dict(headers)[b"retry-after"] in (b"2", b"3")  # ceil(~2.0 s)
    assert b"within the deadline of 500 ms: the predicted wait is 2.0 s" in body
    assert b'"code":"deadline_unmeetable"' in body
    assert link.requests == [] and relay.active == 0
    assert [r.outcome for r in seen] == ["deadline_unmeetable"]
    assert relay.deadlines["refused"] == 1


async def test_a_request_with_a_deadline_goes_where_it_is_predicted_to_answer_in_time():
    relay = make_relay(LEAST)  # least load would alternate; the deadline asks for speed
    slow, _ = attach(relay, name="slow", max_concurrent=4)
    fast, _ = attach(relay, name="fast", max_concurrent=4)
    taught(relay, slow, 500)
    taught(relay, fast, 4000)
    placed = [send(relay, 2000, 900, n) for n in range(3)]
    assert all(r.worker is fast for r in placed)
    relay.on_chunk(fast, placed[0].id, "data: {}\n\n")
    assert relay.deadlines["met"] == 1


async def test_when_every_worker_is_busy_the_wait_for_a_slot_counts():
    relay = make_relay(LEAST)
    a, _ = attach(relay, name="a", max_concurrent=1)
    taught(relay, a, 2000, decode=1.0, step=10)  # a request holds the slot about a second
    running = send(relay, 400, None)
    assert running.worker is a
    with pytest.raises(DeadlineUnmeetable) as caught:
        send(relay, 400, 300, 1)
    predicted = float(str(caught.value).rsplit(" ", 2)[1])
    assert 1.1 < predicted < 1.5  # the slot (~1.2 s), then ~0.07 s on the worker
    queued = send(relay, 400, 5000, 2)
    assert queued.worker is None and relay.queue_depth() == 1
    # It may wait until its deadline less the worker's time to first token when idle.
    assert queued.queue_deadline == queued.start_by
    assert queued.first_token_by - 0.3 < queued.start_by < queued.first_token_by


async def test_a_queued_request_leaves_when_it_can_no_longer_meet_its_deadline():
    relay = make_relay(LEAST)
    a, link = attach(relay, name="a", max_concurrent=1)
    taught(relay, a, 4000, decode=0.05, step=10)  # a slot frees every ~0.1 s, usually
    blocker = send(relay, 400, None)
    assert blocker.worker is a
    waiting = send(relay, 400, 400, 1)  # admitted: predicted well within 400 ms
    assert waiting.worker is None
    started = relay.loop.time()
    async with asyncio.timeout(2):
        events = await waiting.next_events()  # the blocker never ends
    (event,) = events
    assert isinstance(event, DeadlineUnmeetable)
    left = relay.loop.time() - started
    assert 0.33 < left < 0.39  # at its deadline less its predicted time on the worker
    assert "deadline of 400 ms" in event.message and event.status == 503
    assert event.retry_after is not None and event.retry_after >= 1
    assert relay.queue_depth() == 0 and relay.deadlines["expired"] == 1
    assert len(link.requests) == 1  # it never reached the worker
    complete(relay, a, blocker.id)  # the slot freed later finds nothing of it
    assert len(link.requests) == 1


async def test_an_answer_that_came_late_is_counted_as_missed():
    relay = make_relay(LEAST)
    a, _ = attach(relay, name="a", max_concurrent=2)
    taught(relay, a, 4000)
    r = send(relay, 400, 200)
    r.first_token_by = relay.loop.time() - 0.001  # as if 200 ms had passed
    relay.on_chunk(a, r.id, "data: {}\n\n")
    relay.on_complete(a, protocol.ResponseComplete(request_id=r.id, status_code=200))
    unary = relay.submit(
        model="m",
        endpoint_path="/v1/chat/completions",
        flavor="openai",
        is_streaming=False,
        body=chat(400),
        headers={},
        deadline_ms=1000,
    )
    complete(relay, a, unary.id)  # its first byte is its whole answer, in time
    assert (relay.deadlines["missed"], relay.deadlines["met"]) == (1, 1)


async def test_a_deadline_for_a_model_loaded_nowhere_is_refused_rather_than_waiting():
    relay = make_relay(LEAST)
    attach(relay, states={"m": protocol.LOADABLE}, model_capacity=1)
    with pytest.raises(DeadlineUnmeetable) as caught:
        send(relay, 400, 2000)
    assert "No worker can send a first token within the deadline of 2000 ms" in str(caught.value)


async def test_a_deadline_is_checked_with_the_speeds_of_the_model_an_alias_names():
    relay = make_relay(LEAST, aliases={"public-name": "m"})
    slow, _ = attach(relay, name="slow", max_concurrent=4)  # serves "m"
    taught(relay, slow, 500)
    body = json.dumps(
        {
            "model": "public-name",
            "stream": True,
            "messages": [{"role": "user", "content": "x" * 8000}],
        }
    )
    with pytest.raises(DeadlineUnmeetable) as caught:  # ~2,000 tokens at 500 a second
        relay.submit(
            model="public-name",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=True,
            body=body,
            headers={},
            deadline_ms=2000,
        )
    assert "predicted wait is 4." in str(caught.value)
