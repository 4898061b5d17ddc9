"""Per-request bookkeeping and live counters, kept in memory and cheap.

The dispatcher builds one :class:`RequestRecord` when a request ends and hands it
to every observer. :class:`RelayStats` is the built-in observer behind ``/health``,
``/admin/stats`` and the dashboard; the request-log writer and the Prometheus
exporter are others.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    key_id: int | None
    provider: str
    model: str
    endpoint: str
    worker_id: str | None
    worker_name: str | None
    status: int
    outcome: str
    streamed: bool
    queue_wait: float
    ttfb: float | None
    duration: float
    prompt_tokens: int | None
    completion_tokens: int | None
    requeues: int
    created_at: float
    cancel_reason: str | None = None
    #: Cluster mode: "origin" (this process had the client, another the worker),
    #: "worker" (the reverse) or "". Each request is counted once per concern: the
    #: client-facing process counts outcomes and latencies, the worker's process
    #: writes the request log, key usage and tokens.
    relay_role: str = ""
    #: Its priority class (SPEC §15), and how often it lost its slot to a higher one.
    service_class: str = "default"
    preemptions: int = 0
    #: Prompt tokens the backend said it reused from its cache (SPEC §14).
    cached_tokens: int | None = None
    #: The tokens are the worker's estimate: the backend reported no usage.
    tokens_estimated: bool = False
    #: Its response outlived its client (SPEC §18): "background", "replay" or "".
    resume: str = ""

    @classmethod
    def rejected(
        cls,
        *,
        status: int,
        outcome: str,
        model: str,
        endpoint: str,
        streamed: bool,
        key_id: int | None,
    ) -> RequestRecord:
        """A request refused before it was admitted: no id, worker or timings."""
        return cls(
            request_id="",
            key_id=key_id,
            provider="",
            model=model,
            endpoint=endpoint,
            worker_id=None,
            worker_name=None,
            status=status,
            outcome=outcome,
            streamed=streamed,
            queue_wait=0.0,
            ttfb=None,
            duration=0.0,
            prompt_tokens=None,
            completion_tokens=None,
            requeues=0,
            created_at=time.time(),
        )


_UNROUTED = frozenset(
    {
        "model_not_found",
        "bad_request",
        "unauthorized",
        # Refused by an API key's limits (SPEC §13), before any routing.
        "key_expired",
        "model_not_allowed",
        "over_concurrency",
        "over_request_rate",
        "over_daily_budget",
        "over_monthly_budget",
    }
)
#: Distinct model names counted separately; later ones are counted as ``(other)``.
#: Model names come from workers and clients, so the label set must stay bounded.
MAX_MODEL_LABELS = 500


class RelayStats:
    """Running totals since the process started (bounded however names churn)."""

    def __init__(self, *, recent: int = 200, max_models: int = MAX_MODEL_LABELS) -> None:
        self.by_outcome: Counter[str] = Counter()
        self.by_endpoint_model_outcome: Counter[tuple[str, str, str]] = Counter()
        self.tokens: Counter[tuple[str, str]] = Counter()
        #: The part of ``tokens`` that workers estimated (no usage reported).
        self.tokens_estimated: Counter[tuple[str, str]] = Counter()
        #: Cancels sent to workers, by reason (queued requests that end never reach one).
        self.cancels: Counter[str] = Counter()
        self.requeues = 0
        self.dropped_frames = 0
        #: Times a worker was asked to pause a stream for a slow client.
        self.pauses = 0
        #: Streams whose client left after their last event reached it: kept in flight
        #: for their completion rather than cancelled.
        self.left_after_end = 0
        #: Times a flex request lost its slot to a request of a higher class (SPEC §15).
        self.preemptions = 0
        #: Models on demand (SPEC §19): loads (and failed ones) and unloads the relay
        #: asked for, and requests that waited for a load.
        self.model_loads = 0
        self.model_load_failures = 0
        self.model_unloads = 0
        self.model_load_waits = 0
        self.recent: deque[RequestRecord] = deque(maxlen=recent)
        self._models: set[str] = set()
        self._max_models = max_models

    def model_label(self, model: str) -> str:
        """``model`` as a counter key: its name while fewer than the cap were seen."""
        if model in self._models:
            return model
        if len(self._models) < self._max_models:
            self._models.add(model)
            return model
        return "(other)"

    def observe(self, record: RequestRecord) -> None:
        if record.relay_role == "worker":
            self._count_tokens(record, self.model_label(record.model))
            return
        self.by_outcome[record.outcome] += 1
        # Clients can send any model name; only routable ones become label values.
        model = "(unknown)" if record.outcome in _UNROUTED else self.model_label(record.model)
        self.by_endpoint_model_outcome[(record.endpoint, model, record.outcome)] += 1
        self._count_tokens(record, model)
        self.recent.append(record)

    def _count_tokens(self, record: RequestRecord, model: str) -> None:
        if record.prompt_tokens:
            self.tokens[(model, "prompt")] += record.prompt_tokens
        if record.completion_tokens:
            self.tokens[(model, "completion")] += record.completion_tokens
        if record.tokens_estimated:
            self.tokens_estimated[(model, "prompt")] += record.prompt_tokens or 0
            self.tokens_estimated[(model, "completion")] += record.completion_tokens or 0

    @property
    def total(self) -> int:
        return sum(self.by_outcome.values())

    def tokens_total(self, kind: str) -> int:
        return sum(v for (_, k), v in self.tokens.items() if k == kind)
