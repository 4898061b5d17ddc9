"""What a request may cost against its key's token budgets, read from its body in the
pass that reads its model (:func:`relay.server.http.request.read_head`), or from a batch
line's body."""

from __future__ import annotations

import json

from relay.core.limits import MAX_RESERVATION, reservation_of
from relay.server.http.request import read_head


def cost(document: dict) -> int:
    return read_head(json.dumps(document, separators=(",", ":")).encode()).prompt.reservation()


def test_each_api_s_output_bound_and_its_prompt_are_reserved():
    messages = [{"role": "user", "content": "x" * 40}]
    prompt = len(json.dumps(messages, separators=(",", ":")))
    chat = {"model": "m", "messages": messages}
    assert cost(chat) == -(-prompt // 4)  # no bound asked: the prompt only
    assert cost({**chat, "max_tokens": 100}) == 100 + -(-prompt // 4)
    assert cost({**chat, "max_completion_tokens": 300, "max_tokens": 100}) == 300 + -(-prompt // 4)
    anthropic = {"model": "m", "system": "s" * 6, "messages": messages, "max_tokens": 64}
    assert cost(anthropic) == 64 + -(-(prompt + 8) // 4)  # "ssssss" with its quotes
    responses = {"model": "m", "instructions": "i", "input": "hello", "max_output_tokens": 50}
    assert cost(responses) == 50 + -(-(3 + 7) // 4)
    completions = {"model": "m", "prompt": "abc", "max_tokens": 9}
    assert cost(completions) == 9 + 2
    assert cost({"model": "m", "max_tokens": 10**20}) == MAX_RESERVATION
    assert cost({"model": "m", "max_tokens": "100", "max_output_tokens": True}) == 0


def test_a_batch_line_s_body_is_read_the_same_way_and_junk_reserves_nothing():
    line = '{"model":"m","input":"hello","max_output_tokens":50}'
    assert reservation_of(line) == reservation_of(line.encode()) == 50 + 2
    assert reservation_of(b"[1, 2]") == reservation_of("nope") == reservation_of(b"") == 0
    assert reservation_of("[" * 100_000) == 0
