"""Speed-aware routing end to end (SPEC §21): a live server, two real ``worker.py`` and two
fake backends, one three times faster than the other (each processes one prompt at a
time, at a known rate): learned rates and predictions against what was measured,
deadlines refused at once and in the queue, a stalled priority stream hedged and
charged once, a box that slows down losing its traffic."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.cacheupstream import UpstreamPool, caching_upstreams
from tests.live import LiveServer, live_server
from tests.server.test_live_security import exchange, post_head, status_of
from tests.test_e2e import poll, running_worker, workers_connected

pytestmark = pytest.mark.live

MODEL = "mock-model"
CHAT = "/v1/chat/completions"
ADMIN = "speed-admin-token"
#: The slower box processes this many prompt tokens a second; the other three times as
#: many (one prompt at a time each, like a GPU).
RATE = 2500.0


class Rig:
    def __init__(self, server: LiveServer, pool: UpstreamPool) -> None:
        self.server = server
        self.pool = pool
        self.client = httpx.Client(base_url=server.url, timeout=30)
        self.admin = {"authorization": f"Bearer {ADMIN}"}
        self.key = self.new_key("speed")["secret"]

    def new_key(self, name: str, **limits: Any) -> dict[str, Any]:
        """A new API key, once the server took it (its key table is reloaded)."""
        made = self.client.post("/admin/keys", json={"name": name, **limits}, headers=self.admin)
        assert made.status_code == 201, made.text
        key = dict(made.json())
        auth = {"authorization": f"Bearer {key['secret']}"}
        poll(lambda: self.client.get("/v1/models", headers=auth).status_code == 200, what="key")
        return key

    def chat(
        self,
        size: int,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        path: str = CHAT,
    ) -> tuple[httpx.Response, float]:
        """A streamed request with a fresh prompt of ``size`` bytes: the response (read
        whole) and the seconds to its first body byte."""
        content = secrets.token_hex(4) + " " + "w" * size
        body = {"model": MODEL, "stream": True, "max_tokens": 8}
        body["messages"] = [{"role": "user", "content": content}]
        started = time.perf_counter()
        first = None
        with self.client.stream(
            "POST",
            path,
            json=body,
            headers={"authorization": f"Bearer {key or self.key}", **(headers or {})},
        ) as response:
            chunks = []
            for chunk in response.iter_bytes():
                if first is None:
                    first = time.perf_counter() - started
                chunks.append(chunk)
            response._content = b"".join(chunks)
        return response, first if first is not None else time.perf_counter() - started

    def workers(self) -> list[dict[str, Any]]:
        return list(self.client.get("/admin/workers", headers=self.admin).json())

    def speed_of(self, box: int) -> dict[str, Any]:
        (row,) = [w for w in self.workers() if w["name"] == f"box-{box}"]
        (speed,) = row["speeds"]
        return dict(speed)

    def stats(self) -> dict[str, Any]:
        return dict(self.client.get("/admin/stats", headers=self.admin).json()["speed"])


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with ExitStack() as stack:
        pool = stack.enter_context(
            caching_upstreams(
                2,
                speeds=[1.0, 3.0],
                model=MODEL,
                cost_per_token=1 / RATE,
                serial_prefill=True,
                reply_tokens=4,
            )
        )
        server = stack.enter_context(
            live_server(
                tmp_path_factory.mktemp("speeds") / "server",
                MODELRELAY_ADMIN_TOKEN=ADMIN,
                MODELRELAY_REQUIRE_API_KEYS="true",
                ROUTING_POLICY="predicted",
                RATES_HALF_LIFE_SECS="3",
                HEDGE_MAX_SHARE="1",
                HEDGE_MIN_DELAY_MS="30",
                REQUEST_LOG_FLUSH_SECS="0.2",
                SYNC_SECS="0.2",
            )
        )
        flags = ["--models", MODEL, "--max-concurrent", "4"]
        for i, up in enumerate(pool.upstreams):
            stack.enter_context(running_worker(server, up.url, *flags, "--worker-name", f"box-{i}"))
        poll(lambda: workers_connected(server) == 2, what="two workers")
        rig = Rig(server, pool)
        yield rig
        rig.client.close()


def rounds(rig: Rig, count: int, sizes: tuple[int, ...]) -> list[float]:
    """``count`` rounds of one request per size at once; the times to first byte."""
    seen: list[float] = []

    def one(size: int) -> None:
        response, ttft = rig.chat(size)
        assert response.status_code == 200, response.text
        seen.append(ttft)

    for _ in range(count):
        threads = [threading.Thread(target=one, args=(size,)) for size in sizes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    return seen


def test_rates_are_learned_and_predictions_follow_the_measured_time_to_first_byte(rig: Rig):
    rounds(rig, 8, (400, 2400, 4800, 800))
    slow, fast = rig.speed_of(0), rig.speed_of(1)
    assert slow["learned"] and fast["learned"]
    # The fakes' own rates: 2,500 and 7,500 prompt tokens a second (4 bytes a token).
    assert 0.6 * RATE < slow["prefill_tokens_per_sec"] < 1.5 * RATE, slow
    assert 0.6 * 3 * RATE < fast["prefill_tokens_per_sec"] < 1.5 * 3 * RATE, fast
    for row in (slow, fast):
        # Within a factor of two: a machine running other tests adds its own stalls to
        # what is measured (a unit or sign error would be off by far more).
        assert 0.5 < row["predicted_ttft_ms"] / row["measured_ttft_ms"] < 2.0, row
        assert row["decode_tokens_per_sec"] > 0 and 0 < row["confidence"] < 1
    # The fast box took most of the work, the long prompts above all.
    served = rig.pool.served
    assert sum(s.index == 1 for s in served) > sum(s.index == 0 for s in served)
    metrics = rig.client.get("/metrics").text
    assert 'modelrelay_worker_prefill_tokens_per_second{model="mock-model"' in metrics
    assert 'kind="measured"' in metrics and 'kind="predicted"' in metrics
    assert rig.stats()["bytes_per_token"][MODEL] > 0


def test_a_deadline_no_worker_can_meet_is_refused_at_once_in_the_endpoints_envelope(rig: Rig):
    before = len(rig.pool.served)
    response, _ = rig.chat(4800, headers={"X-Deadline-Ms": "5"})
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == "deadline_unmeetable"
    assert "within the deadline of 5 ms: the predicted wait is" in error["message"]
    anthropic = rig.client.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": rig.key, "x-deadline-ms": "1", "anthropic-version": "2023-06-01"},
    )
    assert anthropic.status_code == 503
    assert anthropic.json()["error"]["type"] == "overloaded_error"
    assert len(rig.pool.served) == before  # neither reached a backend
    ok, _ = rig.chat(400, headers={"X-Deadline-Ms": "20000"})
    assert ok.status_code == 200
    assert rig.stats()["deadlines"]["refused"] == 2


@pytest.mark.parametrize(
    "value",
    [b"abc", b"-1", b"0", b"1.5", b"3600001", b"99999999999999999999", "١٢٣".encode(), b"\xff"],
)
async def test_a_deadline_header_that_is_not_a_bounded_whole_number_is_a_clear_400(
    rig: Rig, value: bytes
):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    head = post_head(Content_Length=str(len(body)), Authorization=f"Bearer {rig.key}")
    head = head[:-2] + b"X-Deadline-Ms: " + value + b"\r\n\r\n"
    response = await exchange(rig.server, head + body.encode(), until=b"}}")
    assert status_of(response) == 400
    assert b"X-Deadline-Ms must be a whole number of milliseconds from 1 to 3600000" in response


def test_a_keys_default_deadline_applies_when_a_request_states_none(rig: Rig):
    made = rig.new_key("hurried", deadline_ms=1)
    assert made["deadline_ms"] == 1
    refused, _ = rig.chat(800, key=made["secret"])
    assert refused.status_code == 503
    assert "deadline of 1 ms" in refused.json()["error"]["message"]
    stated, _ = rig.chat(800, key=made["secret"], headers={"X-Deadline-Ms": "20000"})
    assert stated.status_code == 200
    for bad in (0, 3_600_001, "1"):
        patched = rig.client.patch(
            f"/admin/keys/{made['id']}", json={"deadline_ms": bad}, headers=rig.admin
        )
        assert patched.status_code == 400, patched.text
    lifted = rig.client.patch(
        f"/admin/keys/{made['id']}", json={"deadline_ms": None}, headers=rig.admin
    )
    assert lifted.status_code == 200 and lifted.json()["deadline_ms"] is None
    poll(lambda: rig.chat(800, key=made["secret"])[0].status_code == 200, what="key reloaded")


def test_a_stalled_priority_stream_is_hedged_answered_once_and_charged_once(rig: Rig):
    key = rig.new_key("urgent", default_class="priority", max_class="priority")
    rig.pool.set(1, stall_every=1, stall_secs=4.0)  # the fast box stalls every request
    try:
        before = len(rig.pool.served)
        response, ttft = rig.chat(400, key=key["secret"])
    finally:
        rig.pool.set(1, stall_every=0)
    assert response.status_code == 200
    assert ttft < 2.0  # not the 4 s stall: the hedge on the other box answered
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in response.text.splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    )
    assert text.count("from upstream 0") == 1 and "upstream 1" not in text
    attempts = rig.pool.served[before:]
    assert sorted(s.index for s in attempts) == [0, 1] and attempts[0].stalled
    hedges = rig.stats()["hedges"]
    assert (hedges["sent"], hedges["won"]) == (1, 1)
    winner = next(s for s in attempts if s.index == 0)

    def charged() -> bool:
        rows = rig.client.get("/admin/keys", headers=rig.admin).json()
        (row,) = [r for r in rows if r["id"] == key["id"]]
        return bool(row["requests"] == 1 and row["prompt_tokens"] == winner.prompt_tokens)

    poll(charged, what="one request charged to the key")


def test_a_queued_request_leaves_with_the_same_answer_when_its_deadline_can_no_longer_be_met(
    rig: Rig,
):
    rig.pool.hold()  # every answer waits from now on
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(rig.chat(400)[0].status_code))
        for _ in range(8)
    ]
    try:
        for thread in threads:
            thread.start()
        poll(lambda: rig.pool.in_flight() == 8, what="every slot taken")
        started = time.perf_counter()
        response, _ = rig.chat(400, headers={"X-Deadline-Ms": "1500"})  # admitted, queued
        waited = time.perf_counter() - started
    finally:
        rig.pool.release()
        for thread in threads:
            thread.join(30)
    assert response.status_code == 503
    assert "within the deadline of 1500 ms" in response.json()["error"]["message"]
    assert 1.0 < waited < 2.5  # it left at its last moment, not at the queue timeout
    assert statuses == [200] * 8
    assert rig.stats()["deadlines"]["expired"] == 1


def test_a_box_that_slows_down_loses_its_traffic(rig: Rig):
    rig.pool.set(1, cost_per_token=10 / RATE)  # the fast box is now ten times slower
    try:
        recent: list[int] = []
        deadline = time.monotonic() + 45  # "within a minute", with a 3 s half-life
        while time.monotonic() < deadline:
            before = len(rig.pool.served)
            response, _ = rig.chat(1600)
            assert response.status_code == 200
            recent = ([*recent, rig.pool.served[before].index])[-6:]
            if recent == [0] * 6:
                break
        assert recent == [0] * 6, recent

        def predicted(box: int, tokens: int = 400) -> float:
            # What the relay now expects of each box for a prompt of this size (its
            # learned overhead and rate together: a busy machine may move either).
            speed = rig.speed_of(box)
            return speed["overhead_ms"] / 1000 + tokens / speed["prefill_tokens_per_sec"]

        assert predicted(1) > predicted(0)
    finally:
        rig.pool.set(1, cost_per_token=1 / (3 * RATE))
