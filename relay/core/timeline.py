"""Request outcomes over the last minutes, in fixed time buckets, for the dashboard chart.

A :class:`Timeline` is a relay observer: it is handed every finished request and
counts it in the bucket of the moment it finished, by outcome class (``ok``,
``client_error`` for 4xx, ``error`` for 5xx and relay failures, ``cancelled``).
It keeps only the last ``buckets`` buckets, so memory is constant.

:func:`for_relay` attaches one lazily, the first time a dashboard asks, and
back-fills it from the relay's short list of recent requests, so the chart is not
empty right after a restart of the page. Plain Python: no Django import.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

from relay.core.relay import Relay
from relay.core.stats import RequestRecord

#: Chart series, in drawing order (bottom of the stack first).
CLASSES = ("ok", "client_error", "error", "cancelled")


def outcome_class(record: RequestRecord) -> str:
    if record.outcome == "cancelled":
        return "cancelled"
    if record.status < 400:
        return "ok"
    if record.status < 500:
        return "client_error"
    return "error"


class Timeline:
    def __init__(
        self,
        *,
        bucket_secs: float = 10.0,
        buckets: int = 30,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bucket_secs = bucket_secs
        self.buckets = buckets
        self.clock = clock
        self._counts: dict[int, dict[str, int]] = {}

    def _index(self, at: float) -> int:
        return int(at // self.bucket_secs)

    def add(self, record: RequestRecord, at: float) -> None:
        index = self._index(at)
        if index <= self._index(self.clock()) - self.buckets:
            return
        counts = self._counts.setdefault(index, dict.fromkeys(CLASSES, 0))
        counts[outcome_class(record)] += 1
        if len(self._counts) > self.buckets + 1:
            self._prune()

    def observe(self, record: RequestRecord) -> None:
        """Relay observer: called once when a request ends."""
        self.add(record, self.clock())

    def _prune(self) -> None:
        oldest = self._index(self.clock()) - self.buckets + 1
        for index in [i for i in self._counts if i < oldest]:
            del self._counts[index]

    def series(self) -> dict[str, Any]:
        """Counts per class for each bucket, oldest first, the current (partial) one last."""
        newest = self._index(self.clock())
        indexes = range(newest - self.buckets + 1, newest + 1)
        empty = dict.fromkeys(CLASSES, 0)
        rows = [self._counts.get(i, empty) for i in indexes]
        return {
            "bucket_secs": self.bucket_secs,
            "end": (newest + 1) * self.bucket_secs,
            "classes": list(CLASSES),
            "counts": {c: [row[c] for row in rows] for c in CLASSES},
        }

    def rate(self, window: float = 60.0) -> float:
        """Requests per second finished over the last ``window`` seconds (whole buckets)."""
        now = self.clock()
        spans = max(1, round(window / self.bucket_secs))
        newest = self._index(now)
        total = sum(
            sum(self._counts.get(i, {}).values()) for i in range(newest - spans + 1, newest + 1)
        )
        # The newest bucket is only partly elapsed: divide by the time actually covered.
        covered = (spans - 1) * self.bucket_secs + (now - newest * self.bucket_secs)
        return total / covered if covered > 0 else 0.0


_timelines: weakref.WeakKeyDictionary[Relay, Timeline] = weakref.WeakKeyDictionary()


def for_relay(relay: Relay) -> Timeline:
    """The relay's timeline, attached as an observer (and back-filled) on first use."""
    timeline = _timelines.get(relay)
    if timeline is None:
        timeline = Timeline()
        for record in relay.stats.recent:
            timeline.add(record, record.created_at + record.duration)
        relay.observers.append(timeline.observe)
        _timelines[relay] = timeline
    return timeline
