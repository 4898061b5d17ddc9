"""The objects of the Files, Batches and Message Batches APIs, and the result lines, in
the shapes the OpenAI and Anthropic SDKs read.

Result lines are rendered from a line's stored result each time a file is read, the
same bytes every time: an output file is never stored twice.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from batches.models import (
    ANTHROPIC,
    CANCELED,
    CANCELLING,
    FINALIZING,
    LINE_EXPIRED,
    SUCCEEDED,
    VALIDATING,
    Batch,
    BatchLine,
    StoredFile,
)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

#: What a line that never ran says, by why it did not.
NOT_RUN = {
    CANCELED: ("batch_cancelled", "This request was not run: the batch was cancelled."),
    LINE_EXPIRED: (
        "batch_expired",
        "This request could not be run before the batch's completion window ended.",
    ),
}
#: Anthropic's error type for an OpenAI-style error code stored on a line.
_ANTHROPIC_TYPES = {
    "model_not_found": "not_found_error",
    "not_found": "not_found_error",
    "invalid_api_key": "authentication_error",
    "expired_api_key": "authentication_error",
    "model_not_allowed": "permission_error",
    "request_too_large": "request_too_large",
    "invalid_request": "invalid_request_error",
}


def unix(moment: dt.datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def rfc3339(moment: dt.datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def file_object(row: StoredFile) -> dict[str, Any]:
    return {
        "id": row.public_id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": unix(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def openai_batch(batch: Batch) -> dict[str, Any]:
    errors = None
    if batch.errors:
        errors = {"object": "list", "data": batch.errors}
    failed = batch.errored + batch.canceled + batch.expired
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": unix(batch.created_at),
        "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": unix(batch.finalizing_at),
        "completed_at": unix(batch.completed_at),
        "failed_at": unix(batch.failed_at),
        "expired_at": unix(batch.expired_at),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": unix(batch.cancelled_at),
        "request_counts": {
            "total": batch.total,
            "completed": batch.succeeded,
            "failed": failed,
        },
        "usage": {
            "input_tokens": batch.input_tokens,
            "input_tokens_details": {"cached_tokens": batch.cached_tokens},
            "output_tokens": batch.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch.input_tokens + batch.output_tokens,
        },
        "metadata": batch.metadata,
    }


def anthropic_status(batch: Batch) -> str:
    if batch.status == CANCELLING:
        return "canceling"
    if batch.status in (VALIDATING, FINALIZING) or batch.ended_at is None:
        return "in_progress"
    return "ended"


def anthropic_batch(batch: Batch, base_url: str) -> dict[str, Any]:
    status = anthropic_status(batch)
    return {
        "id": batch.public_id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": batch.total - batch.finished,
            "succeeded": batch.succeeded,
            "errored": batch.errored,
            "canceled": batch.canceled,
            "expired": batch.expired,
        },
        "ended_at": rfc3339(batch.ended_at),
        "created_at": rfc3339(batch.created_at),
        "expires_at": rfc3339(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": rfc3339(batch.cancelling_at),
        "results_url": (
            f"{base_url}/v1/messages/batches/{batch.public_id}/results"
            if status == "ended"
            else None
        ),
    }


def batch_object(batch: Batch, base_url: str) -> dict[str, Any]:
    return anthropic_batch(batch, base_url) if batch.api == ANTHROPIC else openai_batch(batch)


def _body(text: str) -> Any:
    """A stored response body as the JSON it is, or as the text it is otherwise."""
    try:
        return _decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text


def openai_result(line: BatchLine) -> bytes:
    """The line of the output file (a response below 400) or of the error file."""
    response = error = None
    if line.status_code is not None:
        response = {
            "status_code": line.status_code,
            "request_id": line.request_id,
            "body": _body(line.response),
        }
    elif line.outcome in NOT_RUN:
        code, message = NOT_RUN[line.outcome]
        error = {"code": code, "message": message}
    else:
        error = {"code": line.error_code or "internal_error", "message": line.error_message}
    document = {
        "id": f"batch_req_{line.pk}",
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }
    return _encode(document) + b"\n"


def anthropic_result(line: BatchLine) -> bytes:
    """The line of a Message Batch's results for one request."""
    result: dict[str, Any]
    if line.outcome == SUCCEEDED:
        result = {"type": "succeeded", "message": _body(line.response)}
    elif line.outcome in (CANCELED, LINE_EXPIRED):
        result = {"type": line.outcome}
    else:
        result = {"type": "errored", "error": _anthropic_error(line)}
    return _encode({"custom_id": line.custom_id, "result": result}) + b"\n"


def _anthropic_error(line: BatchLine) -> dict[str, Any]:
    if line.status_code is not None:
        body = _body(line.response)
        if isinstance(body, dict) and body.get("type") == "error":
            return body  # the backend answered in Anthropic's own envelope
        message = f"The backend answered {line.status_code}"
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message") or message)
        kind = "invalid_request_error" if line.status_code < 500 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _ANTHROPIC_TYPES.get(line.error_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": line.error_message}}
