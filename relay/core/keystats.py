"""Who is using the pool: per-API-key figures for operators (SPEC §13).

:class:`KeyStats` is a request observer counting, per key, the requests that ended
and those refused before admission (by outcome: which limit, queue full, …) since
the process started. :func:`key_rows` joins them with what is live — requests of
the key queued or running here (the limiter's open tickets and the queues) and its
token spend today and this month (from the limit store: cluster-wide with Redis) —
into one row per key, busiest first, for ``/admin/stats``, ``/metrics`` and the
dashboard.

Label values stay bounded: :func:`fold` keeps the N busiest rows and sums the rest
into one ``(other)`` row (gauges), and :meth:`KeyStats.label_of` gives counters a
label that never changes once given (the first N keys seen), so a counter of
``(other)`` never goes down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from relay.core.keycache import KeyCache
from relay.core.limits import Limiter
from relay.core.relay import Relay
from relay.core.stats import RequestRecord

#: Keys shown by name in ``/metrics`` and on the dashboard; the rest are ``(other)``.
MAX_KEY_LABELS = 20
OTHER = "(other)"
_SUMMED = ("in_flight", "queued", "tokens_today", "tokens_month", "requests", "rejected")


class KeyStats:
    def __init__(self, max_labels: int = MAX_KEY_LABELS) -> None:
        self.finished: Counter[int] = Counter()
        self.refused: dict[int, Counter[str]] = {}
        self._labelled: set[int] = set()
        self._max_labels = max_labels

    def observe(self, record: RequestRecord) -> None:
        key_id = record.key_id
        if key_id is None or record.relay_role == "worker":
            return  # (cluster mode: the process the client came to counts it)
        if len(self._labelled) < self._max_labels:
            self._labelled.add(key_id)
        if record.request_id:
            self.finished[key_id] += 1
        else:
            refused = self.refused.get(key_id)
            if refused is None:
                refused = self.refused[key_id] = Counter()
            refused[record.outcome] += 1

    def label_of(self, key_id: int, name: str) -> str:
        """``name`` for one of the first keys seen, ``(other)`` for the rest (stable)."""
        return name if key_id in self._labelled else OTHER


def queued_by_key(relay: Relay) -> Counter[int | None]:
    depth: Counter[int | None] = Counter()
    for state in relay.providers.values():
        depth.update(state.queue.depth_by_key())
    return depth


def key_name(keys: KeyCache, key_id: int) -> str:
    known = keys.get(key_id)
    return known.name if known is not None and known.name else f"key #{key_id}"


def key_rows(
    relay: Relay,
    keys: KeyCache,
    limiter: Limiter,
    stats: KeyStats,
    spend: dict[int, tuple[int, int]],
) -> list[dict[str, Any]]:
    """One row per key with anything to show, busiest first (running + queued, then
    tokens today, then requests)."""
    queued = queued_by_key(relay)
    ids: set[int] = {k for k in queued if k is not None}
    ids.update(limiter.open, spend, stats.finished, stats.refused)
    rows: list[dict[str, Any]] = []
    for key_id in ids:
        known = keys.get(key_id)
        limits = known.limits if known is not None else None
        waiting = queued.get(key_id, 0)
        refused = stats.refused.get(key_id, Counter())
        today, month = spend.get(key_id, (0, 0))
        rows.append(
            {
                "id": key_id,
                "name": key_name(keys, key_id),
                #: Its label on counters: its name, or (other) once the first keys took them.
                "label": stats.label_of(key_id, key_name(keys, key_id)),
                "active": known is not None,
                "weight": limits.weight if limits else 1,
                "in_flight": max(0, limiter.open.get(key_id, 0) - waiting),
                "queued": waiting,
                "tokens_today": today,
                "tokens_month": month,
                "tokens_per_day": limits.tokens_per_day if limits else None,
                "tokens_per_month": limits.tokens_per_month if limits else None,
                "max_concurrent": limits.max_concurrent if limits else None,
                "requests_per_minute": limits.requests_per_minute if limits else None,
                "requests": stats.finished.get(key_id, 0),
                "rejected": sum(refused.values()),
                "rejected_by": dict(sorted(refused.items())),
            }
        )
    rows.sort(
        key=lambda r: (
            -(r["in_flight"] + r["queued"]),
            -r["tokens_today"],
            -r["requests"],
            r["name"],
            r["id"],
        )
    )
    return rows


def fold(rows: Iterable[dict[str, Any]], limit: int = MAX_KEY_LABELS) -> list[dict[str, Any]]:
    """The first ``limit`` rows as they are, the rest summed into one ``(other)`` row."""
    kept: list[dict[str, Any]] = []
    other: dict[str, Any] | None = None
    for row in rows:
        if len(kept) < limit:
            kept.append(row)
            continue
        if other is None:
            other = {
                "id": None,
                "name": OTHER,
                "label": OTHER,
                "keys": 0,
                **dict.fromkeys(_SUMMED, 0),
                "rejected_by": {},
            }
        other["keys"] += 1
        for field in _SUMMED:
            other[field] += row[field]
        for outcome, count in row["rejected_by"].items():
            other["rejected_by"][outcome] = other["rejected_by"].get(outcome, 0) + count
    if other is not None:
        kept.append(other)
    return kept
