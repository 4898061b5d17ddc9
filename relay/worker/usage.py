"""Token usage as a backend reported it, read by the worker from the bytes it relays.

Used by ``worker.py`` (through :mod:`relay.worker.session` and :mod:`relay.worker.backend`) to
fill ``ResponseComplete.token_counts``; imports nothing from Django.

Every response is charged: OpenAI chat and legacy completions streams carry usage only
when the client asks (``stream_options.include_usage``), so when it did not, the worker
asks for it (:func:`ask_for_usage`) and takes the extra usage event out of the stream
(:class:`relay.worker.stripper.UsageStripper`): the client receives exactly the bytes
it would have received without it. A stream that still reports no usage is counted by
the worker itself and the figure is marked ``estimated``.

llama-server reports its ``timings`` (prompt tokens processed and reused, tokens
predicted, and the milliseconds each took, which the relay learns speeds from) on the
last chunk of every stream, and on the usage chunk instead once usage
is asked for: the worker then passes that chunk on without its ``usage``, and, having
seen a backend report timings, stops asking it (:attr:`UsageScanner.timings`), so that
its later streams reach the client exactly as they left the backend and are charged
from the timings.
"""

from __future__ import annotations

import math
import re

import msgspec

from relay.wire.protocol import MAX_BACKEND_MS, MAX_TOKENS, TokenCounts

_USAGE = re.compile(rb'"(?:usage|timings)"\s*:\s*\{')
_LINES = re.compile(rb"\r\n?|\n")
#: Endpoints whose streams report usage only when asked (OpenAI's convention).
USAGE_ON_REQUEST = frozenset({"/v1/chat/completions", "/v1/completions"})
#: Request body bytes per prompt token, for an estimate when no usage came back.
BYTES_PER_TOKEN = 4
_INCLUDE_USAGE = '"stream_options":{"include_usage":true},'
_MISSING = object()
#: An unfinished line is kept across reads up to this size, then dropped.
_MAX_PARTIAL_LINE = 1024 * 1024


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _ms(value: object) -> float | None:
    """A duration in milliseconds as a backend reported it, if it is one the relay takes
    (a finite number from 0 to a day): anything else is left out, never sent."""
    if type(value) not in (int, float):
        return None
    ms = float(value)  # type: ignore[arg-type]
    return ms if 0.0 <= ms <= MAX_BACKEND_MS else None  # (NaN fails both)


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

    __slots__ = (
        "_partial",
        "cached",
        "completion",
        "decode_ms",
        "estimate_prompt",
        "events",
        "prefill_ms",
        "prompt",
        "timings",
        "total",
    )

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.completion: int | None = None
        self.total: int | None = None
        #: Prompt tokens the backend reused from its cache (SPEC §14).
        self.cached: int | None = None
        self._partial = b""
        #: Set by :meth:`estimate`: the stream's ``data:`` events are counted, to stand
        #: in for usage the backend does not report.
        self.estimate_prompt: int | None = None
        self.events = 0
        #: The backend reported llama-server's ``timings`` (with its token counts), and
        #: the milliseconds they say the prompt and the generation took (SPEC §21).
        self.timings = False
        self.prefill_ms: float | None = None
        self.decode_ms: float | None = None

    def estimate(self, body_bytes: int) -> None:
        """Count this stream, for an estimate should the backend report no usage."""
        self.estimate_prompt = math.ceil(body_bytes / BYTES_PER_TOKEN)

    def count(self, data: bytes) -> None:
        """Feed, counting events (for streams given :meth:`estimate`)."""
        self.events += data.count(b"data:")
        self.feed(data)

    def feed(self, data: bytes) -> None:
        if self._partial:
            data = self._partial + data
        # Lines end with LF, CRLF or CR (SSE); a CRLF cut between reads makes one
        # empty line more, which holds nothing to read.
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            self._partial = data if len(data) <= _MAX_PARTIAL_LINE else b""
            return
        rest = data[cut + 1 :]
        self._partial = rest if len(rest) <= _MAX_PARTIAL_LINE else b""
        if _USAGE.search(data, 0, cut) is None:
            return
        for line in _LINES.split(data[:cut]):
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
        timings = doc.get("timings")
        if isinstance(timings, dict):
            self._timings(timings, usage_too=isinstance(usage, dict))
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

    def _timings(self, timings: dict[str, object], usage_too: bool) -> None:
        processed = _count(timings.get("prompt_n"))
        predicted = _count(timings.get("predicted_n"))
        if processed is None or predicted is None:
            return
        self.timings = True
        self.prefill_ms = _ms(timings.get("prompt_ms"))
        self.decode_ms = _ms(timings.get("predicted_ms"))
        if usage_too:
            return  # the usage object is what the backend counts as billed
        prompt = processed + (_count(timings.get("cache_n")) or 0)
        if self.prompt is None:
            self.prompt = prompt
        if self.completion is None:
            self.completion = predicted

    def counts(self) -> TokenCounts | None:
        prompt, completion, total, cached = self.prompt, self.completion, self.total, self.cached
        dropped = (
            (prompt or 0) > MAX_TOKENS
            or (completion or 0) > MAX_TOKENS
            or (total or 0) > MAX_TOKENS
            or (cached or 0) > MAX_TOKENS
        )
        if dropped:
            # A count past MAX_TOKENS (a backend's unsigned underflow) is no figure to
            # charge: dropped, as the relay would drop it, and the rest marked an estimate.
            prompt, completion, total, cached = (
                None if count is not None and count > MAX_TOKENS else count
                for count in (prompt, completion, total, cached)
            )
        if prompt is None and completion is None and total is None:
            if self.estimate_prompt is not None and self.events:
                # About one token per event (how llama-server, vLLM and OpenAI stream),
                # less the closing ``data: [DONE]``; the prompt from the request's size.
                completion = max(0, self.events - 1)
                prompt = self.estimate_prompt
                return TokenCounts(
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    total_tokens=prompt + completion,
                    cached_tokens=cached,
                    estimated=True,
                    prefill_ms=self.prefill_ms,
                    decode_ms=self.decode_ms,
                )
            if cached is None and not dropped:
                return None
        if total is None and prompt is not None and completion is not None:
            total = prompt + completion
        return TokenCounts(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total,
            cached_tokens=cached,
            estimated=dropped,
            prefill_ms=self.prefill_ms,
            decode_ms=self.decode_ms,
        )


def ask_for_usage(endpoint_path: str, body: str) -> str | None:
    """The body to send instead of ``body`` so that the stream reports its usage, or
    None when it will anyway (or is no chat/completions stream): the client did not
    set ``stream_options.include_usage``, so the worker sets it.

    Without ``stream_options`` the option is added in front of the client's fields and
    every byte of theirs is kept; otherwise the body is re-encoded with it set.
    """
    if endpoint_path not in USAGE_ON_REQUEST:
        return None
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("stream") is not True:
        return None
    options = doc.get("stream_options", _MISSING)
    if options is _MISSING:
        start = body.index("{") + 1  # it decoded as an object with at least "stream"
        return body[:start] + _INCLUDE_USAGE + body[start:]
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    doc["stream_options"] = {**options, "include_usage": True}
    return msgspec.json.encode(doc).decode()


def format_counts(counts: TokenCounts | None) -> str:
    """``prompt=… completion=… total=…`` for the worker's per-request debug line."""
    if counts is None:
        return "none reported"
    return (
        f"prompt={counts.prompt_tokens} completion={counts.completion_tokens} "
        f"total={counts.total_tokens}{' (estimated)' if counts.estimated else ''}"
    )
