"""Backend metrics federation (SPEC §17): ``GET /metrics/workers``.

Each worker announcing the ``metrics`` extension sends its backend's Prometheus
exposition and its own series every few seconds (:mod:`relay.worker.sampler`). The
worker consumer hands each sample to :meth:`Federation.receive`, which checks the
bounds cheaply (bytes, sample lines) and keeps only the latest sample per worker; the
consumer forgets a worker's sample when its socket closes, so its series vanish with
it. Nothing is parsed on the socket's path.

A scrape parses the samples with ``prometheus-client``'s parser (never text
splicing), adds ``worker``, ``worker_id`` and ``provider`` labels (a backend's own
label of one of those names is kept as ``exported_<name>``, as Prometheus does),
merges each family across workers and renders them with ``generate_latest``. A
hundred workers' samples take seconds of pure Python (bench scenario (l)), and a
thread would hold the GIL that the event loop relaying tokens needs: so this runs in
a process of its own (:func:`render_workers`: one long-lived process, started at the
first scrape), which keeps each worker's parsed sample while its text is unchanged.
The relay writes its own families about the samples (age, series, ...) beside them.
Families of the same name with different types on two workers keep the first type
seen; the others' series are left out and counted. A sample that does not parse is
dropped and its worker told, like one over the bounds.

In cluster mode each process serves the series of the workers connected to it:
scrape every process (docs/CLUSTER.md).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from relay.wire.protocol import MetricsRejected, MetricsSample

logger = logging.getLogger("relay.federation")

#: Labels the relay adds to every federated series.
ADDED_LABELS = ("worker", "worker_id", "provider")
#: A worker's samples closer together than this are dropped unread: a worker sending in
#: a loop costs the relay no more than one sending every second.
MIN_SAMPLE_INTERVAL_SECS = 1.0
#: The relay's own families about the samples; a worker's family of such a name is left out.
OWN_PREFIX = "modelrelay_worker_metrics_"

#: What a scrape hands the rendering process per worker: id, name, provider, text.
Job = tuple[str, str, str, str]


@dataclass(slots=True)
class WorkerSample:
    """The latest sample of one worker."""

    worker_id: str
    worker: str
    provider: str
    text: str
    series: int
    received: float
    backend_up: bool
    interval: float | None
    #: Why it does not parse (None: it did, or no scrape has parsed it yet).
    error: str | None = None
    reported: bool = False


def count_series(text: str) -> int:
    """Sample lines in an exposition: every line that is neither blank nor a comment."""
    count = 0
    for line in text.splitlines():
        line = line.lstrip()
        if line and line[0] != "#":
            count += 1
    return count


def labelled(worker_id: str, worker: str, provider: str, text: str) -> list[Metric]:
    """Parse ``text`` and add the relay's labels to every series (raises ValueError)."""
    added = {"worker": worker, "worker_id": worker_id, "provider": provider}
    families: list[Metric] = []
    for family in text_string_to_metric_families(text):
        series = []
        for s in family.samples:
            labels = {(f"exported_{k}" if k in added else k): v for k, v in s.labels.items()}
            labels.update(added)
            series.append(s._replace(labels=labels))
        family.samples = series
        families.append(family)
    return families


#: In the rendering process: worker id -> (name, provider, text, its parsed families).
_parsed: dict[str, tuple[str, str, str, list[Metric]]] = {}


def render_workers(job: list[Job]) -> tuple[bytes, dict[str, str], int]:
    """The exposition of the workers' families, why a sample did not parse (by worker
    id), and how many families were left out for a type conflict. Runs in the
    rendering process (or, as a fallback, a thread: one call at a time)."""
    keep: dict[str, tuple[str, str, str, list[Metric]]] = {}
    errors: dict[str, str] = {}
    merged: dict[str, Metric] = {}
    conflicts = 0
    for worker_id, worker, provider, text in sorted(job, key=lambda j: (j[2], j[1], j[0])):
        cached = _parsed.get(worker_id)
        if cached is not None and cached[:3] == (worker, provider, text):
            families = cached[3]
        else:
            try:
                families = labelled(worker_id, worker, provider, text)
            except Exception as exc:  # the parser raises ValueError and more
                errors[worker_id] = f"sample does not parse: {str(exc)[:200]}"
                continue
        keep[worker_id] = (worker, provider, text, families)
        for family in families:
            if family.name.startswith(OWN_PREFIX):
                continue
            seen = merged.get(family.name)
            if seen is None:
                seen = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            elif seen.type != family.type:
                conflicts += 1
                continue
            seen.samples.extend(family.samples)
    _parsed.clear()
    _parsed.update(keep)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry), errors, conflicts


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class Federation:
    """The latest metrics sample of every connected worker of this process."""

    def __init__(
        self,
        max_bytes: int,
        max_series: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        in_process: bool = False,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_series = max_series
        self.clock = clock
        self.samples: dict[str, WorkerSample] = {}
        self.rejected = 0
        self.conflicts = 0
        #: True: render in a thread of this process (tests; the fallback).
        self.in_process = in_process
        self._executor: Executor | None = None
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
        async with self._scrape:  # one rendering at a time: its cache is not shared
            current = list(self.samples.values())
            job = [(s.worker_id, s.worker, s.provider, s.text) for s in current]
            body, errors, self.conflicts = await self._render(job)
        failed = []
        for sample in current:
            sample.error = errors.get(sample.worker_id)
            if sample.error is not None and not sample.reported:
                sample.reported = True
                self.rejected += 1
                failed.append((sample.worker_id, self.refusal(sample.error)))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, current, self.clock()))
        # Two renderings of disjoint families (a worker's family named like ours was
        # left out): together one valid exposition.
        return generate_latest(registry) + body, failed

    async def _render(self, job: list[Job]) -> tuple[bytes, dict[str, str], int]:
        if not self.in_process:
            try:
                if self._executor is None:
                    self._executor = ProcessPoolExecutor(
                        max_workers=1, mp_context=multiprocessing.get_context("spawn")
                    )
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor, render_workers, job)
            except (BrokenProcessPool, OSError) as exc:
                # Killed (out of memory?) or could not start: a new one next time, and
                # this scrape in a thread rather than not at all.
                logger.warning("the metrics rendering process failed (%s); starting anew", exc)
                self.close()
        return await asyncio.to_thread(render_workers, job)

    def close(self) -> None:
        """Stop the rendering process (server shutdown)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


class _Collector(Collector):
    """The relay's own families about the samples."""

    def __init__(self, federation: Federation, current: list[WorkerSample], now: float) -> None:
        self.federation = federation
        self.current = current
        self.now = now

    def collect(self) -> Iterator[Metric]:
        labels = list(ADDED_LABELS)
        age = GaugeMetricFamily(
            OWN_PREFIX + "age_seconds",
            "Seconds since this process last received the worker's metrics sample.",
            labels=labels,
        )
        series = GaugeMetricFamily(
            OWN_PREFIX + "series",
            "Series in the worker's latest metrics sample (0 while it does not parse).",
            labels=labels,
        )
        up = GaugeMetricFamily(
            OWN_PREFIX + "backend_up",
            "1 when the worker's backend answered its last metrics read.",
            labels=labels,
        )
        interval = GaugeMetricFamily(
            OWN_PREFIX + "interval_seconds",
            "How often the worker says it sends a sample (BACKEND_METRICS_SECS).",
            labels=labels,
        )
        for sample in sorted(self.current, key=lambda s: (s.provider, s.worker, s.worker_id)):
            key = [sample.worker, sample.worker_id, sample.provider]
            age.add_metric(key, max(0.0, self.now - sample.received))
            series.add_metric(key, 0 if sample.error is not None else sample.series)
            up.add_metric(key, 1 if sample.backend_up else 0)
            if sample.interval is not None:
                interval.add_metric(key, sample.interval)
        yield from (age, series, up, interval)
        yield CounterMetricFamily(
            OWN_PREFIX + "rejected",
            "Worker metrics samples dropped: over the bounds, too frequent, or not parseable.",
            value=self.federation.rejected,
        )
        yield GaugeMetricFamily(
            OWN_PREFIX + "type_conflicts",
            "Worker families left out of the last scrape: another worker gave the same name "
            "another type.",
            value=self.federation.conflicts,
        )
