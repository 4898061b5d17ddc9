"""Every error the relay can raise, and the one place they become HTTP responses.

Hierarchy::

    RelayError                      (500)
    ├── ClientError
    │   ├── BadRequest              (400)
    │   ├── Unauthorized            (401)
    │   │   ├── KeyExpired
    │   │   └── JoinRefused     (a join token that cannot be used, SPEC §22)
    │   ├── ModelNotAllowed         (403, the API key may not use the model)
    │   ├── ModelNotFound           (404)
    │   ├── NotFound                (404, a path the relay does not serve)
    │   │   └── StreamNotFound      (404, no retained response of that id for this key)
    │   ├── MethodNotAllowed        (405, with Allow)
    │   ├── PayloadTooLarge         (413)
    │   │   └── FileBytesExceeded   (a key's stored files would pass their bytes)
    │   ├── UpgradeRequired         (426)
    │   ├── StreamGone              (410, a replay needs bytes the bounds dropped)
    │   ├── UnsupportedMediaType    (415)
    │   ├── QueueFull               (429)
    │   ├── RateLimited             (429, an API key's limit; with Retry-After)
    │   │   ├── ConcurrencyLimited
    │   │   ├── RequestRateLimited
    │   │   ├── BatchLinesExceeded  (too many of the key's batch lines waiting)
    │   │   ├── FileCountExceeded   (the key keeps as many files as it may)
    │   │   └── StreamsExceeded     (the key holds as many resumable responses as it may)
    │   ├── QuotaExceeded           (429, an API key's token budget; with Retry-After)
    │   │   ├── DailyQuotaExceeded
    │   │   └── MonthlyQuotaExceeded
    │   └── HeadersTooLarge         (431)
    ├── WorkerFailed                (502)
    ├── ServiceUnavailable          (503)
    │   ├── ProviderDisabled
    │   ├── ProviderGone
    │   ├── RequeueExhausted
    │   ├── WorkerLost
    │   ├── WorkerUnavailable       (cluster: placed again by the client's process)
    │   ├── ModelLoadFailed         (no worker could load the model)
    │   ├── StreamsUnavailable      (resumable responses cannot be kept or read now)
    │   ├── StreamLost              (a Redis failover lost a resumable response's last part)
    │   ├── DeadlineUnmeetable      (no worker is predicted to meet the first-token deadline)
    │   └── ShuttingDown
    ├── GatewayTimeout              (504)
    │   ├── QueueTimeout
    │   ├── ModelLoadTimeout        (the model was not loaded in time)
    │   └── RequestTimeout
    ├── StreamTooLarge              (502, only ever seen mid-stream)
    ├── SlowClient                  (499, only ever seen mid-stream)
    └── ProtocolError               (a worker broke the wire protocol: close 1002)

Messages are stable and sanitized: they never echo worker internals to clients.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import msgspec

Flavor = Literal["openai", "anthropic", "responses"]


class RelayError(Exception):
    status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"
    code: ClassVar[str] = "internal_error"
    default_message: ClassVar[str] = "Internal relay error"
    #: Seconds for ``Retry-After``; the limit errors set it per instance.
    retry_after: int | None = None
    #: Outcome label used by stats and the request log.
    outcome: ClassVar[str] = "error"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or self.default_message
        #: Extra response headers this error needs (``Allow`` on a 405).
        self.headers: list[tuple[bytes, bytes]] = []
        super().__init__(self.message)


class ClientError(RelayError):
    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "invalid_request"
    default_message = "Invalid request"
    outcome = "bad_request"


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status = 401
    openai_type = "invalid_request_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"
    default_message = "Invalid or missing API key"
    outcome = "unauthorized"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message)
        # RFC 9110 §11.6.1: a 401 names the scheme it takes (every envelope, every method).
        self.headers.append((b"www-authenticate", b"Bearer"))


class KeyExpired(Unauthorized):
    code = "expired_api_key"
    default_message = "API key has expired"
    outcome = "key_expired"


class JoinRefused(Unauthorized):
    """A join token that cannot be used (SPEC §22): unknown, spent, expired, revoked, or
    its provider is disabled; the message says which."""

    code = "join_refused"
    default_message = "Invalid join token"
    outcome = "join_refused"


class ModelNotAllowed(ClientError):
    status = 403
    openai_type = "permission_error"
    anthropic_type = "permission_error"
    code = "model_not_allowed"
    outcome = "model_not_allowed"

    def __init__(self, model: str) -> None:
        super().__init__(f"This API key may not use model '{_shown(model)}'")


class ModelNotFound(ClientError):
    status = 404
    anthropic_type = "not_found_error"
    code = "model_not_found"
    outcome = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"model '{_shown(model)}' is not served here")


class MethodNotAllowed(ClientError):
    status = 405
    code = "method_not_allowed"
    default_message = "Method not allowed"

    def __init__(self, message: str | None = None, *, allow: str = "") -> None:
        super().__init__(message)
        if allow:
            self.headers.append((b"allow", allow.encode()))


class NotFound(ClientError):
    """A path the relay does not serve."""

    status = 404
    anthropic_type = "not_found_error"
    code = "not_found"
    default_message = "Not found"


class StreamNotFound(NotFound):
    """No resumable response of that id is retained for the caller's key (never
    created, expired, deleted, or another key's: they all look the same)."""

    code = "stream_not_found"
    default_message = "Stream not found or expired"


class StreamGone(ClientError):
    """A replay asked for bytes (or events) of a retained response that its bounds
    already dropped (STREAM_RETAIN_BYTES, STREAM_RETAIN_TOTAL_BYTES)."""

    status = 410
    code = "stream_offset_lost"
    default_message = "The relay no longer holds that part of the stream; start again"


class UpgradeRequired(ClientError):
    """Plain HTTP on a worker's WebSocket endpoint."""

    status = 426
    code = "upgrade_required"
    default_message = "This endpoint takes WebSocket connections from workers"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message)
        self.headers.append((b"upgrade", b"websocket"))


class PayloadTooLarge(ClientError):
    status = 413
    anthropic_type = "request_too_large"
    code = "request_too_large"
    default_message = "Request body is too large"


class FileBytesExceeded(PayloadTooLarge):
    """An upload would take the files its key keeps past BATCH_MAX_FILE_BYTES_PER_KEY."""

    code = "file_bytes_exceeded"

    def __init__(self, limit: int, used: int) -> None:
        super().__init__(
            f"Files kept for this API key may take at most {limit} bytes in all "
            f"({used} in use); delete some before uploading this one"
        )


class UnsupportedMediaType(ClientError):
    status = 415
    code = "unsupported_media_type"
    default_message = "Content-Type must be application/json"


class QueueFull(ClientError):
    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"
    code = "queue_full"
    default_message = "Service temporarily at capacity, please retry"
    retry_after = 1
    outcome = "queue_full"


class RateLimited(ClientError):
    """An API key is over one of its rate limits (SPEC §13); ``retry_after`` says when
    the next request would pass."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"
    code = "rate_limit_exceeded"
    default_message = "Rate limit exceeded for this API key"
    outcome = "rate_limited"

    def __init__(self, message: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, retry_after)


class ConcurrencyLimited(RateLimited):
    outcome = "over_concurrency"


class RequestRateLimited(RateLimited):
    outcome = "over_request_rate"


class BatchLinesExceeded(RateLimited):
    """A new batch would leave more of the key's lines waiting than
    BATCH_MAX_QUEUED_LINES_PER_KEY allows."""

    code = "batch_lines_exceeded"
    outcome = "over_batch_lines"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"This API key would have more than {limit} batch requests waiting; "
            "retry when some of its batches have ended",
            retry_after=60,
        )


class FileCountExceeded(RateLimited):
    """The key keeps BATCH_MAX_FILES_PER_KEY files already: no retry helps before it
    deletes some (or they pass BATCH_RETENTION_DAYS)."""

    code = "file_count_exceeded"
    outcome = "over_file_count"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"At most {limit} files may be kept for this API key; delete some before "
            "uploading another",
            retry_after=60,
        )


class StreamsExceeded(RateLimited):
    """A new resumable response would leave the key with more running ones than
    STREAM_RETAIN_PER_KEY allows (ended ones make room by themselves)."""

    code = "streams_exceeded"
    outcome = "over_stream_limit"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"This API key already holds {limit} resumable responses that are running; "
            "retry when one has ended",
            retry_after=5,
        )


class QuotaExceeded(RateLimited):
    """An API key spent its token budget: no retry helps before the period ends."""

    openai_type = "insufficient_quota"
    code = "insufficient_quota"
    default_message = "Token budget of this API key is spent"
    outcome = "over_budget"


class DailyQuotaExceeded(QuotaExceeded):
    outcome = "over_daily_budget"


class MonthlyQuotaExceeded(QuotaExceeded):
    outcome = "over_monthly_budget"


class HeadersTooLarge(ClientError):
    status = 431
    code = "request_header_fields_too_large"
    default_message = "Request headers are too large"


class WorkerFailed(RelayError):
    status = 502
    code = "worker_error"
    default_message = "The worker failed to process the request"
    outcome = "worker_error"


class StreamTooLarge(RelayError):
    status = 502
    code = "stream_too_large"
    default_message = "Response stream exceeded the relay's size limit"
    outcome = "stream_too_large"


class SlowClient(RelayError):
    """The client read a stream so slowly that the relay would have had to buffer too much."""

    status = 499  # the client's doing, as nginx counts a client that gave up
    code = "slow_client"
    default_message = "The client read the stream too slowly; the relay ended it"
    outcome = "slow_client"


class ServiceUnavailable(RelayError):
    status = 503
    openai_type = "service_unavailable"
    anthropic_type = "overloaded_error"
    code = "service_unavailable"
    default_message = "Service temporarily unavailable, please retry"
    retry_after = 1
    outcome = "unavailable"


class ProviderDisabled(ServiceUnavailable):
    code = "provider_disabled"
    default_message = "Provider is currently disabled"
    retry_after = 30
    outcome = "provider_disabled"


class ProviderGone(ServiceUnavailable):
    code = "provider_unavailable"
    default_message = "Service temporarily unavailable, please retry"
    outcome = "provider_gone"


class RequeueExhausted(ServiceUnavailable):
    code = "requeue_exhausted"
    default_message = "Request could not be processed after multiple attempts"
    outcome = "requeue_exhausted"


class WorkerLost(ServiceUnavailable):
    code = "worker_lost"
    default_message = "The worker serving this request disconnected"
    outcome = "worker_lost"


class WorkerUnavailable(ServiceUnavailable):
    """Cluster mode: the worker another process placed a request on cannot take it (or
    lost it before its first byte). That process puts the request back in the queue;
    ``spend`` says whether the attempt counts against MAX_REQUEUE_COUNT."""

    code = "worker_unavailable"
    default_message = "The worker serving this request is unavailable"
    outcome = "worker_lost"

    def __init__(self, spend: bool = True) -> None:
        super().__init__()
        self.spend = spend
        self.headers.append((b"x-modelrelay-requeue", b"spend" if spend else b"free"))


class ModelLoadFailed(ServiceUnavailable):
    """Models on demand (SPEC §19): every worker that holds the model failed to load it."""

    code = "model_load_failed"
    retry_after = 5
    outcome = "model_load_failed"

    def __init__(self, model: str) -> None:
        super().__init__(f"Model '{_shown(model)}' could not be loaded on any worker")


class StreamsUnavailable(ServiceUnavailable):
    """Cluster mode: the store of resumable responses (Redis) cannot be reached."""

    code = "streams_unavailable"
    default_message = "Resumable responses cannot be kept or read right now, please retry"
    outcome = "streams_unavailable"


class StreamLost(ServiceUnavailable):
    """Cluster mode: Redis failed over to a replica that lacked a resumable response's last
    records (replication is asynchronous). Its log ends where the new master holds it,
    with this error, and its request is stopped: no reader could have what was lost."""

    code = "stream_lost"
    default_message = (
        "The relay lost the end of this response when its Redis failed over; start again"
    )
    outcome = "stream_lost"


class DeadlineUnmeetable(ServiceUnavailable):
    """Speed-aware routing (SPEC §21): the request's first-token deadline
    (``X-Deadline-Ms``, or its key's or class's default) cannot be met: no worker is
    predicted to send a first token in time, or it waited in the queue until it could
    no longer be. ``Retry-After`` says when the predicted wait will have passed."""

    code = "deadline_unmeetable"
    outcome = "deadline_unmeetable"

    def __init__(self, deadline_ms: int, predicted: float | None) -> None:
        if predicted is None:
            message = f"No worker can send a first token within the deadline of {deadline_ms} ms"
        else:
            message = (
                f"No worker is predicted to send a first token within the deadline of "
                f"{deadline_ms} ms: the predicted wait is {_shown_secs(predicted)}"
            )
        super().__init__(message)
        wait = predicted if predicted is not None else deadline_ms / 1000
        self.retry_after = max(1, min(MAX_RETRY_AFTER, math.ceil(wait)))


class ShuttingDown(ServiceUnavailable):
    code = "shutting_down"
    default_message = "Server is shutting down, please retry"
    retry_after = 2
    outcome = "shutting_down"


class GatewayTimeout(RelayError):
    status = 504
    openai_type = "timeout_error"
    anthropic_type = "api_error"
    code = "timeout"
    default_message = "Request timed out"
    outcome = "timeout"


class QueueTimeout(GatewayTimeout):
    code = "queue_timeout"
    default_message = "Request timed out waiting for worker"
    outcome = "queue_timeout"


class ModelLoadTimeout(GatewayTimeout):
    """Models on demand (SPEC §19): the request waited MODEL_LOAD_TIMEOUT_SECS for its
    model to be loaded somewhere."""

    code = "model_load_timeout"
    outcome = "model_load_timeout"

    def __init__(self, model: str) -> None:
        super().__init__(f"Model '{_shown(model)}' could not be loaded in time")


class RequestTimeout(GatewayTimeout):
    code = "request_timeout"
    default_message = "Request timed out"
    outcome = "request_timeout"


class ProtocolError(RelayError):
    """A worker sent something the wire protocol does not allow."""

    code = "protocol_error"
    default_message = "protocol error"
    outcome = "protocol_error"


_JSON = msgspec.json.Encoder()


#: The longest ``Retry-After`` a predicted wait gives (seconds).
MAX_RETRY_AFTER = 300


def _shown_secs(seconds: float) -> str:
    """A predicted wait as people read it: ``850 ms``, ``2.4 s``."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))} ms"
    return f"{seconds:.1f} s"


def _shown(model: str) -> str:
    """A model name from the client, to quote back in a message: never at any length."""
    return model if len(model) <= 256 else model[:256] + "…"


def error_body(err: RelayError, flavor: Flavor) -> bytes:
    """The JSON error document in the endpoint's own envelope."""
    if flavor == "anthropic":
        return _JSON.encode(
            {"type": "error", "error": {"type": err.anthropic_type, "message": err.message}}
        )
    return _JSON.encode(
        {"error": {"message": err.message, "type": err.openai_type, "code": err.code}}
    )


def error_response(err: RelayError, flavor: Flavor) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Map a relay error to ``(status, headers, body)`` for an HTTP response.

    This is the only function that turns errors into client-visible responses.
    """
    body = error_body(err, flavor)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if err.retry_after is not None:
        headers.append((b"retry-after", str(err.retry_after).encode()))
    headers.extend(err.headers)
    return err.status, headers, body


def describe(exc: BaseException) -> str:
    """``Type: message`` naming any exception in one log line (the worker's backend and
    connection errors); just the type when the message is empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
