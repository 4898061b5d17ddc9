"""The error envelopes clients see, from the one mapping function."""

from __future__ import annotations

import json

from relay.wire.errors import ModelNotFound, QueueFull, QueueTimeout, WorkerLost, error_response
from relay.wire.sse import error_event


def test_openai_envelope_with_retry_after():
    status, headers, body = error_response(QueueFull(), "openai")
    assert status == 429
    assert (b"retry-after", b"1") in headers
    assert json.loads(body) == {
        "error": {
            "message": "Service temporarily at capacity, please retry",
            "type": "rate_limit_error",
            "code": "queue_full",
        }
    }


def test_anthropic_envelope():
    status, headers, body = error_response(ModelNotFound("claude-x"), "anthropic")
    assert status == 404
    assert all(name != b"retry-after" for name, _ in headers)
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model 'claude-x' is not served here"},
    }


def test_gateway_timeout_message():
    status, _, body = error_response(QueueTimeout(), "responses")
    assert status == 504
    assert json.loads(body)["error"]["message"] == "Request timed out waiting for worker"


def test_sse_error_events_in_each_style():
    chat = error_event(WorkerLost(), "openai")
    assert chat.startswith(b"data: ") and chat.endswith(b"\n\n")
    assert json.loads(chat[6:])["error"]["code"] == "worker_lost"
    anthropic = error_event(WorkerLost(), "anthropic")
    assert anthropic.startswith(b"event: error\ndata: ")
    assert json.loads(anthropic.split(b"data: ", 1)[1])["error"]["type"] == "overloaded_error"
    responses = error_event(WorkerLost(), "responses")
    assert json.loads(responses.split(b"data: ", 1)[1])["type"] == "error"
