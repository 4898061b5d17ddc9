"""A batch's input, checked request by request before anything runs.

OpenAI's input is a JSONL file, one ``{"custom_id", "method", "url", "body"}`` per
line; every problem found is reported as OpenAI does, in the failed batch's
``errors`` (code, message, line number), and nothing runs. Anthropic's requests come
in the create call's JSON body (``requests: [{"custom_id", "params"}]``); a malformed
one refuses the call (400, or 413 for one too large), a model nobody serves makes
that request ``errored``.

Only what the engine needs is decoded (typed ``msgspec`` structs: ``custom_id``,
``method``, ``url``, the body's ``model`` and ``stream``); each body is kept as the
raw bytes it came as (``msgspec.Raw``), and forwarded as such, rewritten only to
turn streaming off (a batch's results are stored, never streamed). A line (OpenAI),
or a request's ``params`` (Anthropic), may be MAX_REQUEST_BYTES long, as a body sent
directly may.

:func:`check_openai` and :func:`check_anthropic` read an input from a file and write
the requests it holds to another (:func:`records` reads them back). They run in the
checking process (:mod:`relay.server.batches.checker`), never in the server's: the
decoding of a large input holds the interpreter for as long as it takes. This module
imports nothing of Django.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

#: The most problems one failed validation reports (the first ones, by line).
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID_LEN = 512
#: An input file is read this much at a time.
READ_BYTES = 1024 * 1024
_ANTHROPIC_CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ABSENT = msgspec.Raw()
_FALSE = msgspec.Raw(b"false")


class _Line(msgspec.Struct):
    """What is read of an OpenAI input line (the rest is skipped unread)."""

    custom_id: msgspec.Raw = _ABSENT
    method: msgspec.Raw = _ABSENT
    url: msgspec.Raw = _ABSENT
    body: msgspec.Raw = _ABSENT


class _Batch(msgspec.Struct):
    """What is read of a Message Batches body."""

    requests: msgspec.Raw = _ABSENT


class _Request(msgspec.Struct):
    custom_id: msgspec.Raw = _ABSENT
    params: msgspec.Raw = _ABSENT


class _Head(msgspec.Struct):
    """What is read of a request's body."""

    model: msgspec.Raw = _ABSENT
    stream: msgspec.Raw = _ABSENT
    stream_options: msgspec.Raw = _ABSENT


class Record(msgspec.Struct, array_like=True):
    """One request as written for :func:`records`: its body's bytes follow."""

    index: int
    custom_id: str
    model: str
    size: int
    error_code: str = ""
    error_message: str = ""


_line_decoder = msgspec.json.Decoder(_Line)
_batch_decoder = msgspec.json.Decoder(_Batch)
_request_decoder = msgspec.json.Decoder(_Request)
_items_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_head_decoder = msgspec.json.Decoder(_Head)
_members_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_record_decoder = msgspec.json.Decoder(Record)
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Limits:
    """What one batch may hold: requests, bytes per request, a model name's length,
    and the models served (an unknown one is an error)."""

    max_lines: int
    max_request_bytes: int
    max_model_len: int
    known: frozenset[str]


@dataclass(frozen=True, slots=True)
class Checked:
    """The outcome of a check: the requests written, or why the input is refused
    (OpenAI: ``errors``, the problems found; Anthropic: ``refusal``, the status kind
    ``"bad_request"`` or ``"too_large"`` and the message)."""

    count: int
    errors: list[dict[str, Any]] = field(default_factory=list)
    refusal: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class LineSpec:
    """One request of a batch, ready to store: the body as the worker will get it."""

    index: int
    custom_id: str
    model: str
    body: str
    #: Set when the request can never run (Anthropic: a model nobody serves).
    error_code: str = ""
    error_message: str = ""


class Refused(Exception):
    """A Message Batches body that is refused whole (in the checking process)."""

    def __init__(self, message: str, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.kind = kind


def problem(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    """One entry of OpenAI's ``errors.data``."""
    return {"code": code, "message": message, "param": param, "line": line}


def _text(raw: msgspec.Raw) -> str | None:
    """A member that must be a string, or None (absent, or anything else)."""
    if not len(raw):
        return None
    try:
        return msgspec.json.decode(raw, type=str)
    except (msgspec.DecodeError, RecursionError):
        return None


def forwarded(body: msgspec.Raw, head: _Head) -> bytes:
    """The body as the worker gets it: its bytes as sent, unless it asks for a stream
    (then ``stream`` is false and ``stream_options`` gone, its other members kept)."""
    streams = len(head.stream) and bytes(head.stream) not in (b"false", b"null")
    if not streams and not len(head.stream_options):
        return bytes(body)
    members = _members_decoder.decode(body)
    if streams:
        members["stream"] = _FALSE
    members.pop("stream_options", None)
    return _encode(members)


def _write(out: IO[bytes], record: Record, body: bytes) -> None:
    out.write(_encode(record) + b"\n")
    out.write(body)


def records(path: str) -> Iterator[LineSpec]:
    """The requests a check wrote, in order, one at a time."""
    with open(path, "rb") as stored:
        while header := stored.readline():
            record = _record_decoder.decode(header)
            body = stored.read(record.size).decode()
            yield LineSpec(
                record.index,
                record.custom_id,
                record.model,
                body,
                record.error_code,
                record.error_message,
            )


# ------------------------------------------------------------------------- OpenAI


def check_openai(source: str, out: str, endpoint: str, limits: Limits) -> Checked:
    """Check an OpenAI batch input file, line by line; writes its requests to ``out``
    when every line is right, else returns the problems found."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0
    with open(source, "rb") as stream, open(out, "wb") as written:
        for number, raw in _jsonl(stream, limits.max_request_bytes):
            if raw is not None and not raw.strip():
                continue
            if count >= limits.max_lines:
                errors.append(
                    problem(
                        "too_many_lines",
                        f"A batch holds at most {limits.max_lines} requests",
                        number,
                    )
                )
                break
            checked: tuple[str, str, bytes] | None = None
            error: dict | None
            if raw is None:
                error = problem(
                    "line_too_large",
                    f"This line is larger than {limits.max_request_bytes} bytes, "
                    "the most a request may be",
                    number,
                )
            else:
                checked, error = _openai_line(raw, number, endpoint, seen, limits)
            if error is not None:
                errors.append(error)
                if len(errors) >= MAX_REPORTED_ERRORS:
                    break
            elif checked is not None and not errors:
                custom_id, model, body = checked
                _write(written, Record(count, custom_id, model, len(body)), body)
            count += 1
    if not count and not errors:
        errors.append(problem("empty_file", "The input file holds no requests"))
    return Checked(0 if errors else count, errors)


def _jsonl(stream: IO[bytes], most: int) -> Iterator[tuple[int, bytes | None]]:
    """Each line of a JSONL stream with its number; None for a line over ``most``
    bytes (never held: what follows is skipped to the next newline)."""
    number = size = 0
    parts: list[bytes] = []
    over = False
    while block := stream.read(READ_BYTES):
        start = 0
        while True:
            end = block.find(b"\n", start)
            piece = block[start:] if end < 0 else block[start:end]
            if not over:
                size += len(piece)
                over = size > most
                parts = [] if over else [*parts, piece] if piece else parts
            if end < 0:
                break
            number += 1
            yield number, None if over else b"".join(parts)
            parts, size, over = [], 0, False
            start = end + 1
    if size or over:
        yield number + 1, None if over else b"".join(parts)


def _openai_line(
    raw: bytes, number: int, endpoint: str, seen: set[str], limits: Limits
) -> tuple[tuple[str, str, bytes] | None, dict | None]:
    try:
        line = _line_decoder.decode(raw)
    except msgspec.ValidationError:
        return None, problem("invalid_json_line", "This line is not a JSON object", number)
    except msgspec.DecodeError:
        return None, problem("invalid_json_line", "This line is not valid JSON", number)
    except RecursionError:
        return None, problem("invalid_json_line", "This line is nested too deeply", number)
    custom_id = _text(line.custom_id)
    if not custom_id:
        return None, problem(
            "missing_required_parameter", "custom_id must be a string", number, "custom_id"
        )
    if len(custom_id) > MAX_CUSTOM_ID_LEN:
        return None, problem(
            "invalid_custom_id",
            f"custom_id is longer than {MAX_CUSTOM_ID_LEN} characters",
            number,
            "custom_id",
        )
    if custom_id in seen:
        return None, problem(
            "duplicate_custom_id",
            "custom_id must be unique within the batch; this one appears twice",
            number,
            "custom_id",
        )
    seen.add(custom_id)
    if len(line.method) and _text(line.method) != "POST":
        return None, problem("invalid_method", "method must be POST", number, "method")
    if _text(line.url) != endpoint:
        return None, problem(
            "invalid_url", f"url must be the batch's endpoint, {endpoint}", number, "url"
        )
    try:
        head = _head_decoder.decode(line.body) if len(line.body) else None
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        head = None
    if head is None:
        return None, problem("missing_required_parameter", "body must be an object", number, "body")
    model = _text(head.model)
    if not model or not model.strip():
        return None, problem(
            "missing_required_parameter", "body.model must be a string", number, "body.model"
        )
    if len(model) > limits.max_model_len or model not in limits.known:
        return None, problem(
            "model_not_found", f"model '{model[:256]}' is not served here", number, "body.model"
        )
    body = forwarded(line.body, head)
    try:
        body.decode()
    except UnicodeDecodeError:
        return None, problem("invalid_json_line", "This line is not UTF-8 encoded text", number)
    return (custom_id, model, body), None


# ------------------------------------------------------------------------- Anthropic


def check_anthropic(source: str, out: str, limits: Limits) -> Checked:
    """Check the body of ``POST /v1/messages/batches`` and write its requests to
    ``out``; a malformed body is refused whole, saying what is wrong. A request for a
    model nobody serves is kept, marked errored."""
    with open(source, "rb") as stream:
        data = stream.read()
    try:
        with open(out, "wb") as written:
            count = _anthropic_requests(data, written, limits)
    except Refused as refused:
        return Checked(0, refusal=(refused.kind, str(refused)))
    return Checked(count)


def _anthropic_requests(data: bytes, out: IO[bytes], limits: Limits) -> int:
    try:
        requests = _batch_decoder.decode(data).requests
        items = _items_decoder.decode(requests) if len(requests) else None
    except msgspec.ValidationError:
        items = None
    except msgspec.DecodeError:
        raise Refused("Request body is not valid JSON") from None
    except RecursionError:
        raise Refused("Request body is nested too deeply") from None
    if items is None:
        raise Refused("requests: an array of requests is required")
    if not items:
        raise Refused("requests: at least one request is required")
    if len(items) > limits.max_lines:
        raise Refused(f"requests: a batch holds at most {limits.max_lines} requests")
    seen: set[str] = set()
    for index, item in enumerate(items):
        where = f"requests.{index}"
        try:
            request = _request_decoder.decode(item)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            raise Refused(f"{where}: must be an object") from None
        custom_id = _text(request.custom_id)
        if custom_id is None or not _ANTHROPIC_CUSTOM_ID.match(custom_id):
            raise Refused(f"{where}.custom_id: 1 to 64 letters, digits, '_' or '-'")
        if custom_id in seen:
            raise Refused(f"{where}.custom_id: '{custom_id}' is used more than once")
        seen.add(custom_id)
        if len(request.params) > limits.max_request_bytes:
            raise Refused(
                f"{where}.params: larger than {limits.max_request_bytes} bytes, "
                "the most a request may be",
                "too_large",
            )
        try:
            head = _head_decoder.decode(request.params) if len(request.params) else None
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            head = None
        if head is None:
            raise Refused(f"{where}.params: must be an object")
        model = _text(head.model)
        if not model or not model.strip():
            raise Refused(f"{where}.params.model: a model is required")
        if len(model) > limits.max_model_len:
            raise Refused(f"{where}.params.model: longer than {limits.max_model_len} characters")
        body = forwarded(request.params, head)
        try:
            body.decode()
        except UnicodeDecodeError:
            raise Refused(f"{where}.params: not UTF-8 encoded text") from None
        code = message = ""
        if model not in limits.known:
            code, message = "model_not_found", f"model '{model}' is not served here"
        _write(out, Record(index, custom_id, model, len(body), code, message), body)
    return len(items)
