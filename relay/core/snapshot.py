"""Plain-data views of the live relay for the admin API, admin pages and dashboard.

Called on the event loop; returns JSON-ready dicts and never mutates the relay
(the dashboard's first snapshot attaches the outcome timeline, an observer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from relay import __version__
from relay.core import timeline
from relay.core.deadlines import RESULTS as DEADLINE_RESULTS
from relay.core.hedging import RESULTS as HEDGE_RESULTS
from relay.core.relay import Relay
from relay.core.state import Worker


def describe_worker(relay: Relay, worker: Worker) -> dict[str, Any]:
    now = relay.loop.time()
    return {
        "id": worker.id,
        "name": worker.name,
        "provider": worker.provider,
        "models": list(worker.models),
        "max_concurrent": worker.max_concurrent,
        "load": worker.load,
        "reported_load": worker.reported_load,
        "in_flight": len(worker.in_flight),
        "draining": worker.draining,
        "backend": "unreachable" if worker.backend_error is not None else "ok",
        "backend_error": worker.backend_error,
        "peer": worker.peer,
        "protocol_version": worker.protocol_version,
        "requests_served": worker.requests_served,
        "connected_secs": round(now - worker.connected_at, 3),
        "last_pong_secs_ago": round(now - worker.last_pong, 3),
        "model_capacity": worker.model_capacity,
        "model_states": model_states(worker, now),
        "prefill_backlog_secs": round(max(0.0, worker.busy_until - now), 3),
        "speeds": speeds(relay, worker, now),
    }


def speeds(relay: Relay, worker: Worker, now: float) -> list[dict[str, Any]]:
    """Speed-aware routing (SPEC §21): for each of ``worker``'s models, its learned
    prefill and decode rates, overhead, service time and confidence, and its predicted
    against its measured time to first token; ``learned`` false while it borrows the
    fleet's median (no history here yet)."""
    out = []
    for model in worker.models:
        speed = worker.speed.get(model)
        if speed is None:
            fit = relay.rates.prior(model, now)
            out.append(
                {
                    "model": model,
                    "learned": False,
                    "prefill_tokens_per_sec": round(1.0 / fit.secs_per_token, 1),
                    "decode_tokens_per_sec": round(fit.decode, 2),
                    "overhead_ms": round(fit.overhead * 1000, 1),
                    "service_secs": round(fit.service, 3),
                    "confidence": 0.0,
                    "samples": 0,
                    "predicted_ttft_ms": None,
                    "measured_ttft_ms": None,
                    "p95_over_predicted": None,
                }
            )
            continue
        relay.rates.fit(worker, model, now)  # (aged to now: confidence fades)
        out.append({"model": model, "learned": True, **speed.describe()})
    return out


def model_states(worker: Worker, now: float) -> list[dict[str, Any]] | None:
    """Models on demand (SPEC §19): each of ``worker``'s models with its state, the loads
    and unloads the relay asked for, their times, and the requests that waited for a
    load; None for a worker without the ``model_states`` extension."""
    if worker.states is None:
        return None
    out = []
    for model in worker.models:
        counts = worker.model_counts.get(model)
        used = worker.used.get(model)
        out.append(
            {
                "model": model,
                "state": worker.states.get(model, ""),
                "loads": counts.loads if counts else 0,
                "load_failures": counts.load_failures if counts else 0,
                "unloads": counts.unloads if counts else 0,
                "load_secs_total": round(counts.load_secs, 3) if counts else 0.0,
                "last_load_secs": (
                    None
                    if counts is None or counts.last_load_secs is None
                    else round(counts.last_load_secs, 3)
                ),
                "waited_for_load": counts.waited if counts else 0,
                "idle_secs": None if used is None else round(now - used, 3),
                "pending": sorted(
                    op.kind for op in worker.ops.values() if op.model == model or op.then == model
                ),
            }
        )
    return out


def workers(relay: Relay) -> list[dict[str, Any]]:
    return [
        describe_worker(relay, w)
        for w in sorted(relay.registry.workers.values(), key=lambda w: (w.provider, w.name, w.id))
    ]


def stats(relay: Relay) -> dict[str, Any]:
    s = relay.stats
    providers: dict[str, Any] = {}
    for name, state in sorted(relay.providers.items()):
        members = relay.registry.of_provider(name)
        providers[name] = {
            "enabled": state.policy.enabled,
            "queue_depth": len(state.queue),
            "queue_by_class": state.queue.depth_by_class(),
            "workers": len(members),
            "load": sum(w.load for w in members),
            "capacity": sum(w.max_concurrent for w in members),
        }
    return {
        "version": __version__,
        "uptime_secs": round(time.time() - relay.started_wall, 3),
        "requests": {"total": s.total, "by_outcome": dict(sorted(s.by_outcome.items()))},
        "in_flight": relay.active - relay.queue_depth(),
        "queue_depth": relay.queue_depth(),
        "workers_connected": len(relay.registry.workers),
        "providers": providers,
        "tokens": {
            "prompt": s.tokens_total("prompt"),
            "completion": s.tokens_total("completion"),
            "estimated": sum(s.tokens_estimated.values()),
        },
        "requeues": s.requeues,
        "preemptions": s.preemptions,
        "models_on_demand": {
            "loads": s.model_loads,
            "load_failures": s.model_load_failures,
            "unloads": s.model_unloads,
            "requests_waited_for_load": s.model_load_waits,
            "loading": sorted(f"{p}/{m}" for p, m in relay.loading()),
        },
        "routing": relay.router.describe(),
        "speed": {
            "bytes_per_token": {
                model: round(relay.rates.bytes_per_token(model), 3)
                for model in relay.rates.models()
            },
            "deadlines": {result: relay.deadlines[result] for result in DEADLINE_RESULTS},
            "hedges": {result: relay.hedges[result] for result in HEDGE_RESULTS},
            "hedging": {
                "max_share": relay.config.hedging.max_share,
                "credit": round(relay.hedge_credit, 3),
            },
        },
        "queue_by_class": _by_class(relay),
        "cancels": dict(sorted(s.cancels.items())),
        "dropped_worker_frames": s.dropped_frames,
        "streams": {
            "buffered_bytes": relay.buffered,
            "paused": sum(
                1 for w in relay.registry.workers.values() for r in w.in_flight.values() if r.paused
            ),
            "pauses": s.pauses,
            "left_after_end": s.left_after_end,
        },
    }


def _by_class(relay: Relay) -> dict[str, int]:
    """Queued requests by priority class, every provider together."""
    out: dict[str, int] = {}
    for state in relay.providers.values():
        for service_class, count in state.queue.depth_by_class().items():
            out[service_class] = out.get(service_class, 0) + count
    return out


def recent(
    relay: Relay, limit: int = 50, key_name: Callable[[int], str] | None = None
) -> list[dict[str, Any]]:
    out = []
    for r in list(relay.stats.recent)[-limit:][::-1]:
        key = None
        if r.key_id is not None:
            key = key_name(r.key_id) if key_name is not None else f"key #{r.key_id}"
        out.append(
            {
                "request_id": r.request_id,
                "key": key,
                "model": r.model,
                "endpoint": r.endpoint,
                "worker": r.worker_name,
                "status": r.status,
                "outcome": r.outcome,
                "streamed": r.streamed,
                "class": r.service_class,
                "preemptions": r.preemptions,
                "cached_tokens": r.cached_tokens,
                "duration_ms": round(r.duration * 1000, 1),
                "ttfb_ms": None if r.ttfb is None else round(r.ttfb * 1000, 1),
                "at": r.created_at,
            }
        )
    return out


def dashboard(
    relay: Relay,
    *,
    workers_list: list[dict[str, Any]] | None = None,
    keys_list: list[dict[str, Any]] | None = None,
    key_name: Callable[[int], str] | None = None,
    recent_limit: int = 25,
) -> dict[str, Any]:
    """Everything the live dashboard shows, as one JSON-ready snapshot.

    ``workers_list`` replaces this process's workers (the cluster-wide list with Redis);
    ``keys_list`` is who is using the pool (:func:`relay.core.keystats.key_rows`,
    folded), ``None`` when API keys are not required.
    """
    rates = timeline.for_relay(relay)
    return {
        "at": time.time(),
        "stats": stats(relay),
        "workers": workers(relay) if workers_list is None else workers_list,
        "keys": keys_list,
        "recent": recent(relay, limit=recent_limit, key_name=key_name),
        "rate_per_sec": round(rates.rate(), 3),
        "timeline": rates.series(),
    }


def connected_after(
    workers_list: list[dict[str, Any]], provider: str, since: float
) -> list[dict[str, Any]]:
    """The workers of ``provider`` that connected at or after wall time ``since``, oldest first."""
    now = time.time()
    found = [
        w for w in workers_list if w["provider"] == provider and now - w["connected_secs"] >= since
    ]
    return sorted(found, key=lambda w: -w["connected_secs"])
