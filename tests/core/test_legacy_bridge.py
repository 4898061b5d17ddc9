"""A legacy node connection as a worker of the core (SPEC §12 with §6 semantics),
driven frame by frame through :class:`NodeBridge` with a recording transport."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass, field

import pytest

from relay.core.legacy import frames
from relay.core.legacy.bridge import BridgeConfig, NodeBridge
from relay.core.relay import Relay
from relay.core.state import CANCELLED, Completion, Phase, RelayRequest, Worker
from relay.wire.errors import BadRequest, StreamTooLarge, WorkerLost
from tests.corekit import FAST, attach, make_relay

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"


@dataclass
class Transport:
    texts: list[str] = field(default_factory=list)
    closed: tuple[int, str] | None = None

    def send_text(self, text: str) -> None:
        assert self.closed is None, "frame sent after close"
        self.texts.append(text)

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    @property
    def tasks(self) -> list[dict]:
        return [d for d in map(json.loads, self.texts) if "state" in d]

    @property
    def stops(self) -> list[int]:
        return [d["id"] for d in map(json.loads, self.texts) if d.get("stop") is True]


def node(
    relay: Relay, *, max_concurrent: int = 2, config: BridgeConfig | None = None, name: str = "old"
) -> tuple[Worker, NodeBridge, Transport]:
    transport = Transport()
    bridge = NodeBridge(relay, transport, config or BridgeConfig(), identity=("local", name, "m"))
    worker, _ = relay.attach_worker(
        provider="local",
        name=name,
        models=["m"],
        max_concurrent=max_concurrent,
        current_load=0,
        link=bridge,
        protocol_version=frames.LEGACY_PROTOCOL,
        refuses=bridge.refuses,
    )
    bridge.worker = worker
    return worker, bridge, transport


def ask(
    relay: Relay, path: str = CHAT, *, stream: bool = False, **document: object
) -> RelayRequest:
    document.setdefault("model", "m")
    if path == MESSAGES:
        document.setdefault("max_tokens", 16)
    document.setdefault("messages", [{"role": "user", "content": "hi"}])
    return relay.submit(
        model="m",
        endpoint_path=path,
        flavor="anthropic" if path == MESSAGES else "openai",
        is_streaming=stream,
        body=json.dumps(document),
        headers={},
    )


async def drain(request: RelayRequest, timeout: float = 2.0) -> tuple[bytes, object]:
    """Everything streamed to the client, and the terminal event."""
    streamed = b""
    async with asyncio.timeout(timeout):
        while True:
            for event in await request.next_events():
                if isinstance(event, bytes):
                    streamed += event
                else:
                    return streamed, event


def result(task_id: int, text: str | bytes = b"") -> bytes:
    return frames.result_frame(task_id, text.encode() if isinstance(text, str) else text)


async def test_a_request_becomes_a_task_and_the_deltas_a_stream():
    relay = make_relay()
    worker, bridge, transport = node(relay)
    request = ask(
        relay,
        stream=True,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
    )
    (task,) = transport.tasks
    assert task["id"] == 1 and task["state"] == 0
    assert (task["system"], task["messages"]) == ("s", [{"role": "user", "content": "q"}])
    bridge.on_binary(result(1, "Hel"))
    bridge.on_binary(result(1, "lo"))
    bridge.on_binary(result(1))
    streamed, end = await drain(request)
    assert isinstance(end, Completion) and end.status == 200
    text = streamed + end.body
    assert b'"content":"Hel"' in text and text.endswith(b"data: [DONE]\n\n")
    assert request.token_counts is not None and request.token_counts.completion_tokens == 2
    assert worker.load == 0 and worker.requests_served == 1


async def test_a_character_split_across_frames_arrives_whole():
    relay = make_relay()
    _, bridge, _ = node(relay)
    request = ask(relay)
    euro = "€".encode()
    bridge.on_binary(result(1, b"a" + euro[:1]))
    bridge.on_binary(result(1, euro[1:] + b"b"))
    bridge.on_binary(result(1))
    _, end = await drain(request)
    assert isinstance(end, Completion)
    assert json.loads(end.body)["choices"][0]["message"]["content"] == "a€b"


async def test_task_ids_are_unique_on_a_connection_and_wrap_at_31_bits():
    relay = make_relay()
    _, bridge, transport = node(relay, max_concurrent=3)
    bridge._last_id = frames.MAX_TASK_ID - 1
    first, second = ask(relay), ask(relay)
    assert [t["id"] for t in transport.tasks] == [frames.MAX_TASK_ID, 1]
    relay.cancel(first)
    third = ask(relay)  # the stopped id is not handed out again while remembered
    assert [t["id"] for t in transport.tasks] == [frames.MAX_TASK_ID, 1, 2]
    assert second.phase is third.phase is Phase.ASSIGNED


async def test_a_cancel_becomes_a_stop_frees_the_slot_and_late_frames_are_dropped():
    relay = make_relay()
    worker, bridge, transport = node(relay, max_concurrent=1)
    request = ask(relay, stream=True)
    waiting = ask(relay, stream=True)
    assert waiting.phase is Phase.QUEUED
    relay.cancel(request)
    assert transport.stops == [1]
    assert waiting.worker is worker  # the slot was free at once
    bridge.on_binary(result(1, "late"))
    bridge.on_binary(result(1))
    assert relay.stats.dropped_frames == 2 and worker.attached
    assert (await drain(request))[1] is CANCELLED


async def test_bad_frames_are_dropped_counted_and_never_delivered():
    relay = make_relay()
    worker, bridge, _ = node(relay)
    request = ask(relay, stream=True)
    bridge.on_binary(b"\x00\x01")  # short
    bridge.on_binary(result(99, "stray"))  # never given out
    bridge.on_binary(result(1, b"\xff\xfe"))  # not UTF-8
    bridge.on_binary(result(1, "ok"))
    bridge.on_binary(result(1))
    bridge.on_binary(result(1, "after the end"))
    streamed, end = await drain(request)
    assert b"stray" not in streamed and b"after" not in streamed
    assert isinstance(end, Completion) and b'"content":"ok"' in streamed
    assert relay.stats.dropped_frames == 4 and worker.attached


async def test_an_invalid_frame_does_not_spoil_the_frames_after_it():
    relay = make_relay()
    _, bridge, _ = node(relay)
    request = ask(relay)
    euro = "€".encode()
    bridge.on_binary(result(1, b"a" + euro[:2]))  # a character left unfinished...
    bridge.on_binary(result(1, b"\xff"))  # ...and garbage: both dropped
    bridge.on_binary(result(1, "b€"))
    bridge.on_binary(result(1))
    _, end = await drain(request)
    assert isinstance(end, Completion)
    assert json.loads(end.body)["choices"][0]["message"]["content"] == "ab€"
    assert relay.stats.dropped_frames == 1


async def test_a_node_flooding_bad_frames_is_closed():
    relay = make_relay()
    worker, bridge, transport = node(relay, config=BridgeConfig(bad_frame_limit=3))
    for _ in range(3):
        bridge.on_binary(b"x")
    assert worker.attached
    bridge.on_binary(b"x")
    assert transport.closed == (1002, "too many bad frames") and not worker.attached


async def test_bad_frames_spread_out_over_time_are_tolerated():
    relay = make_relay()
    worker, bridge, _ = node(relay, config=BridgeConfig(bad_frame_limit=2, bad_frame_window=0.05))
    for _ in range(3):
        bridge.on_binary(b"x")
        bridge.on_binary(b"x")
        await asyncio.sleep(0.06)
    assert worker.attached


async def test_every_frame_counts_as_a_heartbeat():
    relay = make_relay()
    worker, bridge, _ = node(relay)
    worker.last_pong -= 100
    bridge.on_text("")
    assert relay.loop.time() - worker.last_pong < 1
    worker.last_pong -= 100
    bridge.on_binary(b"?")  # even a bad one: the node is there
    assert relay.loop.time() - worker.last_pong < 1


async def test_a_silent_node_is_dropped_by_the_heartbeat():
    relay = make_relay()
    worker, _, transport = node(relay)
    async with asyncio.timeout(2):
        while worker.attached:
            await asyncio.sleep(0.02)
    assert transport.closed == (1001, "worker heartbeat timed out")
    await relay.aclose()


async def test_losing_the_node_before_the_first_byte_requeues_and_after_it_fails():
    relay = make_relay()
    worker, bridge, _ = node(relay)
    unstarted, started = ask(relay, stream=True), ask(relay, stream=True)
    bridge.on_binary(result(2, "partial"))
    relay.detach_worker(worker, "gone")
    assert unstarted.phase is Phase.QUEUED and unstarted.requeues == 1
    streamed, end = await drain(started)
    assert b"partial" in streamed and isinstance(end, WorkerLost)
    other, other_bridge, other_transport = node(relay, name="other")
    assert unstarted.worker is other
    (task,) = other_transport.tasks
    other_bridge.on_binary(result(task["id"]))
    assert isinstance((await drain(unstarted))[1], Completion)


async def test_drain_finishes_the_task_then_closes_4000():
    relay = make_relay()
    worker, bridge, transport = node(relay)
    request = ask(relay)
    assert relay.drain_worker(worker.id)
    assert transport.closed is None and transport.texts[-1].startswith('{"state":0')
    bridge.on_binary(result(1, "done"))
    bridge.on_binary(result(1))
    assert isinstance((await drain(request))[1], Completion)
    assert transport.closed == (4000, "worker drained")


async def test_the_stream_ceiling_stops_the_task():
    relay = make_relay(dataclasses.replace(FAST, max_stream_bytes=400))
    _, bridge, transport = node(relay)
    request = ask(relay, stream=True)
    for _ in range(10):
        bridge.on_binary(result(1, "x" * 50))
    _, end = await drain(request)
    assert isinstance(end, StreamTooLarge) and transport.stops == [1]


async def test_anthropic_requests_are_rendered_as_messages():
    relay = make_relay()
    _, bridge, transport = node(relay)
    request = ask(relay, MESSAGES, system="sys", max_tokens=12)
    (task,) = transport.tasks
    assert (task["system"], task["max_new_tokens"]) == ("sys", 12)
    bridge.on_binary(result(1, "hey"))
    bridge.on_binary(result(1))
    _, end = await drain(request)
    assert isinstance(end, Completion)
    message = json.loads(end.body)
    assert message["type"] == "message" and message["content"] == [{"type": "text", "text": "hey"}]


async def test_a_mixed_pool_sends_what_nodes_cannot_take_to_modern_workers_only():
    relay = make_relay()
    _, _, transport = node(relay, max_concurrent=4)
    modern, link = attach(relay, max_concurrent=4, name="modern", load=3)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    pictured = ask(relay, messages=image)
    responses = relay.submit(
        model="m",
        endpoint_path="/v1/responses",
        flavor="responses",
        is_streaming=False,
        body='{"model":"m","input":"x"}',
        headers={},
    )
    plain = ask(relay)
    assert pictured.worker is modern and responses.phase is Phase.QUEUED
    assert plain.worker is not None and plain.worker is not modern
    assert len(transport.tasks) == 1 and [r.request_id for r in link.requests] == [pictured.id]


async def test_a_model_only_legacy_nodes_serve_refuses_images_with_a_400():
    relay = make_relay()
    node(relay)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    with pytest.raises(BadRequest, match=r"served only by legacy nodes here: .* not images"):
        ask(relay, messages=image)
    assert relay.queue_depth() == 0


async def test_text_frames_are_bad_frames_logged_once_then_summed_up_per_window(caplog):
    relay = make_relay()
    config = BridgeConfig(bad_frame_limit=100_000, bad_frame_window=0.05)
    worker, bridge, _ = node(relay, config=config)
    caplog.set_level(logging.INFO, logger="relay.legacy")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "relay.legacy"]

    bridge.on_text("")  # the heartbeat: not a bad frame
    for n in range(5000):
        bridge.on_text(f"what old nodes print {n}\n")
    assert relay.stats.dropped_frames == 5000 and worker.attached
    assert len(lines()) == 1 and "a text frame" in lines()[0] and "print 0" in lines()[0]
    async with asyncio.timeout(2):  # the window ends: one line for all the rest
        while len(lines()) < 2:
            await asyncio.sleep(0.01)
    summary = lines()[1]
    assert "dropped 4999 more bad frame(s)" in summary and "print 4999" in summary
    assert "\n" not in summary  # a node's text cannot start a log line of its own
    bridge.on_text("one more")  # within the next window: counted for its summary
    relay.close_worker(worker, 1000, "drained")  # ...which closing writes at once
    assert "dropped 1 more bad frame(s)" in lines()[-1] and len(lines()) == 3


async def test_a_node_flooding_text_frames_is_closed():
    relay = make_relay()
    worker, bridge, transport = node(relay, config=BridgeConfig(bad_frame_limit=3))
    for _ in range(4):
        bridge.on_text("chatter")
    assert transport.closed == (1002, "too many bad frames") and not worker.attached
