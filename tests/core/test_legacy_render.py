"""The legacy bridge's pure translation, outbound: node text as OpenAI and Anthropic
responses, and the old client API both ways (no sockets, no Django)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message as AnthropicMessage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from relay.core.legacy import oldapi
from relay.core.legacy.render import estimate_tokens, rendering
from relay.core.legacy.tasks import translate
from relay.wire import errors
from relay.wire.errors import (
    BadRequest,
    ConcurrencyLimited,
    DailyQuotaExceeded,
    KeyExpired,
    ModelNotFound,
    ProviderDisabled,
    QueueFull,
    QueueTimeout,
    RelayError,
    RequestRateLimited,
    RequestTimeout,
    RequeueExhausted,
    Unauthorized,
    WorkerFailed,
    WorkerLost,
)

CHAT = "/v1/chat/completions"

# -- node text as responses ---------------------------------------------------------


def events(stream: str) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in stream.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def make(dialect, streaming, **extra):
    return rendering(
        dialect, streaming, request_id="r-9", model="llm", created=1234, prompt_tokens=5, **extra
    )


def test_an_openai_stream_is_valid_chunks_ending_with_done():
    r = make("openai", True, include_usage=True)
    out = r.delta("Hel") + r.delta("") + r.delta('lo "€"')
    headers, tail = r.end()
    assert headers["content-type"].startswith("text/event-stream")
    out += tail
    assert out.endswith("data: [DONE]\n\n")
    chunks = [ChatCompletionChunk.model_validate(e) for e in events(out)]
    assert {c.id for c in chunks} == {"chatcmpl-r-9"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == 'Hello "€"'
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, estimate_tokens(9))
    assert usage.model_extra == {"estimated": True}


def test_an_openai_stream_without_usage_asked_ends_without_a_usage_chunk():
    r = make("openai", True)
    _, tail = r.end()  # no text at all: the opening comes with the end
    chunks = [ChatCompletionChunk.model_validate(e) for e in events(tail)]
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]
    assert all(c.usage is None for c in chunks)


def test_a_whole_openai_answer_is_one_chat_completion():
    r = make("openai", False)
    text = r.delta('a "quote"\n') + r.delta("€ and \\ and \x01")
    headers, tail = r.end()
    assert headers == {"content-type": "application/json", "x-modelrelay-usage": "estimated"}
    completion = ChatCompletion.model_validate_json(text + tail)
    assert completion.id == "chatcmpl-r-9" and completion.created == 1234
    assert completion.model == "llm" and completion.object == "chat.completion"
    assert completion.choices[0].message.content == 'a "quote"\n€ and \\ and \x01'
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.model_extra == {"estimated": True}


def test_an_anthropic_stream_has_every_event_in_order():
    r = make("anthropic", True)
    out = r.delta("Hi") + r.delta(" there")
    out += r.end()[1]
    names = [line[7:] for line in out.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    documents = events(out)
    assert [d["type"] for d in documents] == names
    assert documents[0]["message"]["id"] == "msg_r-9"
    assert documents[-2]["delta"]["stop_reason"] == "end_turn"
    assert documents[-2]["usage"] == {"output_tokens": 2, "estimated": True}


def test_a_whole_anthropic_answer_is_one_message():
    r = make("anthropic", False)
    body = r.delta("one ") + r.delta("two")
    headers, tail = r.end()
    message = AnthropicMessage.model_validate_json(body + tail)
    assert message.content[0].type == "text" and message.content[0].text == "one two"
    assert message.stop_reason == "end_turn" and message.id == "msg_r-9"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 2)
    assert headers["x-modelrelay-usage"] == "estimated"
    empty = make("anthropic", False)
    assert AnthropicMessage.model_validate_json(empty.end()[1]).content[0].text == ""  # type: ignore[union-attr]


# -- the old client API -------------------------------------------------------------


def test_an_old_request_becomes_a_streaming_chat_completion():
    old = oldapi.parse_request(
        json.dumps(
            {
                "model": "llm",
                "system": "sys",
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0.3,
                "max_new_tokens": 50,
                "conversation_id": "c-1",
                "user_id": 42,
            }
        ).encode()
    )
    assert (old.model, old.conversation_id, old.user_id) == ("llm", "c-1", "42")
    assert json.loads(old.body) == {
        "model": "llm",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
        "max_tokens": 50,
    }
    # ...which a legacy node receives as the task the old broker would have sent.
    spec = translate(CHAT, old.body)
    assert (spec.system, spec.messages, spec.max_new_tokens) == ("sys", (("user", "hi"),), 50)


@pytest.mark.parametrize(
    "document",
    [
        b"not json",
        b"[]",
        b'{"messages": [{"role": "user", "content": "x"}]}',
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": [{"role": "system", "content": "x"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": ["x"]}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_new_tokens": "9"}',
    ],
)
def test_malformed_old_requests_are_bad_requests(document):
    with pytest.raises(BadRequest):
        oldapi.parse_request(document)


def test_relay_errors_map_to_the_old_messages_where_they_say_what_happened():
    assert oldapi.old_error(Unauthorized()) == "unauthorized"
    assert oldapi.old_error(KeyExpired()) == "unauthorized"
    assert oldapi.old_error(ModelNotFound("x")) == "unknown model"
    assert oldapi.old_error(BadRequest("x")) == "invalid request"
    assert oldapi.old_error(QueueTimeout()) == "timeout waiting for node"
    assert oldapi.old_error(RequestTimeout()) == "timeout waiting for finish"
    assert oldapi.status_error(400) == "invalid request"


def test_relay_errors_the_old_broker_had_no_message_for_say_what_happened():
    assert oldapi.old_error(RequestRateLimited(retry_after=3)) == "rate limit of this key exceeded"
    assert oldapi.old_error(ConcurrencyLimited()) == "too many requests at once for this key"
    assert oldapi.old_error(DailyQuotaExceeded()) == "token budget of this key spent"
    assert oldapi.old_error(QueueFull()) == "queue full"
    assert oldapi.old_error(ProviderDisabled()) == "provider disabled"
    assert oldapi.old_error(RequeueExhausted()) == "nodes lost, gave up"
    assert oldapi.old_error(WorkerLost()) == "node lost"
    assert oldapi.old_error(WorkerFailed()) == "node failed"
    assert oldapi.status_error(503) == "backend error 503"
    # Every error of the tree has its own message: none falls through to the last
    # resort, and only the two deadlines speak of a timeout.
    tree: list[type[RelayError]] = []
    pending: list[type[RelayError]] = [RelayError]
    while pending:
        kind = pending.pop()
        tree.append(kind)
        pending += kind.__subclasses__()
    for kind in tree:
        if kind in (RelayError, errors.ProtocolError):
            continue  # never an answer to a client
        err = kind.__new__(kind)
        message = oldapi.old_error(err)
        assert message != "relay error", kind
        assert ("timeout" in message) == issubclass(kind, errors.GatewayTimeout), kind


def test_ndjson_lines_are_one_object_each():
    assert oldapi.text_line('a\n"b"') == b'{"o":"a\\n\\"b\\""}\n'
    assert oldapi.done_line() == b'{"done":true}\n'
    assert oldapi.error_line("unknown model") == b'{"err":"unknown model"}\n'


def test_the_stream_reader_takes_text_out_of_chat_chunks_split_anywhere():
    r = make("openai", True, include_usage=True)
    stream = (r.delta("one ") + r.delta("two") + r.end()[1]).encode()
    stream = b": a comment\n\n" + stream
    reader = oldapi.ChatStreamReader()
    texts: list[str] = []
    for i in range(0, len(stream), 7):
        texts += reader.feed(stream[i : i + 7])
    texts += reader.close()
    assert texts == ["one ", "two"] and not reader.failed
    failing = oldapi.ChatStreamReader()
    assert failing.feed(b'data: {"error": {"message": "x"}}\n\n') == []
    assert failing.failed


def test_a_whole_chat_completion_gives_its_text():
    r = make("openai", False)
    assert oldapi.completion_text((r.delta("all") + r.end()[1]).encode()) == "all"
    assert oldapi.completion_text(b"<html>") is None
