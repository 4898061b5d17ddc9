"""The legacy bridge's pure translation, inbound: the old node wire and client requests
as node tasks (no sockets, no Django)."""

from __future__ import annotations

import json

import pytest

from relay.core.legacy import frames
from relay.core.legacy.tasks import TaskSpec, Untranslatable, refusal, translate
from relay.core.state import RelayRequest

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"

# -- the node wire --------------------------------------------------------------


def test_connect_parameters_are_read_and_checked():
    params = frames.parse_connect_query("name=box&model=llama&token=t&max_concurrency=3")
    assert params == frames.NodeParams("box", "llama", "t", 3, None)
    assert frames.parse_connect_query(
        "name=box&model=llama&token=t&max_concurrency=1&provider=team"
    ).provider == ("team")
    with pytest.raises(frames.BadParameters, match="missing parameter: model, token"):
        frames.parse_connect_query("name=box&model=&max_concurrency=1")
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(frames.BadParameters, match="positive integer"):
            frames.parse_connect_query(f"name=a&model=b&token=c&max_concurrency={bad}")


def test_task_and_stop_frames_are_exactly_the_old_shape():
    task = frames.Task(
        id=7,
        system="be brief",
        messages=[frames.Message(role="user", content="hi")],
        max_new_tokens=64,
        temperature=0.5,
        created_at=1_700_000_000,
    )
    assert frames.encode_task(task) == (
        '{"state":0,"id":7,"system":"be brief","messages":[{"role":"user","content":"hi"}],'
        '"max_new_tokens":64,"temperature":0.5,"created_at":1700000000}'
    )
    assert frames.encode_stop(7) == '{"id":7,"stop":true}'


def test_result_frames_carry_a_big_endian_task_id():
    frame = frames.result_frame(0x01020304, "é".encode())
    assert frame[:4] == b"\x01\x02\x03\x04"
    assert frames.split_result(frame) == (0x01020304, "é".encode())
    assert frames.split_result(frames.result_frame(frames.MAX_TASK_ID)) == (2**31 - 1, b"")
    with pytest.raises(frames.ShortFrame):
        frames.split_result(b"\x00\x00\x01")


# -- requests as tasks -------------------------------------------------------------


def body(**document: object) -> str:
    return json.dumps(document)


def test_an_openai_request_becomes_a_task():
    spec = translate(
        CHAT,
        body(
            model="m",
            messages=[
                {"role": "system", "content": "rule one"},
                {"role": "developer", "content": [{"type": "text", "text": "rule two"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            max_completion_tokens=99,
            max_tokens=5,
            temperature=0.2,
            stream_options={"include_usage": True},
        ),
    )
    assert spec == TaskSpec(
        system="rule one\n\nrule two",
        messages=(("user", "a\nb"), ("assistant", "c"), ("user", "d")),
        max_new_tokens=99,
        temperature=0.2,
        include_usage=True,
        prompt_chars=len("rule one\n\nrule two") + 3 + 1 + 1,
    )


def test_an_anthropic_request_becomes_a_task():
    spec = translate(
        MESSAGES,
        body(
            model="m",
            system=[{"type": "text", "text": "sys"}],
            max_tokens=32,
            messages=[
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "…"},
                        {"type": "text", "text": "a"},
                    ],
                },
            ],
        ),
    )
    assert (spec.system, spec.messages, spec.max_new_tokens) == (
        "sys",
        (("user", "q"), ("assistant", "a")),
        32,
    )
    assert spec.temperature == 1.0 and not spec.include_usage


def test_defaults_fill_what_the_request_leaves_out():
    spec = translate(CHAT, body(model="m", messages=[{"role": "user", "content": "x"}]))
    assert (spec.system, spec.max_new_tokens, spec.temperature) == ("", 1024, 1.0)
    other = translate(
        CHAT,
        body(model="m", messages=[{"role": "user", "content": "x"}]),
        default_max_new_tokens=7,
    )
    assert other.max_new_tokens == 7


@pytest.mark.parametrize(
    ("path", "document", "reason"),
    [
        ("/v1/responses", {"model": "m", "input": "x"}, "not /v1/responses"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            "tools",
        ),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            "tools",
        ),
        (
            CHAT,
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
            "images",
        ),
        (
            MESSAGES,
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "images",
        ),
        (
            MESSAGES,
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_result"}]}],
            },
            "tools",
        ),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "'n'"),
        (CHAT, {"model": "m", "messages": [{"role": "system", "content": "x"}]}, "at least one"),
        (CHAT, {"model": "m", "messages": "x"}, "must be a list"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "positive",
        ),
    ],
)
def test_what_a_node_cannot_take_is_untranslatable(path, document, reason):
    with pytest.raises(Untranslatable, match=reason):
        translate(path, json.dumps(document))


def make_request(path: str, document: dict) -> RelayRequest:
    return RelayRequest(
        id="r-1",
        seq=1,
        provider="local",
        model="llm",
        endpoint_path=path,
        flavor="openai",
        is_streaming=False,
        body=json.dumps(document),
        headers={},
        key_id=None,
        created_wall=0.0,
        now=0.0,
        deadline=10.0,
    )


def test_the_refusal_is_computed_once_per_request_and_names_the_model():
    images = make_request(
        CHAT,
        {"model": "llm", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    )
    reason = refusal(images)
    assert reason is not None and reason.startswith("Model 'llm' is served only by legacy nodes")
    images.body = ""  # what the core does once a request ends: the answer is remembered
    assert refusal(images) == reason
    fine = make_request(CHAT, {"model": "llm", "messages": [{"role": "user", "content": "x"}]})
    assert refusal(fine) is None
    assert isinstance(fine.translation, TaskSpec)
