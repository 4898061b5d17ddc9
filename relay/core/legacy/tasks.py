"""Client requests as legacy node tasks, and what a node cannot be given.

A node takes a system prompt, a list of user/assistant text messages, a token
budget and a temperature, and answers with text. :func:`translate` makes that out of
an OpenAI ``/v1/chat/completions`` or Anthropic ``/v1/messages`` body:

- system prompt: OpenAI ``system``/``developer`` messages, Anthropic's top-level
  ``system`` (a string or text blocks), joined by blank lines;
- messages: the text of each user/assistant message, content parts flattened;
- ``max_new_tokens``: ``max_completion_tokens`` or ``max_tokens``, else a default;
- ``temperature``: as given (from 0 to 2), else 1.0 (both APIs' default).

Anything the task format cannot carry — images, audio, files, tools, ``n`` > 1,
another endpoint — is :class:`Untranslatable`; :func:`refusal` turns that into the
answer of :attr:`relay.core.state.Worker.refuses`, computed once per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from relay.core.state import RelayRequest

Dialect = Literal["openai", "anthropic"]

#: The only endpoints a legacy node serves, and the dialect of each.
ENDPOINTS: dict[str, Dialect] = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_TEMPERATURE = 1.0
#: The highest temperature a task carries (OpenAI's range; Anthropic's is within it).
MAX_TEMPERATURE = 2

_IMAGES = frozenset({"image_url", "input_image", "image", "document", "file", "input_audio"})
_TOOLS = frozenset(
    {"tool_use", "tool_result", "server_tool_use", "web_search_tool_result", "mcp_tool_use"}
)
_SKIPPED = frozenset({"thinking", "redacted_thinking"})  # earlier turns' reasoning: not text


class Untranslatable(ValueError):
    """The request needs something a legacy node cannot do; the message says what."""


@dataclass(frozen=True, slots=True)
class TaskSpec:
    system: str
    messages: tuple[tuple[str, str], ...]
    max_new_tokens: int
    temperature: float
    #: OpenAI ``stream_options.include_usage``: end the stream with a usage chunk.
    include_usage: bool
    #: Characters of prompt text (system and messages), for the usage estimate.
    prompt_chars: int


@dataclass(frozen=True, slots=True)
class _Refused:
    reason: str


def translate(
    endpoint_path: str, body: str, *, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> TaskSpec:
    """The task for one client request, or :class:`Untranslatable`."""
    dialect = ENDPOINTS.get(endpoint_path)
    if dialect is None:
        raise Untranslatable(
            f"legacy nodes serve /v1/chat/completions and /v1/messages, not {endpoint_path[:64]}"
        )
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise Untranslatable("the request body is not valid JSON") from None
    if not isinstance(document, dict):
        raise Untranslatable("the request body must be a JSON object")
    if dialect == "openai":
        system, messages = _openai_messages(document)
        budget = document.get("max_completion_tokens", document.get("max_tokens"))
    else:
        system, messages = _anthropic_messages(document)
        budget = document.get("max_tokens")
    if not messages:
        raise Untranslatable("legacy nodes need at least one user or assistant message")
    options = document.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    prompt_chars = len(system) + sum(len(text) for _, text in messages)
    return TaskSpec(
        system=system,
        messages=tuple(messages),
        max_new_tokens=_budget(budget, default_max_new_tokens),
        temperature=_temperature(document.get("temperature")),
        include_usage=include_usage and dialect == "openai",
        prompt_chars=prompt_chars,
    )


def refusal(
    request: RelayRequest, *, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> str | None:
    """Why a legacy node cannot take ``request`` (``None``: it can). Remembered on the request."""
    cached = request.translation
    if isinstance(cached, TaskSpec):
        return None
    if isinstance(cached, _Refused):
        return cached.reason
    try:
        request.translation = translate(
            request.endpoint_path, request.body, default_max_new_tokens=default_max_new_tokens
        )
    except (Untranslatable, TypeError, ArithmeticError) as exc:
        # Untranslatable says what; anything else is input this module did not foresee,
        # refused all the same rather than raised into the dispatcher.
        why = exc if isinstance(exc, Untranslatable) else "the request cannot be translated"
        reason = f"Model '{request.model[:256]}' is served only by legacy nodes here: {why}"
        request.translation = _Refused(reason)
        return reason
    return None


def _openai_messages(document: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    tools = document.get("tools") or document.get("functions")
    choice = document.get("tool_choice", document.get("function_call"))
    if tools or choice not in (None, "none"):
        raise Untranslatable("legacy nodes cannot use tools")
    n = document.get("n")
    if n is not None and n != 1:
        raise Untranslatable("legacy nodes give one answer per request ('n' must be 1)")
    raw = document.get("messages")
    if not isinstance(raw, list):
        raise Untranslatable("'messages' must be a list")
    system: list[str] = []
    messages: list[tuple[str, str]] = []
    for message in raw:
        if not isinstance(message, dict):
            raise Untranslatable("each message must be an object")
        role = message.get("role")
        calls = message.get("tool_calls") or message.get("function_call")
        if role in ("tool", "function") or calls:
            raise Untranslatable("legacy nodes cannot use tools")
        text = _text(message.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role in ("user", "assistant"):
            messages.append((role, text))
        else:
            raise Untranslatable(f"legacy nodes take user and assistant messages, not {role!r}")
    return "\n\n".join(system), messages


def _anthropic_messages(document: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    if document.get("tools") or document.get("tool_choice"):
        raise Untranslatable("legacy nodes cannot use tools")
    raw_system = document.get("system")
    system = "" if raw_system is None else _text(raw_system)
    raw = document.get("messages")
    if not isinstance(raw, list):
        raise Untranslatable("'messages' must be a list")
    messages: list[tuple[str, str]] = []
    for message in raw:
        if not isinstance(message, dict):
            raise Untranslatable("each message must be an object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise Untranslatable(f"legacy nodes take user and assistant messages, not {role!r}")
        messages.append((role, _text(message.get("content"))))
    return system, messages


def _text(content: object) -> str:
    """The text of one message's content: a string, or text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable("message content must be a string or a list of parts")
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            kind = None  # a list or object there is no part type (and not hashable)
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind in _SKIPPED:
            continue
        elif kind in _IMAGES:
            raise Untranslatable("legacy nodes take text only, not images, audio or files")
        elif kind in _TOOLS:
            raise Untranslatable("legacy nodes cannot use tools")
        else:
            raise Untranslatable(f"legacy nodes take text only, not {str(kind)[:40]!r} parts")
    return "\n".join(parts)


def _budget(value: object, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Untranslatable("the token limit must be a positive integer")
    return min(value, 2**31 - 1)


def _temperature(value: object) -> float:
    """The task's temperature; compared as sent, so that no number from a client (a
    400-digit integer) is converted before it is known to fit."""
    if value is None:
        return DEFAULT_TEMPERATURE
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_TEMPERATURE
    ):
        raise Untranslatable(f"'temperature' must be a number from 0 to {MAX_TEMPERATURE}")
    return float(value)
