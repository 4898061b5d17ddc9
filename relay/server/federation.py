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

One worker's sample never changes what another's renders to. Each family holds a set
of names in the text format (a counter ``x`` holds ``x``, ``x_total`` and
``x_created``; a histogram its ``_bucket``, ``_count``, ``_sum``; see
:data:`SUFFIXES`), and families of the same name and type merge across workers. When
two families would hold one name otherwise (the same name with another type, or a
gauge named like a histogram's ``_count``), the family declared first wins: declared
when the relay first received it from a worker (the time of that sample; a worker the
rendering process has not seen yet counts from its first sample), whatever the
workers' names. The later family is left out of the exposition while the first one is
served; its worker is told (``metrics_rejected``) and it is counted per worker in
``modelrelay_worker_metrics_type_conflicts``. The relay's own names are held for it.
A sample that does not parse, or holds a type or a name the text format does not have
(``info``, ``stateset``, ...; a quoted name such as ``"a.b"``), is dropped and its
worker told, like one over the bounds.

In cluster mode each process serves the series of the workers connected to it:
scrape every process (docs/CLUSTER.md).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import NamedTuple

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
#: The relay's own families about the samples: a worker's family holding such a name is
#: left out.
OWN_PREFIX = "modelrelay_worker_metrics_"

#: The names a family of each type holds in the text format beside its own: what its
#: samples may be called, and what a parser reading the exposition back takes for it
#: (the only types the Prometheus text format has).
SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": (),
    "unknown": (),
    "summary": ("_count", "_sum", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}

#: A family as the exposition knows it: name and type.
Identity = tuple[str, str]


class Job(NamedTuple):
    """What a scrape hands the rendering process for one worker."""

    worker_id: str
    worker: str
    provider: str
    text: str
    #: When this worker's first sample of the connection arrived.
    since: float
    #: When this sample arrived.
    received: float


@dataclass(slots=True)
class WorkerSample:
    """The latest sample of one worker."""

    worker_id: str
    worker: str
    provider: str
    text: str
    series: int
    received: float
    since: float
    backend_up: bool
    interval: float | None
    #: Why it does not parse (None: it did, or no scrape has parsed it yet).
    error: str | None = None
    #: Its families left out of the last scrape (another worker declared them first).
    left_out: tuple[str, ...] = ()
    reported: bool = False


@dataclass(slots=True)
class Rendered:
    """What the rendering process answers a scrape."""

    body: bytes
    #: Why a sample does not parse, by worker id.
    errors: dict[str, str]
    #: The families of each worker left out ("name (type)"), by worker id.
    left_out: dict[str, list[str]]


def count_series(text: str) -> int:
    """Sample lines in an exposition: every line that is neither blank nor a comment."""
    count = 0
    for line in text.splitlines():
        line = line.lstrip()
        if line and line[0] != "#":
            count += 1
    return count


def held_names(identity: Identity) -> tuple[str, ...]:
    """Every name a family holds in the exposition (its own first)."""
    name, kind = identity
    return (name, *(name + suffix for suffix in SUFFIXES[kind]))


def labelled(worker_id: str, worker: str, provider: str, text: str) -> list[Metric]:
    """Parse ``text`` and add the relay's labels to every series (raises ValueError,
    also for a type or a name the text format does not have)."""
    added = {"worker": worker, "worker_id": worker_id, "provider": provider}
    families: list[Metric] = []
    checked: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.type not in SUFFIXES:
            # The parser takes OpenMetrics' types too, which render under other names
            # than their samples': not in the format the backend says it speaks.
            raise ValueError(f"family {family.name[:100]!r} of type {family.type!r}")
        if not family.samples:
            continue  # a type line alone: nothing to serve, so it holds no names
        _check_name(family.name, _METRIC_NAME, checked)
        series = []
        for s in family.samples:
            _check_name(s.name, _METRIC_NAME, checked)
            for name in s.labels:
                _check_name(name, _LABEL_NAME, checked)
            labels = {(f"exported_{k}" if k in added else k): v for k, v in s.labels.items()}
            labels.update(added)
            series.append(s._replace(labels=labels))
        family.samples = series
        families.append(family)
    return families


#: The names of the Prometheus text format. The parser also takes quoted UTF-8 names,
#: which the exposition writes escaped (``a.b`` as ``a_b``): two of them could then
#: be one name, two families or two labels of a series made one.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _check_name(name: str, pattern: re.Pattern[str], checked: set[str]) -> None:
    if name not in checked:
        if pattern.fullmatch(name) is None:
            raise ValueError(f"{name[:100]!r} is not a name of the Prometheus text format")
        checked.add(name)


@dataclass(slots=True)
class _Parsed:
    """A worker's sample as the rendering process keeps it while its text is unchanged."""

    worker: str
    provider: str
    text: str
    families: list[Metric]
    #: When each of its families was first declared by this worker (see :func:`_parse`).
    declared: dict[Identity, float]


#: In the rendering process: worker id -> its parsed sample.
_parsed: dict[str, _Parsed] = {}


def render_workers(jobs: list[Job]) -> Rendered:
    """The exposition of the workers' families, why a sample did not parse, and which
    families were left out for holding a name a family declared earlier holds. Runs in
    the rendering process (or, as a fallback, a thread: one call at a time)."""
    jobs = sorted(jobs, key=lambda j: (j.provider, j.worker, j.worker_id))
    errors: dict[str, str] = {}
    keep: dict[str, _Parsed] = {}
    first: dict[Identity, tuple[float, str]] = {}
    #: The family of each name and type as its first declarer wrote it (help text).
    declarer: dict[Identity, Metric] = {}
    for job in jobs:
        try:
            parsed = keep[job.worker_id] = _parse(job, _parsed.get(job.worker_id))
        except Exception as exc:  # the parser raises ValueError and more
            errors[job.worker_id] = f"sample does not parse: {str(exc)[:200]}"
            # Known from now on: what it declares later counts from when it does.
            keep[job.worker_id] = _Parsed(job.worker, job.provider, job.text, [], {})
            continue
        for family in parsed.families:
            identity = (family.name, family.type)
            key = (parsed.declared[identity], job.worker_id)
            if identity not in first or key < first[identity]:
                first[identity], declarer[identity] = key, family
    _parsed.clear()
    _parsed.update(keep)
    # Earliest declared first (ties: in the order of the sample); each family holds
    # its names or, when one is held already, is left out whole.
    held: set[str] = set()
    merged: dict[Identity, Metric] = {}
    for identity in sorted(first, key=first.__getitem__):
        names = held_names(identity)
        if any(n in held or n.startswith(OWN_PREFIX) for n in names):
            continue
        held.update(names)
        family = declarer[identity]
        merged[identity] = Metric(family.name, family.documentation, family.type, family.unit)
    left_out: dict[str, list[str]] = {}
    for job in jobs:
        for family in keep[job.worker_id].families:
            seen = merged.get((family.name, family.type))
            if seen is None:
                left_out.setdefault(job.worker_id, []).append(f"{family.name} ({family.type})")
            else:
                seen.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return Rendered(generate_latest(registry), errors, left_out)


def _parse(job: Job, cached: _Parsed | None) -> _Parsed:
    """The worker's sample parsed (from ``cached`` while its text is unchanged), with
    when each family was declared: as it was for a family the worker declared before;
    else when this sample arrived, or, for a worker this process has not seen yet (its
    first scrape, or a new rendering process), when the worker's first sample did."""
    if cached is not None and (cached.worker, cached.provider, cached.text) == job[1:4]:
        return cached
    families = labelled(job.worker_id, job.worker, job.provider, job.text)
    before = cached.declared if cached is not None else {}
    new = job.received if cached is not None else job.since
    declared = {(f.name, f.type): before.get((f.name, f.type), new) for f in families}
    return _Parsed(job.worker, job.provider, job.text, families, declared)


def left_out_reason(families: tuple[str, ...]) -> str:
    """What a worker is told of its families left out (bounded for ``metrics_rejected``)."""
    shown = ", ".join(families[:5])[:600]
    more = f" and {len(families) - 5} more" if len(families) > 5 else ""
    return (
        f"{len(families)} of its families left out: a family declared before them holds "
        f"their names with another type: {shown}{more}"
    )


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
            since=now if last is None else last.since,
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
        """The exposition of every worker's latest sample, and what to tell the workers
        whose new sample did not parse, or lost families to a worker that declared them
        first (each sample reported once)."""
        async with self._scrape:  # one rendering at a time: its cache is not shared
            current = list(self.samples.values())
            jobs = [
                Job(s.worker_id, s.worker, s.provider, s.text, s.since, s.received) for s in current
            ]
            rendered = await self._render(jobs)
        told = []
        for sample in current:
            sample.error = rendered.errors.get(sample.worker_id)
            sample.left_out = tuple(rendered.left_out.get(sample.worker_id, ()))
            if sample.reported:
                continue
            if sample.error is not None:
                self.rejected += 1
                told.append((sample.worker_id, self.refusal(sample.error)))
            elif sample.left_out:
                told.append((sample.worker_id, self.refusal(left_out_reason(sample.left_out))))
            sample.reported = sample.error is not None or bool(sample.left_out)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, current, self.clock()))
        # Two renderings of disjoint families (a worker's family holding one of our
        # names was left out): together one valid exposition.
        return generate_latest(registry) + rendered.body, told

    async def _render(self, jobs: list[Job]) -> Rendered:
        if not self.in_process:
            try:
                if self._executor is None:
                    self._executor = ProcessPoolExecutor(
                        max_workers=1, mp_context=multiprocessing.get_context("spawn")
                    )
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor, render_workers, jobs)
            except (BrokenProcessPool, OSError) as exc:
                # Killed (out of memory?) or could not start: a new one next time, and
                # this scrape in a thread rather than not at all.
                logger.warning("the metrics rendering process failed (%s); starting anew", exc)
                self.close()
        return await asyncio.to_thread(render_workers, jobs)

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
        conflicts = GaugeMetricFamily(
            OWN_PREFIX + "type_conflicts",
            "Families of the worker's latest sample left out of the last scrape: a family "
            "another worker declared first holds one of their names (the same name with "
            "another type).",
            labels=labels,
        )
        for sample in sorted(self.current, key=lambda s: (s.provider, s.worker, s.worker_id)):
            key = [sample.worker, sample.worker_id, sample.provider]
            age.add_metric(key, max(0.0, self.now - sample.received))
            series.add_metric(key, 0 if sample.error is not None else sample.series)
            up.add_metric(key, 1 if sample.backend_up else 0)
            if sample.interval is not None:
                interval.add_metric(key, sample.interval)
            conflicts.add_metric(key, len(sample.left_out))
        yield from (age, series, up, interval, conflicts)
        yield CounterMetricFamily(
            OWN_PREFIX + "rejected",
            "Worker metrics samples dropped: over the bounds, too frequent, or not parseable.",
            value=self.federation.rejected,
        )
