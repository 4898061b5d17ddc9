"""(l) Fleet observability: what tracing and backend metrics federation cost (SPEC §17)."""

from __future__ import annotations

from typing import Any

from bench.report.table import table

#: Target: with tracing off, its hooks cost at most this share of a request's CPU.
OFF_SHARE = 0.02


def fleet(res: dict[str, Any]) -> list[str]:
    r = res.get("fleet")
    if not r:
        return []
    t, f = r["tracing"], r["federation"]
    met = "met" if t["hooks_off_share"] <= OFF_SHARE else "**not met**"
    return [
        "### (l) Fleet observability — tracing off and on, backend metrics federation",
        "",
        f"`bench/fleet.py`, in one process on the relay core (load average "
        f"{r['load_average']:.1f} meanwhile). Tracing: {t['requests']} requests per round "
        "through the dispatcher with a worker answering at once, driven as the HTTP edge "
        "drives it; CPU time of the process, the OpenTelemetry SDK's export thread "
        "included, every span exported over OTLP/HTTP to a receiver in another process "
        "before the clock stops. Off, what the hooks do (four calls on the null tracer, two "
        "slots) is timed by itself. Federation: 100 workers' samples of about 1,000 series each "
        "(vLLM-shaped, a quarter of them histograms) received, then `/metrics/workers` "
        "rendered (in the rendering process, as the server does; then once in a thread for "
        "comparison).",
        "",
        *table(
            ["tracing", "CPU per request"],
            [
                ["off (relay core path)", f"{t['off_us']:.1f} µs"],
                [
                    "off: the hooks alone",
                    f"{t['hooks_off_ns']:.0f} ns ({100 * t['hooks_off_share']:.2f} % of the "
                    f"path; target ≤ {100 * OFF_SHARE:.0f} %: {met})",
                ],
                ["on, every request sampled (5 spans: no queue wait)", f"{t['on_us']:.0f} µs"],
            ],
        ),
        "",
        *table(
            ["federation", "figure"],
            [
                ["workers, series each", f"{f['workers']:.0f}, {f['series_per_worker']:.0f}"],
                ["receiving one sample (bound checks)", f"{f['receive_us_per_sample']:.0f} µs"],
                [
                    "first scrape (starts the rendering process, parses every sample)",
                    f"{f['first_scrape_ms']:.0f} ms",
                ],
                [
                    "scrape after every worker sent a new sample",
                    f"{f['steady_scrape_ms']:.0f} ms ({f['steady_scrape_cpu_ms']:.0f} ms CPU in "
                    f"the server process); its event loop late by up to "
                    f"{f['loop_lag_max_ms']:.0f} ms meanwhile",
                ],
                [
                    "scrape with nothing new (cached parse, render only)",
                    f"{f['cached_scrape_ms']:.0f} ms",
                ],
                [
                    "the same scrape in a thread of the server process instead",
                    f"{f['thread_steady_scrape_ms']:.0f} ms; event loop late by up to "
                    f"{f['thread_loop_lag_max_ms']:.0f} ms",
                ],
                [
                    "exposition",
                    f"{f['series']:.0f} lines, {f['exposition_bytes'] / 2**20:.1f} MiB",
                ],
                [
                    "memory of the parsed samples (held by the rendering process)",
                    f"{f['held_mb']:.0f} MiB (peak {f['peak_mb']:.0f} MiB)",
                ],
            ],
        ),
        "",
    ]
