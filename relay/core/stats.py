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


_UNROUTED = frozenset({"model_not_found", "bad_request", "unauthorized"})


class RelayStats:
    """Running totals since the process started."""

    def __init__(self, *, recent: int = 200) -> None:
        self.by_outcome: Counter[str] = Counter()
        self.by_endpoint_model_outcome: Counter[tuple[str, str, str]] = Counter()
        self.tokens: Counter[tuple[str, str]] = Counter()
        self.cancels: Counter[str] = Counter()
        self.requeues = 0
        self.dropped_frames = 0
        self.recent: deque[RequestRecord] = deque(maxlen=recent)

    def observe(self, record: RequestRecord) -> None:
        self.by_outcome[record.outcome] += 1
        # Clients can send any model name; only routable ones become label values.
        model = "(unknown)" if record.outcome in _UNROUTED else record.model
        self.by_endpoint_model_outcome[(record.endpoint, model, record.outcome)] += 1
        if record.prompt_tokens:
            self.tokens[(record.model, "prompt")] += record.prompt_tokens
        if record.completion_tokens:
            self.tokens[(record.model, "completion")] += record.completion_tokens
        self.recent.append(record)

    @property
    def total(self) -> int:
        return sum(self.by_outcome.values())

    def tokens_total(self, kind: str) -> int:
        return sum(v for (_, k), v in self.tokens.items() if k == kind)
