"""A legacy node's text as OpenAI or Anthropic responses, streamed or whole.

One :class:`Rendering` per task. :meth:`~Rendering.delta` turns a piece of text into
what the core relays for it; :meth:`~Rendering.end` gives the headers and the last
part. Streaming renderings emit server-sent events exactly as the two APIs do
(``chat.completion.chunk`` events and ``data: [DONE]``; or ``message_start``,
``content_block_start``, ``content_block_delta``…, ``content_block_stop``,
``message_delta``, ``message_stop``). Whole renderings emit one JSON document in
pieces: an opening with the first text, the escaped text, and the closing, so the
core buffers and bounds it like any non-streaming response.

Nothing is emitted before the first text: until then the request has delivered no
byte and can still be requeued if its node goes away.

Nodes report no token counts. ``usage`` is an estimate (about four characters per
token) and says so: ``"estimated": true`` in every usage object, and the header
``x-modelrelay-usage: estimated`` on whole responses.
"""

from __future__ import annotations

from typing import Any

import msgspec

from relay.core.legacy.tasks import Dialect
from relay.wire.protocol import TokenCounts

#: Header on whole responses whose usage is an estimate.
USAGE_HEADER = "x-modelrelay-usage"
#: ``system_fingerprint`` of OpenAI responses rendered from a legacy node.
FINGERPRINT = "modelrelay-legacy"

_JSON = msgspec.json.Encoder()
_SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
_JSON_HEADERS = {"content-type": "application/json", USAGE_HEADER: "estimated"}


def estimate_tokens(chars: int) -> int:
    """A rough token count for ``chars`` characters of text (about four per token)."""
    return (chars + 3) // 4


def _json(document: Any) -> str:
    return _JSON.encode(document).decode()


def _escaped(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return _JSON.encode(text).decode()[1:-1]


def _sse(document: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {_json(document)}\n\n"


class Rendering:
    """Turns one task's text into a response; subclasses give the shape."""

    headers: dict[str, str] = _JSON_HEADERS

    def __init__(
        self, *, response_id: str, model: str, created: int, prompt_tokens: int, include_usage: bool
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.started = False
        self.chars = 0

    def delta(self, text: str) -> str:
        """What the core relays for ``text`` (empty text: nothing)."""
        if not text:
            return ""
        self.chars += len(text)
        if self.started:
            return self._more(text)
        self.started = True
        return self._opening() + self._more(text)

    def end(self) -> tuple[dict[str, str], str]:
        """The response headers and its last part (the opening too, if no text came)."""
        opening = "" if self.started else self._opening()
        self.started = True
        return self.headers, opening + self._closing()

    @property
    def completion_tokens(self) -> int:
        return estimate_tokens(self.chars)

    def token_counts(self) -> TokenCounts:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return TokenCounts(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _opening(self) -> str:
        raise NotImplementedError

    def _more(self, text: str) -> str:
        raise NotImplementedError

    def _closing(self) -> str:
        raise NotImplementedError


class OpenAIStream(Rendering):
    headers = _SSE_HEADERS

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        document = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
            **extra,
        }
        return _sse(document)

    def _choice(self, delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    def _opening(self) -> str:
        return self._chunk(self._choice({"role": "assistant", "content": ""}))

    def _more(self, text: str) -> str:
        return self._chunk(self._choice({"content": text}))

    def _closing(self) -> str:
        out = self._chunk(self._choice({}, "stop"))
        if self.include_usage:
            out += self._chunk([], usage=_openai_usage(self))
        return out + "data: [DONE]\n\n"


class OpenAIWhole(Rendering):
    def _opening(self) -> str:
        head = _json(
            {
                "id": self.response_id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
            }
        )
        return head[:-1] + ',"choices":[{"index":0,"message":{"role":"assistant","content":"'

    def _more(self, text: str) -> str:
        return _escaped(text)

    def _closing(self) -> str:
        usage = _json(_openai_usage(self))
        return f'"}},"logprobs":null,"finish_reason":"stop"}}],"usage":{usage}}}'


class AnthropicStream(Rendering):
    headers = _SSE_HEADERS

    def _opening(self) -> str:
        message: dict[str, Any] = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0, "estimated": True},
        }
        text = {"type": "text", "text": ""}
        block = {"type": "content_block_start", "index": 0, "content_block": text}
        return _sse({"type": "message_start", "message": message}, "message_start") + _sse(
            block, "content_block_start"
        )

    def _more(self, text: str) -> str:
        delta = {"type": "text_delta", "text": text}
        return _sse(
            {"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta"
        )

    def _closing(self) -> str:
        usage = {"output_tokens": self.completion_tokens, "estimated": True}
        return (
            _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": usage,
                },
                "message_delta",
            )
            + _sse({"type": "message_stop"}, "message_stop")
        )


class AnthropicWhole(Rendering):
    def _opening(self) -> str:
        head = _json(
            {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model}
        )
        return head[:-1] + ',"content":[{"type":"text","text":"'

    def _more(self, text: str) -> str:
        return _escaped(text)

    def _closing(self) -> str:
        usage = _json(
            {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "estimated": True,
            }
        )
        return f'"}}],"stop_reason":"end_turn","stop_sequence":null,"usage":{usage}}}'


def _openai_usage(rendering: Rendering) -> dict[str, Any]:
    prompt, completion = rendering.prompt_tokens, rendering.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "estimated": True,
    }


_KINDS: dict[tuple[Dialect, bool], type[Rendering]] = {
    ("openai", True): OpenAIStream,
    ("openai", False): OpenAIWhole,
    ("anthropic", True): AnthropicStream,
    ("anthropic", False): AnthropicWhole,
}


def rendering(
    dialect: Dialect,
    streaming: bool,
    *,
    request_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    include_usage: bool = False,
) -> Rendering:
    """The rendering of one task's answer for a client of ``dialect``."""
    response_id = f"chatcmpl-{request_id}" if dialect == "openai" else f"msg_{request_id}"
    return _KINDS[(dialect, streaming)](
        response_id=response_id,
        model=model,
        created=created,
        prompt_tokens=prompt_tokens,
        include_usage=include_usage,
    )
