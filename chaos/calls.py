"""Client calls to the relay and the verdict on each answer.

A :class:`Call` is one inference request (chat completions or messages, streaming or
not) with the fake backend's instructions in its body (``chaos``: tag, hold, delays,
token gap) and the set of verdicts the scenario accepts for it. After the answer,
:func:`judge` names what happened:

- ``ok``: status 200 and exactly the answer the backend wrote — every token
  `` t0`` … `` t<N-1>`` once, in order, each chunk carrying this call's tag, then the
  stream's proper end (``[DONE]`` / ``message_stop``);
- ``stream-error:<code>``: a 200 stream that ended with the relay's (or the worker's)
  SSE error event after a clean prefix of the tokens (no duplicate, no gap);
- ``error:<status>:<code>``: an error answer, ``code`` read from the endpoint's own
  envelope (SPEC §5);
- ``hung-up``: the client left on purpose;
- ``no-answer:<why>``: nothing usable came back (timeout, reset, cut mid-stream without
  an error event) — never acceptable;
- ``corrupt:<why>``: duplicated, missing or reordered tokens, another call's chunks,
  events after the end, a wrong body — never acceptable.

Envelope problems (a relay error without its JSON envelope, a 429/503 without
``Retry-After``) are recorded as ``problems`` next to the verdict.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from chaos.client import Exchange, Reply, http_request
from relay.wire import errors

MODEL = "chaos-model"
Flavor = Literal["openai", "anthropic"]

_TOKEN = re.compile(r" t(\d+)")


def _error_codes() -> dict[str, str]:
    """Default message -> code of every relay error (the Anthropic envelope has no code)."""
    found: dict[str, str] = {}
    pending: list[type[errors.RelayError]] = [errors.RelayError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        found.setdefault(cls.default_message, cls.code)
    return found


_CODES = _error_codes()


def code_of_message(message: str) -> str:
    """The relay error code behind an Anthropic-envelope message."""
    if message in _CODES:
        return _CODES[message]
    if message.startswith("The worker is shutting down"):
        return "service_unavailable"  # the worker's own refusal (OpenAI code of its 503)
    if message.startswith(("The backend", "The worker")):
        return "worker_error"
    if message.startswith("model '"):
        return "model_not_found"
    if message.startswith(("Too many concurrent requests", "Rate limit of this API key")):
        return "rate_limit_exceeded"  # (per-key limits name the limit in the message)
    return "?"


class SseCheck:
    """Follows one stream's events as they arrive and notes every irregularity."""

    def __init__(self, tag: str, flavor: Flavor) -> None:
        self.tag = tag
        self.flavor = flavor
        self.buf = b""
        self.tokens = 0
        self.done = False
        self.error_code: str | None = None
        #: The error event came after the stream's own end (``[DONE]``/``message_stop``).
        self.error_after_end = False
        self.problems: list[str] = []

    def feed(self, data: bytes) -> None:
        buf = self.buf + data
        while (end := buf.find(b"\n\n")) >= 0:
            self._event(buf[:end].decode("utf-8", "replace"))
            buf = buf[end + 2 :]
        self.buf = buf

    def _problem(self, text: str) -> None:
        if len(self.problems) < 5:
            self.problems.append(text)

    def _event(self, text: str) -> None:
        name, data = "", []
        for line in text.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        payload = "\n".join(data)
        if self.error_code is not None:
            self._problem(f"event after the error event: {text[:80]!r}")
            return
        if payload == "[DONE]" and not self.done:
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self._problem(f"not JSON: {text[:80]!r}")
            return
        if not isinstance(obj, dict):
            self._problem(f"not an object: {text[:80]!r}")
            return
        if self.done:
            # The relay cannot tell that a backend's stream ended before its worker did
            # (it does not parse SSE): a worker lost after the last event but before its
            # completion still gets the SSE error event (SPEC §6). Nothing else may follow.
            if self._error_code(name, obj) is None:
                self._problem(f"event after the end: {text[:80]!r}")
                return
            self.error_after_end = True
        if self.flavor == "anthropic":
            self._anthropic(name, obj)
        else:
            self._openai(obj)

    def _error_code(self, name: str, obj: dict[str, Any]) -> str | None:
        if self.flavor == "anthropic":
            if name != "error" and obj.get("type") != "error":
                return None
            err = obj.get("error")
            return code_of_message(str(err.get("message", "") if isinstance(err, dict) else ""))
        if "error" not in obj:
            return None
        err = obj["error"]
        return str(err.get("code")) if isinstance(err, dict) else "?"

    def _openai(self, obj: dict[str, Any]) -> None:
        code = self._error_code("", obj)
        if code is not None:
            self.error_code = code
            return
        if obj.get("id") != f"chatcmpl-{self.tag}":
            self._problem(f"chunk of {obj.get('id')!r} in the stream of {self.tag}")
            return
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self._token(content)

    def _anthropic(self, name: str, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        code = self._error_code(name, obj)
        if code is not None:
            self.error_code = code
        elif kind == "message_start":
            if (obj.get("message") or {}).get("id") != f"msg_{self.tag}":
                self._problem(f"message_start of another call in the stream of {self.tag}")
        elif kind == "content_block_delta":
            if obj.get("chaos_tag") != self.tag:
                self._problem(f"delta of {obj.get('chaos_tag')!r} in the stream of {self.tag}")
                return
            self._token(str((obj.get("delta") or {}).get("text", "")))
        elif kind == "message_stop":
            self.done = True

    def _token(self, text: str) -> None:
        match = _TOKEN.fullmatch(text)
        if match is None:
            self._problem(f"unexpected text {text[:40]!r}")
            return
        index = int(match.group(1))
        if index != self.tokens:
            what = "duplicated" if index < self.tokens else "missing tokens before"
            self._problem(f"token {index} after {self.tokens - 1} ({what})")
        self.tokens = max(self.tokens, index + 1)


@dataclass
class Call:
    tag: str
    flavor: Flavor = "openai"
    stream: bool = False
    tokens: int = 8
    hold: bool = False
    delay: float = 0.0
    retry_delay: float = 0.0
    gap: float = 0.0
    expect: frozenset[str] = frozenset({"ok"})
    model: str = MODEL
    #: What the scenario calls this group of calls in its report.
    group: str = ""
    #: The API key it is sent with (None: none), and the name under which the fake
    #: backend counts the calls of that key in progress (``/chaos/stats`` ``keys``).
    api_key: str | None = None
    key_name: str = ""
    reply: Reply | None = None
    sse: SseCheck | None = None
    verdict: str = "pending"
    problems: list[str] = field(default_factory=list)
    exchange: Exchange | None = None
    task: asyncio.Task[Reply] | None = None

    @property
    def path(self) -> str:
        return "/v1/messages" if self.flavor == "anthropic" else "/v1/chat/completions"

    def body(self) -> bytes:
        chaos: dict[str, Any] = {"tag": self.tag}
        if self.hold:
            chaos["hold"] = True
        if self.delay:
            chaos["delay"] = self.delay
        if self.retry_delay:
            chaos["retry_delay"] = self.retry_delay
        if self.gap:
            chaos["gap"] = self.gap
        if self.key_name:
            chaos["key"] = self.key_name
        document: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"call {self.tag}"}],
            "max_tokens": self.tokens,
            "chaos": chaos,
        }
        if self.stream:
            document["stream"] = True
        return json.dumps(document).encode()

    def start(self, port: int, timeout: float) -> asyncio.Task[Reply]:
        """Send it now (on a new connection); the task ends with the reply."""
        headers = {"Content-Type": "application/json"}
        if self.flavor == "anthropic":
            headers["anthropic-version"] = "2023-06-01"
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        raw = http_request(port, "POST", self.path, self.body(), headers)
        self.sse = SseCheck(self.tag, self.flavor)
        self.exchange = Exchange(port, raw, timeout=timeout, on_body=self.sse.feed)
        self.task = asyncio.ensure_future(self.exchange.run())
        return self.task

    def hangup(self) -> None:
        if self.exchange is not None:
            self.exchange.hangup()

    @property
    def streamed_tokens(self) -> int:
        return self.sse.tokens if self.sse is not None else 0

    async def finish(self) -> None:
        assert self.task is not None
        self.reply = await self.task
        self.verdict, self.problems = judge(self)

    @property
    def accepted(self) -> bool:
        return accepted(self.verdict, self.expect) and not self.problems


def accepted(verdict: str, expect: frozenset[str]) -> bool:
    return any(fnmatch.fnmatchcase(verdict, pattern) for pattern in expect)


def judge(call: Call) -> tuple[str, list[str]]:
    reply, sse = call.reply, call.sse
    assert reply is not None and sse is not None
    if reply.error == "hung up":
        return "hung-up", []
    if (
        reply.status == 200
        and call.stream
        and reply.headers.get("content-type", "").startswith("text/event-stream")
    ):
        if sse.problems:
            return f"corrupt:{sse.problems[0]}", sse.problems[1:]
        if sse.error_code is not None:
            problems = [] if reply.complete else ["the stream was not terminated after its error"]
            return f"stream-error:{sse.error_code}", problems
        if not reply.complete:
            return f"no-answer:stream cut after {sse.tokens} tokens ({reply.error})", []
        if sse.done and sse.tokens == call.tokens:
            return "ok", []
        return f"corrupt:stream ended after {sse.tokens}/{call.tokens} tokens, done={sse.done}", []
    if not reply.answered:
        return f"no-answer:{reply.error or 'incomplete'}", []
    if reply.status == 200:
        return _judge_document(call, reply.body), []
    return _judge_error(call, reply)


def _judge_document(call: Call, body: bytes) -> str:
    text = "".join(f" t{i}" for i in range(call.tokens))
    try:
        document = json.loads(body)
    except ValueError:
        return f"corrupt:body is not JSON: {body[:60]!r}"
    if not isinstance(document, dict):
        return f"corrupt:body is not an object: {body[:60]!r}"
    wanted = f"msg_{call.tag}" if call.flavor == "anthropic" else f"chatcmpl-{call.tag}"
    if document.get("id") != wanted:
        return f"corrupt:answer of {document.get('id')!r} for {call.tag}"
    got: object
    try:
        if call.flavor == "anthropic":
            got = "".join(part.get("text", "") for part in document.get("content") or [])
        else:
            got = ((document.get("choices") or [{}])[0].get("message") or {}).get("content")
    except (AttributeError, IndexError, TypeError):
        return f"corrupt:unexpected shape {body[:60]!r}"
    if got != text:
        return f"corrupt:content {str(got)[:60]!r}"
    return "ok"


def _judge_error(call: Call, reply: Reply) -> tuple[str, list[str]]:
    problems = []
    code = "?"
    try:
        document = json.loads(reply.body)
    except ValueError:
        document = None
    if call.flavor == "anthropic":
        err = document.get("error") if isinstance(document, dict) else None
        if (
            not isinstance(document, dict)
            or document.get("type") != "error"
            or not isinstance(err, dict)
        ):
            problems.append(f"not an Anthropic error envelope: {reply.body[:80]!r}")
        else:
            code = code_of_message(str(err.get("message", "")))
    else:
        err = document.get("error") if isinstance(document, dict) else None
        if not isinstance(err, dict) or "message" not in err:
            problems.append(f"not an OpenAI error envelope: {reply.body[:80]!r}")
        else:
            code = str(err.get("code"))
    if reply.status in (429, 503) and "retry-after" not in reply.headers:
        problems.append(f"{reply.status} without Retry-After")
    return f"error:{reply.status}:{code}", problems
