"""Resumable responses across server processes (SPEC §18, §11): the process with the
worker writes the log in Redis; a client reattaches through any process, which replays
and then follows the live bytes; nothing a client or its process does cancels it."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from tests.clusterkit import cluster
from tests.server.test_live_resume import (
    event_key,
    finished,
    lookup_done,
    mock_body,
    raw_post,
    replay,
    sdk,
    stream_until,
)
from tests.test_e2e import CHAT, MODEL, RESPONSES, body_for, direct, poll, routable, running_worker
from tests.upstream import expected_text, upstream_in_thread

pytestmark = [pytest.mark.live, pytest.mark.redis]


@pytest.fixture
def pair(relay_server_factory) -> Any:
    """Processes A and B sharing Redis, the worker connected to B, and its upstream."""
    with (
        upstream_in_thread(total_slots=4) as up,
        cluster(relay_server_factory, 2) as (a, b),
        running_worker(b, up.url),
    ):
        poll(lambda: routable(a) and routable(b), what="B's worker to be routable")
        yield a, b, up


def test_a_background_response_reattaches_through_another_process_and_follows_it(pair) -> None:
    a, b, up = pair
    first: list[Any] = []
    with sdk(a).responses.create(
        model=MODEL,
        input="hi",
        background=True,
        stream=True,
        extra_body=mock_body(tokens=300, token_delay=0.005),
    ) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 8:
                break
    response_id = first[0].response.id
    # Through B, while it still runs: the replay, then the live events.
    rest = list(sdk(b).responses.retrieve(response_id, stream=True, starting_after=7))
    joined = first + rest
    assert [e.sequence_number for e in joined] == list(range(len(joined)))
    uninterrupted = list(sdk(a).responses.retrieve(response_id, stream=True))
    assert [event_key(e) for e in joined] == [event_key(e) for e in uninterrupted]
    for server in (a, b):
        final = finished(sdk(server), response_id)
        assert final.status == "completed" and final.output_text == expected_text(300)
    (seen,) = up.requests_to(RESPONSES)
    assert not seen.disconnected.is_set()


def test_a_stream_dropped_at_a_random_byte_resumes_through_another_process(pair) -> None:
    a, b, up = pair
    body = body_for(CHAT, stream=True, tokens=200, token_delay=0.002, split_utf8=True)
    whole = direct(up, CHAT, body).content
    at = random.Random(7).randrange(1, len(whole) - 1)
    head = stream_until(a, CHAT, body, "moving", at)
    rest = replay(b, "moving", len(head))
    assert head + rest.content == whole
    assert lookup_done(b, "moving")["total_bytes"] == len(whole)
    assert len(up.requests_to(CHAT)) == 2  # (one of them the direct run)
    assert not up.requests_to(CHAT)[-1].disconnected.is_set()


@pytest.mark.parametrize("where", ["client", "worker"])
def test_a_cancel_through_either_process_stops_the_generation(pair, where: str) -> None:
    a, b, up = pair
    created = sdk(a).responses.create(
        model=MODEL,
        input="hi",
        background=True,
        extra_body=mock_body(tokens=5000, token_delay=0.01),
    )
    (seen,) = up.wait_requests(1, path=RESPONSES)
    server = a if where == "client" else b
    assert sdk(server).responses.cancel(created.id).status == "cancelled"
    up.wait_event(seen.disconnected)
    assert finished(sdk(b), created.id).status == "cancelled"


def test_delete_through_another_process_stops_a_stream(pair) -> None:
    a, b, up = pair
    body = body_for(CHAT, stream=True, tokens=5000, token_delay=0.01)
    stream_until(a, CHAT, body, "stop-me", 10)
    (seen,) = up.wait_requests(1, path=CHAT)
    assert httpx.delete(b.url + "/v1/stream/stop-me").status_code == 204
    up.wait_event(seen.disconnected)
    assert replay(a, "stop-me", 0).status_code == 404


def test_the_client_process_going_away_leaves_the_generation_running(pair) -> None:
    a, b, up = pair
    body = body_for(CHAT, stream=True, tokens=400, token_delay=0.005)
    whole = direct(up, CHAT, body).content
    raw_post(a, CHAT, body, "x-conversation-id: orphaned-client")
    up.wait_requests(2, path=CHAT)
    a.kill()  # the process the client reached dies; the worker's process writes on
    assert replay(b, "orphaned-client", 0).content == whole
    assert not up.requests_to(CHAT)[-1].disconnected.is_set()


def test_the_writing_process_dying_ends_the_log_with_the_error_event(pair) -> None:
    a, b, _ = pair
    body = body_for(CHAT, stream=True, tokens=5000, token_delay=0.01)
    head = stream_until(a, CHAT, body, "orphaned-writer", 2000)
    b.kill()  # the writer is gone: the next reader to notice ends the log
    seen = replay(a, "orphaned-writer", len(head))
    assert seen.status_code == 200
    assert b'"error"' in seen.content.rsplit(b"data: ", 1)[1]
    found = lookup_done(a, "orphaned-writer")
    assert found["is_done"] and found["total_bytes"] == len(head) + len(seen.content)
