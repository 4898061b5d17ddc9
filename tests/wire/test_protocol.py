"""Typed wire messages: every message type round-trips; bad frames are ProtocolErrors."""

from __future__ import annotations

import pytest

from relay.wire import protocol
from relay.wire.errors import ProtocolError

SERVER_MESSAGES: list[protocol.ServerMessage] = [
    protocol.RegisterAck(worker_id="w-1", models=["m"], warnings=["x"]),
    protocol.Request(
        request_id="r-1",
        model="m",
        endpoint_path="/v1/messages",
        is_streaming=True,
        body='{"model":"m"}',
        headers={"anthropic-version": "2023-06-01"},
    ),
    protocol.Cancel(request_id="r-1", reason="client_disconnect"),
    protocol.Ping(timestamp_unix_ms=1),
    protocol.GracefulShutdown(reason="maintenance", drain_timeout_secs=30),
    protocol.ModelsRefresh(reason="periodic"),
]

WORKER_MESSAGES: list[protocol.WorkerMessage] = [
    protocol.Register(worker_name="gpu-1", models=["m"], max_concurrent=4, protocol_version="1"),
    protocol.ModelsUpdate(models=["m", "n"], current_load=1),
    protocol.ResponseChunk(request_id="r-1", chunk="data: {}\n\n"),
    protocol.ResponseComplete(
        request_id="r-1",
        status_code=200,
        headers={"content-type": "application/json"},
        body="{}",
        token_counts=protocol.TokenCounts(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    ),
    protocol.Pong(current_load=2, timestamp_unix_ms=5),
    protocol.Error(request_id="r-1", message="backend exploded"),
]


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_server_messages_round_trip(message):
    assert protocol.decode_server_message(protocol.encode(message)) == message


@pytest.mark.parametrize("message", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_messages_round_trip(message):
    assert protocol.decode_worker_message(protocol.encode(message)) == message


def test_reference_register_frame_decodes():
    raw = (
        '{"type":"register","worker_name":"gpu-box-1","models":["llama3-8b"],'
        '"max_concurrent":4,"protocol_version":"1","current_load":0,"future_field":true}'
    )
    assert protocol.decode_worker_message(raw) == protocol.Register(
        worker_name="gpu-box-1", models=["llama3-8b"], max_concurrent=4, protocol_version="1"
    )


def test_wire_tags_and_field_names_match_the_reference():
    text = protocol.encode(protocol.Cancel(request_id="r-2", reason="timeout"))
    assert text == '{"type":"cancel","request_id":"r-2","reason":"timeout"}'


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("{", "malformed JSON"),
        ("[]", "Expected `object`"),
        ('{"type":"launch_missiles"}', "Invalid value 'launch_missiles'"),
        ('{"worker_name":"x"}', "missing required field `type`"),
        ('{"type":"register"}', "missing required field `worker_name`"),
        ('{"type":"register","worker_name":5}', "Expected `str`"),
        ('{"type":"register","worker_name":"w","max_concurrent":0}', ">= 1"),
        ('{"type":"pong","current_load":-1}', ">= 0"),
        ('{"type":"response_chunk","request_id":"","chunk":"x"}', "length >= 1"),
        ('{"type":"response_complete","request_id":"r","status_code":"200"}', "Expected `int`"),
        ('{"type":"register_ack","worker_id":"w","models":[]}', "Invalid value 'register_ack'"),
        (b'{"type":"error","message":"\xff"}', "not valid UTF-8"),
    ],
)
def test_bad_worker_frames_raise_protocol_error(raw, reason):
    with pytest.raises(ProtocolError) as err:
        protocol.decode_worker_message(raw)
    assert reason in str(err.value)


def test_a_worker_cannot_send_server_messages():
    with pytest.raises(ProtocolError):
        protocol.decode_worker_message(protocol.encode(SERVER_MESSAGES[1]))


U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1


@pytest.mark.parametrize(
    ("load", "timestamp", "clamped"),
    [
        (0, 1_700_000_000_000, (0, 1_700_000_000_000)),  # milliseconds, as meant
        (3, 1_700_000_000_000_000, (3, protocol.MAX_TIMESTAMP_MS)),  # microseconds
        (2**31, None, (protocol.MAX_COUNT, None)),  # past an i32
        (U32_MAX, U64_MAX, (protocol.MAX_COUNT, protocol.MAX_TIMESTAMP_MS)),
    ],
)
def test_a_pong_takes_whatever_the_reference_types_hold_and_clamps_it(load, timestamp, clamped):
    fields = f'"current_load":{load}' + (
        "" if timestamp is None else f',"timestamp_unix_ms":{timestamp}'
    )
    pong = protocol.decode_worker_message('{"type":"pong",' + fields + "}")
    assert isinstance(pong, protocol.Pong)
    assert (pong.current_load, pong.timestamp_unix_ms) == clamped


@pytest.mark.parametrize(
    "fields",
    [
        f'"current_load":{U32_MAX + 1}',  # wider than a u32
        '"current_load":-1',
        '"current_load":1.0',  # not an integer
        '"current_load":"1"',
        f'"timestamp_unix_ms":{U64_MAX + 1}',  # wider than a u64
        f'"timestamp_unix_ms":{"9" * 400}',
        '"timestamp_unix_ms":-1',
        '"timestamp_unix_ms":1.7e15',
    ],
)
def test_a_pong_beyond_the_reference_types_is_a_protocol_error(fields):
    with pytest.raises(ProtocolError):
        protocol.decode_worker_message('{"type":"pong",' + fields + "}")


def _counts(fields: str) -> protocol.TokenCounts | None:
    message = protocol.decode_worker_message(
        '{"type":"response_complete","request_id":"r","status_code":200,'
        '"token_counts":{' + fields + "}}"
    )
    assert isinstance(message, protocol.ResponseComplete)
    return message.token_counts


def test_counts_up_to_the_bound_are_taken_as_they_are():
    counts = _counts(
        f'"prompt_tokens":{protocol.MAX_TOKENS},"completion_tokens":0,'
        f'"total_tokens":{protocol.MAX_TOKENS},"cached_tokens":7'
    )
    assert counts == protocol.TokenCounts(protocol.MAX_TOKENS, 0, protocol.MAX_TOKENS, 7)
    assert not counts.estimated


@pytest.mark.parametrize("name", ["prompt_tokens", "completion_tokens", "total_tokens"])
@pytest.mark.parametrize("absurd", [protocol.MAX_TOKENS + 1, 10**13, 2**63, U64_MAX])
def test_a_u64_count_past_the_bound_is_dropped_and_the_counts_marked_an_estimate(name, absurd):
    counts = _counts(f'"prompt_tokens":3,"completion_tokens":4,"total_tokens":7,"{name}":{absurd}')
    assert counts is not None and counts.estimated
    assert getattr(counts, name) is None
    kept = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    del kept[name]
    assert {k: getattr(counts, k) for k in kept} == kept
    cached = _counts(f'"completion_tokens":1,"cached_tokens":{absurd}')
    assert cached == protocol.TokenCounts(completion_tokens=1, estimated=True)


@pytest.mark.parametrize(
    "fields",
    [
        f'"prompt_tokens":{U64_MAX + 1}',  # wider than a u64
        f'"completion_tokens":{"9" * 400}',
        '"total_tokens":-1',  # a u64 holds no negative count
        '"cached_tokens":-1',
        '"prompt_tokens":1.0',  # not an integer
        '"prompt_tokens":"1"',
        '"estimated":1',
    ],
)
def test_counts_beyond_the_reference_types_are_a_protocol_error(fields):
    with pytest.raises(ProtocolError):
        _counts(fields)


@pytest.mark.parametrize("load", [2**31, U32_MAX])
def test_a_register_and_a_models_update_take_u32_loads_and_clamp_them(load):
    register = protocol.decode_worker_message(
        '{"type":"register","worker_name":"w","models":["m"],'
        f'"max_concurrent":{U32_MAX},"current_load":{load}}}'
    )
    assert isinstance(register, protocol.Register)
    assert (register.max_concurrent, register.current_load) == (
        protocol.MAX_COUNT,
        protocol.MAX_COUNT,
    )
    update = protocol.decode_worker_message(
        f'{{"type":"models_update","models":["m"],"current_load":{load}}}'
    )
    assert isinstance(update, protocol.ModelsUpdate)
    assert update.current_load == protocol.MAX_COUNT


@pytest.mark.parametrize(
    "fields",
    [
        f'"current_load":{U32_MAX + 1}',
        '"current_load":-1',
        f'"max_concurrent":{U32_MAX + 1}',
        '"max_concurrent":0',
    ],
)
def test_a_register_beyond_the_reference_types_is_a_protocol_error(fields):
    with pytest.raises(ProtocolError):
        protocol.decode_worker_message(
            '{"type":"register","worker_name":"w","models":["m"],' + fields + "}"
        )
