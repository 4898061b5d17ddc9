"""Token usage as a backend reported it, read by the worker from the bytes it relays.

Used by ``worker.py`` (through :mod:`relay.worker.session` and :mod:`relay.worker.backend`) to
fill ``ResponseComplete.token_counts``; imports nothing from Django.
"""

from __future__ import annotations

import re

import msgspec

from relay.wire.protocol import TokenCounts

_USAGE = re.compile(rb'"(?:usage|timings)"\s*:\s*\{')
#: An unfinished line is kept across reads up to this size, then dropped.
_MAX_PARTIAL_LINE = 1024 * 1024


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _cached(doc: dict[str, object]) -> int | None:
    """Prompt tokens a backend says it reused: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (``input_tokens_details`` in the
    Responses API), Anthropic's ``usage.cache_read_input_tokens``, llama-server's
    ``timings.cache_n``; in the document or its ``response`` / ``message``."""
    for holder in (doc, doc.get("response"), doc.get("message")):
        if not isinstance(holder, dict):
            continue
        usage = holder.get("usage")
        if isinstance(usage, dict):
            for details in ("prompt_tokens_details", "input_tokens_details"):
                inner = usage.get(details)
                if isinstance(inner, dict) and _count(inner.get("cached_tokens")) is not None:
                    return _count(inner["cached_tokens"])
            if _count(usage.get("cache_read_input_tokens")) is not None:
                return _count(usage["cache_read_input_tokens"])
        timings = holder.get("timings")
        if isinstance(timings, dict) and _count(timings.get("cache_n")) is not None:
            return _count(timings["cache_n"])
    return None


class UsageScanner:
    """Token usage as the backend reported it, from a JSON body or an SSE stream.

    Understands OpenAI chat (``usage.prompt_tokens``...), the Responses API
    (``response.usage.input_tokens``...) and Anthropic messages
    (``message.usage.input_tokens`` in ``message_start``, ``usage.output_tokens`` in
    ``message_delta``), and the cached prompt tokens of each (see :func:`_cached`).
    Streams are fed in arbitrary pieces; only lines that can hold a usage object are
    JSON-decoded, and the fed bytes are never modified.
    """

    __slots__ = ("_partial", "cached", "completion", "prompt", "total")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None
        self.total: int | None = None
        #: Prompt tokens the backend reused from its cache (SPEC §14).
        self.cached: int | None = None
        self._partial = b""

    def feed(self, data: bytes) -> None:
        if self._partial:
            data = self._partial + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self._partial = data if len(data) <= _MAX_PARTIAL_LINE else b""
            return
        rest = data[cut + 1 :]
        self._partial = rest if len(rest) <= _MAX_PARTIAL_LINE else b""
        if _USAGE.search(data, 0, cut) is None:
            return
        for line in data[:cut].split(b"\n"):
            self._line(line)

    def finish(self) -> None:
        """The stream ended: a last line without a newline still counts."""
        partial, self._partial = self._partial, b""
        self._line(partial)

    def feed_document(self, body: bytes, content_type: str) -> None:
        if "event-stream" in content_type:
            self.feed(body)
            self.finish()
        elif _USAGE.search(body) is not None:
            self._json(body)

    def _line(self, line: bytes) -> None:
        if line.startswith(b"data:") and _USAGE.search(line) is not None:
            self._json(line[5:])

    def _json(self, raw: bytes) -> None:
        try:
            doc = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return
        if not isinstance(doc, dict):
            return
        cached = _cached(doc)
        if cached is not None:
            self.cached = cached
        usage = doc.get("usage")
        if not isinstance(usage, dict):
            for key in ("response", "message"):  # Responses API / Anthropic message_start
                inner = doc.get(key)
                if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
                    usage = inner["usage"]
                    break
            else:
                return
        prompt = _count(usage.get("prompt_tokens"))
        if prompt is None:
            prompt = _count(usage.get("input_tokens"))
        completion = _count(usage.get("completion_tokens"))
        if completion is None:
            completion = _count(usage.get("output_tokens"))
        total = _count(usage.get("total_tokens"))
        # Later events carry the final numbers (Anthropic's message_delta): overwrite.
        if prompt is not None:
            self.prompt = prompt
        if completion is not None:
            self.completion = completion
        if total is not None:
            self.total = total

    def counts(self) -> TokenCounts | None:
        if (
            self.prompt is None
            and self.completion is None
            and self.total is None
            and self.cached is None
        ):
            return None
        total = self.total
        if total is None and self.prompt is not None and self.completion is not None:
            total = self.prompt + self.completion
        return TokenCounts(
            prompt_tokens=self.prompt,
            completion_tokens=self.completion,
            total_tokens=total,
            cached_tokens=self.cached,
        )


def format_counts(counts: TokenCounts | None) -> str:
    """``prompt=… completion=… total=…`` for the worker's per-request debug line."""
    if counts is None:
        return "none reported"
    return (
        f"prompt={counts.prompt_tokens} completion={counts.completion_tokens} "
        f"total={counts.total_tokens}"
    )
