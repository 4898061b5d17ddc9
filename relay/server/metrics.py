"""Prometheus metrics for ``GET /metrics``.

Counters and gauges are read from the relay's own state at scrape time (no double
bookkeeping); latency histograms are fed by the request observer. Label values stay
bounded because :class:`~relay.core.stats.RelayStats` reports unroutable models as
``(unknown)``, and per-key series (SPEC §13) name at most
:data:`~relay.core.keystats.MAX_KEY_LABELS` keys: gauges the busiest ones at scrape
time, counters the first ones seen (a counter's label never moves), the rest
``(other)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as CounterMetric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from relay.core import snapshot
from relay.core.affinity import BYTES_PER_TOKEN, DECISIONS, Router
from relay.core.deadlines import RESULTS as DEADLINE_RESULTS
from relay.core.hedging import RESULTS as HEDGE_RESULTS
from relay.core.keystats import fold
from relay.core.relay import Relay
from relay.core.stats import RequestRecord

KeyRows = Callable[[], list[dict[str, Any]]]
BatchCounts = Callable[[], dict[str, Any]]
StreamCounts = Callable[[], dict[str, Any]]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RelayCollector(Collector):
    def __init__(
        self,
        relay: Relay,
        cluster: Callable[[], dict[str, Any]] | None = None,
        key_rows: KeyRows | None = None,
        batch_counts: BatchCounts | None = None,
        stream_counts: StreamCounts | None = None,
    ) -> None:
        self.relay = relay
        self.cluster = cluster
        self.key_rows = key_rows
        self.batch_counts = batch_counts
        self.stream_counts = stream_counts

    def collect(self) -> Iterator[Metric]:
        relay = self.relay
        stats = relay.stats
        requests = CounterMetricFamily(
            "modelrelay_requests",
            "Client requests by endpoint, model and outcome.",
            labels=["endpoint", "model", "outcome"],
        )
        for (endpoint, model, outcome), count in stats.by_endpoint_model_outcome.items():
            requests.add_metric([endpoint, model, outcome], count)
        yield requests
        tokens = CounterMetricFamily(
            "modelrelay_tokens", "Tokens reported by backends.", labels=["model", "kind"]
        )
        for (model, kind), count in stats.tokens.items():
            tokens.add_metric([model, kind], count)
        yield tokens
        estimated = CounterMetricFamily(
            "modelrelay_tokens_estimated",
            "The part of modelrelay_tokens that workers counted themselves because the "
            "backend reported no usage.",
            labels=["model", "kind"],
        )
        for (model, kind), count in stats.tokens_estimated.items():
            estimated.add_metric([model, kind], count)
        yield estimated
        cancels = CounterMetricFamily(
            "modelrelay_cancels", "Cancels sent to workers, by reason.", labels=["reason"]
        )
        for reason, count in stats.cancels.items():
            cancels.add_metric([reason], count)
        yield cancels
        yield CounterMetricFamily(
            "modelrelay_streams_left_after_end",
            "Streams whose client left after their last event (data: [DONE], message_stop, "
            "response.completed): not cancelled, finished when their completion came.",
            value=stats.left_after_end,
        )
        yield CounterMetricFamily(
            "modelrelay_requeues",
            "Requests put back in the queue after losing their worker.",
            value=stats.requeues,
        )
        yield CounterMetricFamily(
            "modelrelay_dropped_worker_frames",
            "Worker frames dropped because their request was not in flight on that worker.",
            value=stats.dropped_frames,
        )
        yield CounterMetricFamily(
            "modelrelay_preemptions",
            "Times a flex request lost its slot to a request of a higher class (SPEC §15).",
            value=stats.preemptions,
        )
        by_class = GaugeMetricFamily(
            "modelrelay_queue_depth_by_class",
            "Queued requests by priority class (where they wait now: aged ones count higher).",
            labels=["provider", "class"],
        )
        for name in sorted(relay.providers):
            for service_class, count in relay.providers[name].queue.depth_by_class().items():
                by_class.add_metric([name, service_class], count)
        yield by_class
        yield CounterMetricFamily(
            "modelrelay_stream_pauses",
            "Times a worker was asked to pause a stream for a client reading slower than it.",
            value=stats.pauses,
        )
        yield GaugeMetricFamily(
            "modelrelay_stream_buffered_bytes",
            "Streamed bytes held for clients that have not read them yet.",
            value=relay.buffered,
        )
        yield GaugeMetricFamily(
            "modelrelay_requests_in_flight",
            "Requests admitted and not yet finished.",
            value=relay.active,
        )
        depth = GaugeMetricFamily("modelrelay_queue_depth", "Queued requests.", labels=["provider"])
        limit = GaugeMetricFamily(
            "modelrelay_queue_limit",
            "Queue bound (MAX_QUEUE_LEN, or the provider's own), per priority class.",
            labels=["provider"],
        )
        workers = GaugeMetricFamily("modelrelay_workers", "Connected workers.", labels=["provider"])
        load = GaugeMetricFamily("modelrelay_worker_load", "Busy slots.", labels=["provider"])
        capacity = GaugeMetricFamily(
            "modelrelay_worker_capacity", "Total slots.", labels=["provider"]
        )
        for name in sorted(relay.providers):
            members = relay.registry.of_provider(name)
            depth.add_metric([name], relay.queue_depth(name))
            limit.add_metric([name], relay.providers[name].policy.max_queue_len)
            workers.add_metric([name], len(members))
            load.add_metric([name], sum(w.load for w in members))
            capacity.add_metric([name], sum(w.max_concurrent for w in members))
        yield from (depth, limit, workers, load, capacity)
        serving = GaugeMetricFamily(
            "modelrelay_model_workers",
            "Workers connected here acked for a model; 0 for a model served within "
            "MODEL_MEMORY_SECS that none serves now (in cluster mode, take the max over "
            "the processes).",
            labels=["provider", "model"],
        )
        for (provider, model), count in sorted(
            relay.registry.workers_by_model(relay.loop.time()).items()
        ):
            serving.add_metric([provider, model], count)
        yield serving
        backend_up = GaugeMetricFamily(
            "modelrelay_worker_backend_up",
            "1 while a connected worker's backend answers, 0 while the worker reports it "
            "unreachable (its models are withdrawn meanwhile).",
            labels=["provider", "worker", "worker_id"],
        )
        for worker in sorted(relay.registry.workers.values(), key=lambda w: w.id):
            backend_up.add_metric(
                [worker.provider, worker.name, worker.id], 0 if worker.backend_error else 1
            )
        yield backend_up
        info = GaugeMetricFamily(
            "modelrelay_process",
            "This server process (its series are its own; in cluster mode scrape each one).",
            labels=["instance"],
        )
        info.add_metric([relay.instance], 1)
        yield info
        if self.cluster is not None:
            state = self.cluster()
            yield GaugeMetricFamily(
                "modelrelay_cluster_queue_depth",
                "Requests waiting in the cluster's shared queue (as of the last second).",
                value=state["queue_depth"],
            )
            yield GaugeMetricFamily(
                "modelrelay_cluster_up",
                "1 while this process reaches the cluster's Redis, 0 while degraded.",
                value=1 if state["state"] == "ok" else 0,
            )
        yield from routing_metrics(relay.router)
        yield from speed_metrics(relay)
        yield from residency_metrics(relay)
        if self.key_rows is not None:
            yield from key_metrics(self.key_rows())
        if self.batch_counts is not None:
            yield from batch_metrics(self.batch_counts())
        if self.stream_counts is not None:
            yield from stream_metrics(self.stream_counts())


def routing_metrics(router: Router) -> Iterator[Metric]:
    """Cache-aware routing (SPEC §14): its decisions, and per worker the cached prompt
    tokens it predicted against those the backend reported."""
    decisions = CounterMetricFamily(
        "modelrelay_affinity_decisions",
        "Cache-aware routing decisions: hit (the key's or longest prefix's worker took "
        "it), miss (nothing known), guard (its worker was over the bounded-load guard).",
        labels=["decision"],
    )
    for decision in DECISIONS:
        decisions.add_metric([decision], router.decisions[decision])
    yield decisions
    families = {
        "predicted": CounterMetricFamily(
            "modelrelay_affinity_predicted_cached_tokens",
            "Prompt tokens the relay predicted a worker's backend had cached (estimated "
            f"at {BYTES_PER_TOKEN} bytes of prompt JSON per token).",
            labels=["worker"],
        ),
        "reported": CounterMetricFamily(
            "modelrelay_affinity_reported_cached_tokens",
            "Prompt tokens a worker's backend reported it reused from its cache.",
            labels=["worker"],
        ),
        "checked": CounterMetricFamily(
            "modelrelay_affinity_predicted_hits",
            "Predicted cache hits the backend confirmed (reused > 0) or refuted (0).",
            labels=["worker", "result"],
        ),
    }
    for name, row in sorted(router.by_worker.items()):
        families["predicted"].add_metric([name], row.predicted_tokens)
        families["reported"].add_metric([name], row.reported_tokens)
        families["checked"].add_metric([name, "confirmed"], row.confirmed)
        families["checked"].add_metric([name, "refuted"], row.refuted)
    yield from families.values()
    yield GaugeMetricFamily(
        "modelrelay_affinity_index_entries",
        "Prompt blocks and explicit keys the routing index remembers (bounded).",
        value=router.entries(),
    )


def speed_metrics(relay: Relay) -> Iterator[Metric]:
    """Speed-aware routing (SPEC §21): per worker connected here and model, its learned
    speeds and its predicted against its measured time to first token; deadlines and
    hedges by result."""
    labels = ["provider", "worker", "worker_id", "model"]
    families = {
        "prefill_tokens_per_sec": GaugeMetricFamily(
            "modelrelay_worker_prefill_tokens_per_second",
            "Prompt tokens a second a worker's backend is learned to process (decaying; the "
            "fleet's median while it has no history).",
            labels=labels,
        ),
        "decode_tokens_per_sec": GaugeMetricFamily(
            "modelrelay_worker_decode_tokens_per_second",
            "Completion tokens a second a worker's backend is learned to generate.",
            labels=labels,
        ),
        "overhead_ms": GaugeMetricFamily(
            "modelrelay_worker_overhead_seconds",
            "A worker's learned fixed time before the first byte of a request.",
            labels=labels,
        ),
        "confidence": GaugeMetricFamily(
            "modelrelay_worker_speed_confidence",
            "How much a worker's speeds rest on its own recent requests (0: the fleet's).",
            labels=labels,
        ),
    }
    ttft = GaugeMetricFamily(
        "modelrelay_worker_ttft_seconds",
        "A worker's recent time to first byte from dispatch (decaying mean), as predicted "
        "and as measured.",
        labels=[*labels, "kind"],
    )
    now = relay.loop.time()
    for worker in sorted(relay.registry.workers.values(), key=lambda w: w.id):
        for row in snapshot.speeds(relay, worker, now):
            values = [worker.provider, worker.name, worker.id, row["model"]]
            for key, family in families.items():
                value = row[key]
                family.add_metric(values, value / 1000 if key == "overhead_ms" else value)
            for kind in ("predicted", "measured"):
                if row[f"{kind}_ttft_ms"] is not None:
                    ttft.add_metric([*values, kind], row[f"{kind}_ttft_ms"] / 1000)
    yield from families.values()
    yield ttft
    deadlines = CounterMetricFamily(
        "modelrelay_deadline_requests",
        "Requests with a first-token deadline: refused at admission, left the queue when "
        "it could no longer be met, and of those answered, first byte in time or late.",
        labels=["result"],
    )
    for result in DEADLINE_RESULTS:
        deadlines.add_metric([result], relay.deadlines[result])
    yield deadlines
    hedges = CounterMetricFamily(
        "modelrelay_hedges",
        "Hedged priority streams: sent, won by the second attempt, lost to the first, "
        "settled by a failed attempt; and hedges not sent (over_share, saturated).",
        labels=["result"],
    )
    for result in HEDGE_RESULTS:
        hedges.add_metric([result], relay.hedges[result])
    yield hedges


def residency_metrics(relay: Relay) -> Iterator[Metric]:
    """Models on demand (SPEC §19), per worker and model, for the workers connected here
    that report their models' states."""
    labels = ["provider", "worker", "worker_id", "model"]
    state = GaugeMetricFamily(
        "modelrelay_worker_model_state",
        "1 for the state each model is in on a worker (loaded, loading, loadable, sleeping).",
        labels=[*labels, "state"],
    )
    loads = CounterMetricFamily(
        "modelrelay_model_loads", "Model loads the relay asked a worker for.", labels=labels
    )
    failures = CounterMetricFamily(
        "modelrelay_model_load_failures",
        "Model loads that failed or got no answer in time.",
        labels=labels,
    )
    unloads = CounterMetricFamily(
        "modelrelay_model_unloads", "Model unloads the relay asked a worker for.", labels=labels
    )
    seconds = CounterMetricFamily(
        "modelrelay_model_load_seconds", "Time spent loading models.", labels=labels
    )
    waited = CounterMetricFamily(
        "modelrelay_model_load_waited_requests",
        "Requests that waited for their model to be loaded, by the worker that served them.",
        labels=labels,
    )
    for worker in sorted(relay.registry.workers.values(), key=lambda w: w.id):
        if worker.states is None:
            continue
        for model in worker.models:
            values = [worker.provider, worker.name, worker.id, model]
            state.add_metric([*values, worker.states.get(model, "")], 1)
            counts = worker.model_counts.get(model)
            if counts is not None:
                loads.add_metric(values, counts.loads)
                failures.add_metric(values, counts.load_failures)
                unloads.add_metric(values, counts.unloads)
                seconds.add_metric(values, counts.load_secs)
                waited.add_metric(values, counts.waited)
    yield from (state, loads, failures, unloads, seconds, waited)


def batch_metrics(counts: dict[str, Any]) -> Iterator[Metric]:
    """Batch lines (SPEC §16): waiting in the database (every process's, as of this
    process's last look), held and running here, and ended here by outcome."""
    lines = GaugeMetricFamily(
        "modelrelay_batch_lines",
        "Batch lines not ended: queued (in the database, every process's), claimed and "
        "running (this process's).",
        labels=["state"],
    )
    lines.add_metric(["queued"], max(0, counts["waiting"] - counts["claimed"] - counts["running"]))
    lines.add_metric(["claimed"], counts["claimed"])
    lines.add_metric(["running"], counts["running"])
    yield lines
    ended = CounterMetricFamily(
        "modelrelay_batch_lines_finished",
        "Batch lines ended here, by outcome (succeeded, errored, canceled, expired).",
        labels=["outcome"],
    )
    for outcome in ("succeeded", "errored", "canceled", "expired"):
        ended.add_metric([outcome], counts["finished"].get(outcome, 0))
    yield ended
    yield CounterMetricFamily(
        "modelrelay_batch_line_retries",
        "Batch line attempts tried again here (a worker failed, or a limit said not now).",
        value=counts["retries"],
    )
    batches = GaugeMetricFamily(
        "modelrelay_batches",
        "Batches with work left, and the last few ended, by status (every process's).",
        labels=["status"],
    )
    for status, count in sorted(counts["batches"].items()):
        batches.add_metric([status], count)
    yield batches


def stream_metrics(counts: dict[str, Any]) -> Iterator[Metric]:
    """Resumable responses (SPEC §18): what is retained here, and what clients did."""
    gauges = (
        (
            "modelrelay_streams_retained",
            "Resumable responses retained (cluster mode: the logs this process wrote).",
            counts["retained"],
        ),
        ("modelrelay_streams_running", "Resumable responses still running.", counts["running"]),
        (
            "modelrelay_streams_retained_bytes",
            "Bytes the retained responses hold (STREAM_RETAIN_TOTAL_BYTES bounds it).",
            counts["bytes"],
        ),
    )
    for name, documentation, value in gauges:
        yield GaugeMetricFamily(name, documentation, value=value)
    totals = (
        ("modelrelay_streams_started", "Resumable responses started here.", "started"),
        (
            "modelrelay_stream_reattaches",
            "Clients that reattached to a resumable response here.",
            "reattaches",
        ),
        (
            "modelrelay_stream_replayed_bytes",
            "Bytes sent here to clients that reattached.",
            "replayed_bytes",
        ),
        (
            "modelrelay_streams_evicted",
            "Ended responses whose logs were dropped to stay within the total bound.",
            "evicted",
        ),
        (
            "modelrelay_stream_records_trimmed",
            "Records dropped from a log to keep it within STREAM_RETAIN_BYTES.",
            "trimmed",
        ),
        (
            "modelrelay_streams_refused",
            "Resumable requests refused: their key held STREAM_RETAIN_PER_KEY running ones.",
            "refused",
        ),
        (
            "modelrelay_stream_cancels",
            "Running resumable responses stopped by a cancel or delete asked here.",
            "cancels",
        ),
    )
    for name, documentation, field in totals:
        yield CounterMetricFamily(name, documentation, value=counts[field])


def key_metrics(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-key series; keys that share a name are summed under it."""
    running: Counter[str] = Counter()
    queued: Counter[str] = Counter()
    tokens: Counter[tuple[str, str]] = Counter()
    for row in fold(rows):
        running[row["name"]] += row["in_flight"]
        queued[row["name"]] += row["queued"]
        tokens[(row["name"], "day")] += row["tokens_today"]
        tokens[(row["name"], "month")] += row["tokens_month"]
    finished: Counter[str] = Counter()
    refused: Counter[tuple[str, str]] = Counter()
    for row in rows:
        finished[row["label"]] += row["requests"]
        for outcome, count in row["rejected_by"].items():
            refused[(row["label"], outcome)] += count
    gauges = (
        ("modelrelay_key_requests_in_flight", "Requests of an API key running now.", running),
        ("modelrelay_key_requests_queued", "Requests of an API key waiting for a worker.", queued),
    )
    for name, documentation, values in gauges:
        family = GaugeMetricFamily(name, documentation, labels=["key"])
        for key, value in sorted(values.items()):
            family.add_metric([key], value)
        yield family
    spent = GaugeMetricFamily(
        "modelrelay_key_tokens",
        "Tokens an API key spent in the current UTC day or month (what its budgets count).",
        labels=["key", "period"],
    )
    for (key, period), value in sorted(tokens.items()):
        spent.add_metric([key, period], value)
    yield spent
    ended = CounterMetricFamily(
        "modelrelay_key_requests", "Requests of an API key that ended, here.", labels=["key"]
    )
    for key, value in sorted(finished.items()):
        ended.add_metric([key], value)
    yield ended
    rejections = CounterMetricFamily(
        "modelrelay_key_rejections",
        "Requests of an API key refused before admission, by outcome (which limit, ...).",
        labels=["key", "outcome"],
    )
    for (key, outcome), value in sorted(refused.items()):
        rejections.add_metric([key, outcome], value)
    yield rejections


class RelayMetrics:
    """One registry per relay runtime; :meth:`observe` is a request observer."""

    def __init__(
        self,
        relay: Relay,
        *,
        key_rows: KeyRows | None = None,
        batch_counts: BatchCounts | None = None,
        stream_counts: StreamCounts | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = RelayCollector(
            relay, key_rows=key_rows, batch_counts=batch_counts, stream_counts=stream_counts
        )
        self.registry.register(self.collector)
        self.duration = Histogram(
            "modelrelay_request_duration_seconds",
            "Time from arrival to the end of the response.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "modelrelay_time_to_first_byte_seconds",
            "Time from arrival to the first response byte.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "modelrelay_queue_wait_seconds",
            "Time spent waiting in the queue.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.responses = CounterMetric(
            "modelrelay_responses",
            "Responses to clients by HTTP status (relay errors and the backends' own).",
            ["status"],
            registry=self.registry,
        )
        self.class_wait = Histogram(
            "modelrelay_class_queue_wait_seconds",
            "Time spent waiting in the queue, by priority class (SPEC §15).",
            ["class"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, record: RequestRecord) -> None:
        if record.relay_role != "worker" and 100 <= record.status <= 599:
            self.responses.labels(str(record.status)).inc()
        if not record.request_id or record.relay_role == "worker":
            # Rejected before admission (counted, no latency), or served here for a
            # client of another process, which reports its latencies.
            return
        self.duration.labels(record.endpoint).observe(record.duration)
        self.queue_wait.labels(record.endpoint).observe(record.queue_wait)
        self.class_wait.labels(record.service_class).observe(record.queue_wait)
        if record.ttfb is not None:
            self.ttfb.labels(record.endpoint).observe(record.ttfb)

    def render(self) -> bytes:
        return generate_latest(self.registry)
