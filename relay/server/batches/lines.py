"""A batch's input, checked line by line before anything runs.

OpenAI's input is a JSONL file, one ``{"custom_id", "method", "url", "body"}`` per
line; every problem found is reported as OpenAI does, in the failed batch's
``errors`` (code, message, line number), and nothing runs. Anthropic's requests come
in the create call's JSON body (``requests: [{"custom_id", "params"}]``); a malformed
one refuses the call with 400, a model nobody serves makes that request ``errored``.

Each body is forced to non-streaming: a batch's results are stored, never streamed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from relay.wire.errors import BadRequest

#: The most problems one failed validation reports (the first ones, by line).
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID_LEN = 512
_ANTHROPIC_CUSTOM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


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


def problem(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    """One entry of OpenAI's ``errors.data``."""
    return {"code": code, "message": message, "param": param, "line": line}


def non_streaming(body: dict[str, Any]) -> str:
    """The body as JSON text with streaming turned off (and its options dropped)."""
    if body.get("stream"):
        body["stream"] = False
    body.pop("stream_options", None)
    return _encode(body).decode()


def openai_lines(
    content: bytes,
    endpoint: str,
    *,
    max_lines: int,
    max_model_len: int,
    known: Callable[[str], bool],
) -> tuple[list[LineSpec], list[dict]]:
    """Check an OpenAI batch input file; returns the lines, or the problems found."""
    try:
        text = content.decode()
    except UnicodeDecodeError:
        return [], [problem("invalid_file", "The input file is not UTF-8 encoded text")]
    specs: list[LineSpec] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if len(specs) >= max_lines:
            errors.append(
                problem("too_many_lines", f"A batch holds at most {max_lines} requests", number)
            )
            break
        spec, error = _openai_line(raw, number, endpoint, seen, max_model_len, known)
        if error is not None:
            errors.append(error)
            if len(errors) >= MAX_REPORTED_ERRORS:
                break
        elif spec is not None:
            specs.append(LineSpec(len(specs), spec[0], spec[1], spec[2]))
    if not specs and not errors:
        errors.append(problem("empty_file", "The input file holds no requests"))
    return specs, errors


def _openai_line(
    raw: str,
    number: int,
    endpoint: str,
    seen: set[str],
    max_model_len: int,
    known: Callable[[str], bool],
) -> tuple[tuple[str, str, str] | None, dict | None]:
    try:
        document = _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None, problem("invalid_json_line", "This line is not valid JSON", number)
    if not isinstance(document, dict):
        return None, problem("invalid_json_line", "This line is not a JSON object", number)
    custom_id = document.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
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
    if document.get("method", "POST") != "POST":
        return None, problem("invalid_method", "method must be POST", number, "method")
    url = document.get("url")
    if url != endpoint:
        return None, problem(
            "invalid_url", f"url must be the batch's endpoint, {endpoint}", number, "url"
        )
    body = document.get("body")
    if not isinstance(body, dict):
        return None, problem("missing_required_parameter", "body must be an object", number, "body")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        return None, problem(
            "missing_required_parameter", "body.model must be a string", number, "body.model"
        )
    if len(model) > max_model_len or not known(model):
        return None, problem(
            "model_not_found", f"model '{model[:256]}' is not served here", number, "body.model"
        )
    return (custom_id, model, non_streaming(body)), None


def anthropic_lines(
    document: Any,
    *,
    max_lines: int,
    max_model_len: int,
    known: Callable[[str], bool],
) -> list[LineSpec]:
    """Check the body of ``POST /v1/messages/batches``; raises BadRequest saying what
    is wrong. A request for a model nobody serves is kept, marked errored."""
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise BadRequest("requests: an array of requests is required")
    requests = document["requests"]
    if not requests:
        raise BadRequest("requests: at least one request is required")
    if len(requests) > max_lines:
        raise BadRequest(f"requests: a batch holds at most {max_lines} requests")
    specs: list[LineSpec] = []
    seen: set[str] = set()
    for index, item in enumerate(requests):
        where = f"requests.{index}"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: must be an object")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not _ANTHROPIC_CUSTOM_ID.match(custom_id):
            raise BadRequest(f"{where}.custom_id: 1 to 64 letters, digits, '_' or '-'")
        if custom_id in seen:
            raise BadRequest(f"{where}.custom_id: '{custom_id}' is used more than once")
        seen.add(custom_id)
        params = item.get("params")
        if not isinstance(params, dict):
            raise BadRequest(f"{where}.params: must be an object")
        model = params.get("model")
        if not isinstance(model, str) or not model.strip():
            raise BadRequest(f"{where}.params.model: a model is required")
        if len(model) > max_model_len:
            raise BadRequest(f"{where}.params.model: longer than {max_model_len} characters")
        code = message = ""
        if not known(model):
            code, message = "model_not_found", f"model '{model}' is not served here"
        specs.append(LineSpec(index, custom_id, model, non_streaming(params), code, message))
    return specs
