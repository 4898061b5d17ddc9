"""Backend metrics federation (SPEC §17): ``GET /metrics/workers``.

Each worker announcing the ``metrics`` extension sends its backend's Prometheus
exposition and its own series every few seconds (:mod:`relay.worker.sampler`). The
worker consumer hands each sample to :meth:`Federation.receive`, which checks the
bounds cheaply (bytes, sample lines) and keeps only the latest sample per worker; the
consumer forgets a worker's sample when its socket closes, so its series vanish with
it. Nothing is parsed on the socket's path.

A scrape parses what changed since the last one with ``prometheus-client``'s parser
(never text splicing), adds ``worker``, ``worker_id`` and ``provider`` labels (a
backend's own label of one of those names is kept as ``exported_<name>``, as
Prometheus does), merges each family across workers and renders them with
``generate_latest`` — all in a thread, since a hundred workers' samples take a
noticeable fraction of a second of pure Python. Families of the same name with
different types on two workers keep the first type seen; the others' series are left
out and counted. A sample that does not parse is dropped and its worker told, like
one over the bounds.

In cluster mode each process serves the series of the workers connected to it:
scrape every process (docs/CLUSTER.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from relay.wire.protocol import MetricsRejected, MetricsSample

#: Labels the relay adds to every federated series.
ADDED_LABELS = ("worker", "worker_id", "provider")
#: A worker's samples closer together than this are dropped unread: a worker sending in
#: a loop costs the relay no more than one sending every second.
MIN_SAMPLE_INTERVAL_SECS = 1.0


@dataclass(slots=True)
class WorkerSample:
    """The latest sample of one worker, parsed at the first scrape that needs it."""

    worker_id: str
    worker: str
    provider: str
    text: str
    series: int
    received: float
    backend_up: bool
    interval: float | None
    families: list[Metric] | None = None
    error: str | None = None
    reported: bool = False


@dataclass(slots=True)
class _Merged:
    metric: Metric
    samples: list[Sample] = field(default_factory=list)


def count_series(text: str) -> int:
    """Sample lines in an exposition: every line that is neither blank nor a comment."""
    count = 0
    for line in text.splitlines():
        line = line.lstrip()
        if line and line[0] != "#":
            count += 1
    return count


def labelled(sample: WorkerSample) -> list[Metric]:
    """Parse ``sample`` and add the relay's labels to every series (raises ValueError)."""
    added = {"worker": sample.worker, "worker_id": sample.worker_id, "provider": sample.provider}
    families: list[Metric] = []
    for family in text_string_to_metric_families(sample.text):
        series = []
        for s in family.samples:
            labels = {(f"exported_{k}" if k in added else k): v for k, v in s.labels.items()}
            labels.update(added)
            series.append(s._replace(labels=labels))
        family.samples = series
        families.append(family)
    return families


class Federation:
    """The latest metrics sample of every connected worker of this process."""

    def __init__(
        self, max_bytes: int, max_series: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.max_series = max_series
        self.clock = clock
        self.samples: dict[str, WorkerSample] = {}
        self.rejected = 0
        self.conflicts = 0
        self._scrape = asyncio.Lock()

    def receive(
        self, worker_id: str, worker: str, provider: str, message: MetricsSample
    ) -> MetricsRejected | None:
        """Keep ``message`` as the worker's latest sample; the answer to send when it is
        refused instead (over a bound). Cheap: called on the worker's socket path."""
        now = self.clock()
        last = self.samples.get(worker_id)
        if last is not None and now - last.received < MIN_SAMPLE_INTERVAL_SECS:
            self.rejected += 1
            return None
        text = message.text
        size = len(text.encode()) if len(text) * 4 > self.max_bytes else len(text)
        reason = None
        if size > self.max_bytes:
            reason = f"sample of {size} bytes is over the relay's bound"
        else:
            series = count_series(text)
            if series > self.max_series:
                reason = f"sample of {series} series is over the relay's bound"
        if reason is not None:
            self.rejected += 1
            return self.refusal(reason)
        self.samples[worker_id] = WorkerSample(
            worker_id=worker_id,
            worker=worker,
            provider=provider,
            text=text,
            series=series,
            received=now,
            backend_up=message.backend_up,
            interval=message.interval_secs,
        )
        return None

    def refusal(self, reason: str) -> MetricsRejected:
        return MetricsRejected(reason=reason, max_bytes=self.max_bytes, max_series=self.max_series)

    def forget(self, worker_id: str) -> None:
        """The worker left: its series go with it."""
        self.samples.pop(worker_id, None)

    async def render(self) -> tuple[bytes, list[tuple[str, MetricsRejected]]]:
        """The exposition of every worker's latest sample, and the refusals to send to
        workers whose new sample did not parse (each reported once)."""
        async with self._scrape:  # two scrapes at once parse nothing twice
            current = list(self.samples.values())
            now = self.clock()
            body = await asyncio.to_thread(self._render, current, now)
        failed = []
        for sample in current:
            if sample.error is not None and not sample.reported:
                sample.reported = True
                self.rejected += 1
                failed.append((sample.worker_id, self.refusal(sample.error)))
        return body, failed

    def _render(self, current: list[WorkerSample], now: float) -> bytes:
        for sample in current:
            if sample.families is None and sample.error is None:
                try:
                    sample.families = labelled(sample)
                except Exception as exc:  # the parser raises ValueError and more
                    sample.error = f"sample does not parse: {str(exc)[:200]}"
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, current, now))
        return generate_latest(registry)


class _Collector(Collector):
    def __init__(self, federation: Federation, current: list[WorkerSample], now: float) -> None:
        self.federation = federation
        self.current = current
        self.now = now

    def collect(self) -> Iterator[Metric]:
        labels = list(ADDED_LABELS)
        age = GaugeMetricFamily(
            "modelrelay_worker_metrics_age_seconds",
            "Seconds since this process last received the worker's metrics sample.",
            labels=labels,
        )
        series = GaugeMetricFamily(
            "modelrelay_worker_metrics_series",
            "Series in the worker's latest metrics sample (0 while it does not parse).",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "modelrelay_worker_metrics_backend_up",
            "1 when the worker's backend answered its last metrics read.",
            labels=labels,
        )
        merged: dict[str, _Merged] = {}
        for sample in sorted(self.current, key=lambda s: (s.provider, s.worker, s.worker_id)):
            key = [sample.worker, sample.worker_id, sample.provider]
            age.add_metric(key, max(0.0, self.now - sample.received))
            series.add_metric(key, sample.series if sample.families is not None else 0)
            up.add_metric(key, 1 if sample.backend_up else 0)
            for family in sample.families or ():
                seen = merged.get(family.name)
                if seen is None:
                    seen = merged[family.name] = _Merged(
                        Metric(family.name, family.documentation, family.type, family.unit)
                    )
                elif seen.metric.type != family.type:
                    self.federation.conflicts += 1
                    continue
                seen.samples.extend(family.samples)
        yield from (age, series, up)
        yield CounterMetricFamily(
            "modelrelay_worker_metrics_rejected",
            "Worker metrics samples dropped: over the bounds or not parseable.",
            value=self.federation.rejected,
        )
        yield CounterMetricFamily(
            "modelrelay_worker_metrics_type_conflicts",
            "Worker families left out because another worker gave the same name another type.",
            value=self.federation.conflicts,
        )
        for entry in merged.values():
            entry.metric.samples = entry.samples
            yield entry.metric
