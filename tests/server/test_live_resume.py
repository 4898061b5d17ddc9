"""Responses that outlive their connection (SPEC §18), end to end: a live server, the
real ``worker.py``, the fake upstream, and the ``openai`` SDK or raw HTTP clients that
drop at every stage and come back.

Timings are shrunk through env; waits poll a predicate with a bound.
"""

from __future__ import annotations

import json
import random
import socket
import sqlite3
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.live import LiveServer, live_server
from tests.test_e2e import (
    CHAT,
    JSON,
    MESSAGES,
    MODEL,
    RESPONSES,
    Stack,
    body_for,
    direct,
    metric,
    poll,
    running_worker,
    serving,
)
from tests.upstream import expected_text, upstream_in_thread

pytestmark = pytest.mark.live

ADMIN = "resume-admin"


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests that leave it as they found it."""
    with (
        upstream_in_thread(total_slots=4) as up,
        live_server(
            tmp_path_factory.mktemp("resume") / "server",
            MODELRELAY_ADMIN_TOKEN=ADMIN,
            REQUEST_LOG_FLUSH_SECS="0.05",
        ) as server,
        serving(server, up) as stack,
    ):
        yield stack


def sdk(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def resumable_rows(server: LiveServer) -> list[tuple[Any, ...]]:
    """(endpoint, outcome, resumable, prompt, completion tokens) of the request log."""
    path = server.env["DATABASE_URL"].removeprefix("sqlite:///")
    sql = (
        "SELECT endpoint, outcome, resumable, prompt_tokens, completion_tokens "
        "FROM workers_app_requestlog WHERE resumable != '' ORDER BY id"
    )
    with sqlite3.connect(path) as db:
        return [tuple(row) for row in db.execute(sql)]


def stats(server: LiveServer) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.get(server.url + "/admin/stats", headers=headers, timeout=5).json()["streams"][
        "resumable"
    ]


def event_key(event: Any) -> tuple[str, int, str]:
    return (event.type, event.sequence_number, getattr(event, "delta", ""))


def finished(client: openai.OpenAI, response_id: str) -> Any:
    found: dict[str, Any] = {}

    def done() -> bool:
        found["r"] = client.responses.retrieve(response_id)
        return found["r"].status not in ("queued", "in_progress")

    poll(done, what=f"{response_id} to end")
    return found["r"]


def mock_body(**mock: Any) -> dict[str, Any]:
    return {"mock": mock}


# --------------------------------------------------------------------- background mode


def test_the_openai_sdk_runs_a_background_response_and_reattaches_after_any_event(
    kept: Stack,
) -> None:
    client = sdk(kept.server)
    before = len(kept.upstream.requests_to(RESPONSES))
    created = client.responses.create(
        model=MODEL, input="hi", background=True, extra_body=mock_body(tokens=40, token_delay=0.005)
    )
    assert created.status == "queued" and created.background
    assert created.id.startswith("resp_")
    final = finished(client, created.id)
    assert (final.status, final.id, final.background) == ("completed", created.id, True)
    assert final.output_text == expected_text(40)
    everything = list(client.responses.retrieve(created.id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert everything[0].type == "response.queued"
    assert everything[-1].type == "response.completed"
    assert {e.response.id for e in everything if hasattr(e, "response")} == {created.id}
    text = "".join(e.delta for e in everything if e.type == "response.output_text.delta")
    assert text == expected_text(40)
    for after in (0, 5, len(everything) - 2, len(everything) - 1):
        again = list(client.responses.retrieve(created.id, stream=True, starting_after=after))
        assert [event_key(e) for e in again] == [event_key(e) for e in everything[after + 1 :]]
    # The backend got one ordinary streaming request.
    (seen,) = kept.upstream.requests_to(RESPONSES)[before:]
    sent = seen.json()
    assert sent["stream"] is True and "background" not in sent
    # Logged and charged as any request.
    poll(lambda: ("/v1/responses", "ok", "background", 7, 40) in resumable_rows(kept.server))


def test_a_background_stream_dropped_mid_way_resumes_with_the_same_events(kept: Stack) -> None:
    client = sdk(kept.server)
    before = len(kept.upstream.requests_to(RESPONSES))
    first: list[Any] = []
    with client.responses.create(
        model=MODEL,
        input="hi",
        background=True,
        stream=True,
        extra_body=mock_body(tokens=60, token_delay=0.01),
    ) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 8:
                break  # the client drops here
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=7))
    joined = first + rest
    assert [e.sequence_number for e in joined] == list(range(len(joined)))
    uninterrupted = list(client.responses.retrieve(response_id, stream=True))
    assert [event_key(e) for e in joined] == [event_key(e) for e in uninterrupted]
    text = "".join(e.delta for e in joined if e.type == "response.output_text.delta")
    assert text == expected_text(60)
    (seen,) = kept.upstream.requests_to(RESPONSES)[before:]
    assert not seen.disconnected.is_set()  # the drop cancelled nothing


def test_a_background_response_dropped_before_its_first_byte_still_runs(kept: Stack) -> None:
    client = sdk(kept.server)
    with client.responses.create(
        model=MODEL,
        input="hi",
        background=True,
        stream=True,
        extra_body=mock_body(tokens=3, first_byte_delay=0.3),
    ) as stream:
        queued = next(iter(stream))
    assert queued.type == "response.queued" and queued.sequence_number == 0
    final = finished(client, queued.response.id)
    assert final.status == "completed" and final.output_text == expected_text(3)


def test_cancel_stops_a_running_background_response_at_the_backend(kept: Stack) -> None:
    client = sdk(kept.server)
    before = len(kept.upstream.requests_to(RESPONSES))
    created = client.responses.create(
        model=MODEL,
        input="hi",
        background=True,
        extra_body=mock_body(tokens=5000, token_delay=0.01),
    )
    (seen,) = kept.upstream.wait_requests(before + 1, path=RESPONSES)[before:]
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    kept.upstream.wait_event(seen.disconnected)
    assert finished(client, created.id).status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # again: as it is
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 48)


def test_a_failed_backend_answer_fails_the_background_response(kept: Stack) -> None:
    client = sdk(kept.server)
    error = {"error": {"message": "bad input", "type": "invalid_request_error", "code": "x"}}
    created = client.responses.create(
        model=MODEL, input="hi", background=True, extra_body=mock_body(status=400, error_body=error)
    )
    final = finished(client, created.id)
    assert final.status == "failed" and final.error is not None
    assert final.error.message == "bad input"
    events = list(client.responses.retrieve(created.id, stream=True))
    assert [e.type for e in events] == ["response.queued", "error"]


# ------------------------------------------------------------- llama.cpp's protocol


def stream_until(server: LiveServer, path: str, body: bytes, conversation: str, size: int) -> bytes:
    """Start a stream with ``X-Conversation-Id`` and drop it once ``size`` bytes came."""
    got = b""
    headers = {**JSON, "x-conversation-id": conversation}
    with httpx.stream("POST", server.url + path, content=body, headers=headers, timeout=10) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += chunk
            if len(got) >= size:
                break
    return got


def replay(server: LiveServer, conversation: str, start: int, **params: str) -> httpx.Response:
    return httpx.get(
        f"{server.url}/v1/stream/{conversation}", params={"from": start, **params}, timeout=10
    )


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", MESSAGES])
def test_a_stream_dropped_at_a_random_byte_resumes_byte_for_byte(kept: Stack, path: str) -> None:
    body = body_for(path, stream=True, tokens=80, token_delay=0.005, split_utf8=True)
    whole = direct(kept.upstream, path, body).content
    before = len(kept.upstream.requests_to(path))
    at = random.Random(path).randrange(1, len(whole) - 1)
    conversation = f"conv-{path.rsplit('/', 1)[1]}"
    head = stream_until(kept.server, path, body, conversation, at)
    rest = replay(kept.server, conversation, len(head))
    assert rest.status_code == 200 and rest.headers["content-type"].startswith("text/event-stream")
    assert head + rest.content == whole
    # llama.cpp's query form says the same.
    query = httpx.get(
        kept.server.url + "/v1/stream", params={"conv_id": conversation, "from": 0}, timeout=10
    )
    assert query.content == whole
    (seen,) = kept.upstream.requests_to(path)[before:]
    assert not seen.disconnected.is_set()
    (found,) = httpx.post(
        kept.server.url + "/v1/streams/lookup", json={"conversation_ids": [conversation]}
    ).json()
    assert found["conversation_id"] == conversation and found["is_done"]
    assert found["total_bytes"] == len(whole) and found["completed_at"] >= found["started_at"]


def test_a_stream_dropped_before_its_first_byte_runs_and_is_replayed_whole(kept: Stack) -> None:
    body = body_for(CHAT, stream=True, tokens=5, first_byte_delay=0.3)
    whole = direct(kept.upstream, CHAT, body).content
    headers = "content-type: application/json\r\nx-conversation-id: early\r\n"
    with socket.create_connection(("127.0.0.1", kept.server.port), timeout=10) as sock:
        sock.sendall(
            f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\n{headers}"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
    # It follows the live bytes from the first to the end.
    assert replay(kept.server, "early", 0).content == whole


def test_delete_stops_a_running_stream_and_forgets_it(kept: Stack) -> None:
    before = len(kept.upstream.requests_to(CHAT))
    body = body_for(CHAT, stream=True, tokens=5000, token_delay=0.01)
    stream_until(kept.server, CHAT, body, "stopped", 10)
    (seen,) = kept.upstream.wait_requests(before + 1, path=CHAT)[before:]
    assert httpx.delete(kept.server.url + "/v1/stream/stopped").status_code == 204
    kept.upstream.wait_event(seen.disconnected)
    assert replay(kept.server, "stopped", 0).status_code == 404
    assert httpx.delete(kept.server.url + "/v1/stream?conv_id=stopped").status_code == 204


def test_a_new_stream_of_a_conversation_replaces_the_running_one(kept: Stack) -> None:
    before = len(kept.upstream.requests_to(CHAT))
    slow = body_for(CHAT, stream=True, tokens=5000, token_delay=0.01)
    stream_until(kept.server, CHAT, slow, "again", 10)
    (first,) = kept.upstream.wait_requests(before + 1, path=CHAT)[before:]
    quick = body_for(CHAT, stream=True, tokens=3)
    whole = direct(kept.upstream, CHAT, quick).content
    assert stream_until(kept.server, CHAT, quick, "again", 1 << 30) == whole
    kept.upstream.wait_event(first.disconnected)
    assert replay(kept.server, "again", 0).content == whole


def test_streams_that_ask_for_nothing_are_not_kept(kept: Stack) -> None:
    retained = stats(kept.server)["retained"]
    body = body_for(CHAT, stream=True, tokens=3)
    response = httpx.post(kept.server.url + CHAT, content=body, headers=JSON, timeout=10)
    assert response.status_code == 200
    background_false = json.dumps({"model": MODEL, "input": "hi", "background": False}).encode()
    assert (
        httpx.post(kept.server.url + RESPONSES, content=background_false, headers=JSON).json()[
            "status"
        ]
        == "completed"
    )
    # X-Conversation-Id on a request that does not stream: nothing to replay, nothing kept.
    unary = httpx.post(
        kept.server.url + CHAT,
        content=body_for(CHAT),
        headers={**JSON, "x-conversation-id": "unary"},
    )
    assert unary.status_code == 200
    assert stats(kept.server)["retained"] == retained
    assert replay(kept.server, "unary", 0).status_code == 404


# --------------------------------------------------------------------- input limits


def test_every_new_route_refuses_what_is_out_of_bounds(kept: Stack) -> None:
    url = kept.server.url
    longest, over = "i" * 256, "i" * 257
    assert replay(kept.server, longest, 0).status_code == 404
    assert replay(kept.server, over, 0).status_code == 400
    assert httpx.get(f"{url}/v1/responses/{over}").status_code == 400
    assert httpx.post(f"{url}/v1/responses/{over}/cancel").status_code == 400
    assert httpx.get(f"{url}/v1/stream/caf%C3%A9").status_code == 400  # not ASCII
    assert httpx.get(f"{url}/v1/stream").status_code == 400  # no id
    body = body_for(CHAT, stream=True, tokens=2)
    whole = stream_until(kept.server, CHAT, body, "limits", 1 << 30)
    for bad in ("-1", "abc", "1e3", "+5", "1" * 20, "٣"):
        answer = replay(kept.server, "limits", bad)  # type: ignore[arg-type]
        assert answer.status_code == 400, bad
        assert "from" in answer.json()["error"]["message"]
    assert replay(kept.server, "limits", "0" * 19).content == whole  # type: ignore[arg-type]
    huge = replay(kept.server, "limits", "9" * 19)  # type: ignore[arg-type]
    assert huge.status_code == 200 and huge.content == b""
    created = sdk(kept.server).responses.create(model=MODEL, input="hi", background=True)
    for bad in ("-1", "x", "1" * 20):
        answer = httpx.get(
            f"{url}/v1/responses/{created.id}", params={"stream": "true", "starting_after": bad}
        )
        assert answer.status_code == 400, bad
    assert (
        httpx.get(f"{url}/v1/responses/{created.id}", params={"stream": "maybe"}).status_code == 400
    )
    # Lookups: the most ids, each of the longest length, escaped: accepted; one more: not.
    escaped = '"' + "\\u0061" * 256 + '"'
    most = ('{"conversation_ids":[' + ",".join([escaped] * 64) + "]}").encode()
    assert len(most) <= 128 * 1024
    lookup = f"{url}/v1/streams/lookup"
    assert httpx.post(lookup, content=most).json() == []
    not_ascii = json.dumps({"conversation_ids": ["é"]})
    assert httpx.post(lookup, content=not_ascii).status_code == 400
    assert httpx.post(lookup, json={"conversation_ids": ["a"] * 65}).status_code == 400
    assert httpx.post(lookup, json={"conversation_ids": [over]}).status_code == 400
    ignored = httpx.post(lookup, json={"conversation_ids": [1, None, "", {"x": 1}, "limits"]})
    assert [f["conversation_id"] for f in ignored.json()] == ["limits"]
    assert httpx.post(lookup, content=b"x" * (128 * 1024 + 1)).status_code == 413
    assert httpx.post(lookup, content=b"[1,2").status_code == 400
    # Methods.
    assert httpx.put(f"{url}/v1/stream/limits").status_code == 405
    assert httpx.get(lookup).status_code == 405
    assert httpx.delete(f"{url}/v1/responses/{created.id}").status_code == 405
    assert httpx.get(f"{url}/v1/responses/{created.id}/cancel").status_code == 405
    # The header.
    for value in (over, "é"):
        raw = {b"content-type": b"application/json", b"x-conversation-id": value.encode()}
        refused = httpx.post(url + CHAT, content=body, headers=raw)
        assert refused.status_code == 400
    background = json.dumps({"model": MODEL, "input": "hi", "background": "yes"}).encode()
    assert httpx.post(url + RESPONSES, content=background, headers=JSON).status_code == 400


def test_the_largest_log_keeps_its_newest_bytes(kept: Stack) -> None:
    # Over the per-response bound (8 MiB): 129 events, each after a 64 KiB comment.
    body = body_for(CHAT, stream=True, tokens=126, padding=64 * 1024)
    whole = direct(kept.upstream, CHAT, body).content
    assert len(whole) > 8 * 1024 * 1024
    raw_post(kept.server, CHAT, body, "x-conversation-id: large").close()
    assert lookup_done(kept.server, "large")["total_bytes"] == len(whole)
    assert replay(kept.server, "large", 0).status_code == 410
    answer = replay(kept.server, "large", len(whole) - 7_900_000)
    assert answer.status_code == 200 and answer.content == whole[-7_900_000:]


def test_reattaches_show_in_metrics(kept: Stack) -> None:
    before = metric(kept.server, "modelrelay_stream_reattaches_total")
    sent = metric(kept.server, "modelrelay_stream_replayed_bytes_total")
    body = body_for(CHAT, stream=True, tokens=2)
    whole = stream_until(kept.server, CHAT, body, "counted", 1 << 30)
    assert replay(kept.server, "counted", 0).content == whole
    assert metric(kept.server, "modelrelay_stream_reattaches_total") == before + 1
    assert metric(kept.server, "modelrelay_stream_replayed_bytes_total") == sent + len(whole)
    assert metric(kept.server, "modelrelay_streams_retained") >= 1
    assert metric(kept.server, "modelrelay_streams_retained_bytes") >= len(whole)
    shown = stats(kept.server)
    assert shown["store"] == "memory" and shown["reattaches"] >= 1


# ---------------------------------------------------------- keys, bounds, expiry, loss


def keys(server: LiveServer, *names: str) -> list[str]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    made = [
        httpx.post(server.url + "/admin/keys", json={"name": n}, headers=headers).json()
        for n in names
    ]
    return [m["secret"] for m in made]


def test_another_key_sees_nothing_and_one_key_holds_a_bounded_number(relay_server_factory) -> None:
    with (
        upstream_in_thread(total_slots=4) as up,
        relay_server_factory(
            MODELRELAY_REQUIRE_API_KEYS="true",
            MODELRELAY_ADMIN_TOKEN=ADMIN,
            STREAM_RETAIN_PER_KEY="2",
            SYNC_SECS="0.2",
        ) as server,
        running_worker(server, up.url),
    ):
        mine, theirs = keys(server, "mine", "theirs")
        for key in (mine, theirs):
            auth = {"Authorization": f"Bearer {key}"}

            def listed(headers: dict[str, str] = auth) -> bool:
                answer = httpx.get(server.url + "/v1/models", headers=headers)
                return answer.status_code == 200 and bool(answer.json()["data"])

            poll(listed, what="the keys and the worker")
        owner, other = sdk(server, mine), sdk(server, theirs)
        slow = mock_body(tokens=5000, token_delay=0.01)
        running = [
            owner.responses.create(model=MODEL, input="hi", background=True, extra_body=slow)
            for _ in range(2)
        ]
        with pytest.raises(openai.RateLimitError) as refused:
            owner.responses.create(model=MODEL, input="hi", background=True)
        assert refused.value.response.headers["retry-after"]
        response_id = running[0].id
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response_id, stream=True)
        with pytest.raises(openai.NotFoundError):
            other.responses.cancel(response_id)
        assert owner.responses.retrieve(response_id).status in ("queued", "in_progress")
        # Their stream of the same conversation id is theirs alone.
        auth = {"Authorization": f"Bearer {theirs}"}
        lookup = httpx.post(
            server.url + "/v1/streams/lookup",
            json={"conversation_ids": [response_id]},
            headers=auth,
        )
        assert lookup.json() == []
        for created in running:
            assert owner.responses.cancel(created.id).status == "cancelled"
        # Ended ones make room.
        made = owner.responses.create(model=MODEL, input="hi", background=True)
        assert finished(owner, made.id).status == "completed"
        assert other.responses.create(model=MODEL, input="hi", background=True).status == "queued"


def lookup_done(server: LiveServer, conversation: str) -> dict[str, Any]:
    """The conversation's stream once it ended (polled)."""
    found: dict[str, Any] = {}

    def done() -> bool:
        answer = httpx.post(
            server.url + "/v1/streams/lookup", json={"conversation_ids": [conversation]}
        ).json()
        found.update(answer[0] if answer else {})
        return bool(found.get("is_done"))

    poll(done, what=f"{conversation} to end")
    return found


def test_a_log_past_its_bound_keeps_its_newest_bytes(relay_server_factory) -> None:
    with (
        upstream_in_thread(total_slots=4) as up,
        relay_server_factory(STREAM_RETAIN_BYTES="4096") as server,
        serving(server, up),
    ):
        body = body_for(CHAT, stream=True, tokens=200)
        whole = direct(up, CHAT, body).content
        # Its client leaves at once: the stream runs on, its log within 4 KiB.
        raw_post(server, CHAT, body, "x-conversation-id: bounded").close()
        assert lookup_done(server, "bounded")["total_bytes"] == len(whole)
        gone = replay(server, "bounded", 0)
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "stream_offset_lost"
        tail = replay(server, "bounded", len(whole) - 2000)
        assert tail.content == whole[-2000:]


def test_an_ended_response_is_forgotten_after_the_retention(relay_server_factory) -> None:
    with (
        upstream_in_thread(total_slots=4) as up,
        relay_server_factory(STREAM_RETAIN_SECS="0.5") as server,
        serving(server, up),
    ):
        client = sdk(server)
        created = client.responses.create(model=MODEL, input="hi", background=True)
        raw_post(server, CHAT, body_for(CHAT, stream=True), "x-conversation-id: short").close()
        lookup_done(server, "short")
        answer = f"{server.url}/v1/responses/{created.id}"
        poll(lambda: httpx.get(answer).status_code == 404, what="the response to expire")
        poll(lambda: replay(server, "short", 0).status_code == 404, what="the stream to expire")


def raw_post(server: LiveServer, path: str, body: bytes, *headers: str) -> socket.socket:
    """A client that sent its request and reads nothing (closing it leaves)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    extra = "".join(f"{h}\r\n" for h in headers)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"{extra}content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def queue_depth(server: LiveServer) -> int:
    return int(httpx.get(server.url + "/health", timeout=5).json()["queue_depth"])


def test_a_background_response_dropped_while_queued_runs_when_a_slot_frees(
    relay_server: LiveServer,
) -> None:
    with upstream_in_thread(total_slots=1) as up, serving(relay_server, up):
        blocker = raw_post(relay_server, CHAT, body_for(CHAT, stream=True, hang=True))
        up.wait_requests(1, path=CHAT)
        client = sdk(relay_server)
        with client.responses.create(
            model=MODEL, input="hi", background=True, stream=True, extra_body=mock_body(tokens=4)
        ) as stream:
            queued: Any = next(iter(stream))
        response_id = queued.response.id
        poll(lambda: queue_depth(relay_server) == 1, what="the response to wait in the queue")
        assert client.responses.retrieve(response_id).status == "queued"
        blocker.close()  # its client leaves: the slot frees
        final = finished(client, response_id)
        assert final.status == "completed" and final.output_text == expected_text(4)
        assert len(up.requests_to(RESPONSES)) == 1


def test_a_worker_dying_mid_stream_ends_the_log_as_the_live_client_saw_it(
    relay_server: LiveServer,
) -> None:
    with upstream_in_thread(total_slots=4) as up, serving(relay_server, up) as stack:
        client = sdk(relay_server)
        slow = mock_body(tokens=5000, token_delay=0.01)
        background = client.responses.create(
            model=MODEL, input="hi", background=True, extra_body=slow
        )
        body = body_for(CHAT, stream=True, tokens=5000, token_delay=0.01)
        headers = {**JSON, "x-conversation-id": "dies"}
        live = b""
        with httpx.stream(
            "POST", relay_server.url + CHAT, content=body, headers=headers, timeout=10
        ) as response:
            for chunk in response.iter_raw():
                live += chunk
                if len(live) > 2000 and stack.worker.process.poll() is None:
                    stack.worker.stop()  # killed: its socket drops mid-stream
        assert b'"error"' in live.rsplit(b"data: ", 1)[1]
        assert replay(relay_server, "dies", 0).content == live
        final = finished(client, background.id)
        assert final.status == "failed" and final.error is not None
        events = list(client.responses.retrieve(background.id, stream=True))
        assert events[-1].type == "error"
        assert [e.sequence_number for e in events] == list(range(len(events)))
