"""(j) Priority classes: people first, bulk work on what is left (SPEC §15)."""

from __future__ import annotations

from typing import Any

from bench.report.table import table

#: Targets: the interactive p95 queue wait as a share of the service time, and the flex
#: goodput beside people as a share of what it gets alone.
WAIT_SHARE = 0.10
GOODPUT = 0.85


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def classes(res: dict[str, Any]) -> list[str]:
    i = res.get("classes")
    if not i:
        return []
    lines = ["### (j) Priority classes — people first, bulk work on what is left", ""]
    rows = []
    targets = []
    for label, key in (("one process", "one_process"), ("two processes", "two_processes")):
        r = i.get(key)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"- {label}: not run ({r['skipped']})")
            continue
        rows.append(
            [
                label,
                f"{r['flex_alone_per_sec']:.1f} / {r['flex_with_people_per_sec']:.1f} req/s "
                f"({100 * r['flex_goodput_ratio']:.0f} %)",
                f"{r['interactive_wait_p50_ms']:.1f} / {r['interactive_wait_p95_ms']:.1f} ms "
                f"({r['interactive_requests']} requests)",
                f"{r['preemptions']} (≤ {100 * r['work_thrown_away_share_at_most']:.1f} % "
                "of the capacity)",
                str(r["errors"]),
            ]
        )
        targets += [
            [
                f"{label}: interactive p95 queue wait ≤ {100 * WAIT_SHARE:.0f} % of the service "
                "time",
                f"{100 * r['wait_p95_of_service']:.1f} %",
                _met(r["wait_p95_of_service"] <= WAIT_SHARE),
            ],
            [
                f"{label}: no client-visible error",
                str(r["errors"]),
                _met(r["errors"] == 0),
            ],
            [
                f"{label}: flex goodput ≥ {100 * GOODPUT:.0f} % of alone",
                f"{100 * r['flex_goodput_ratio']:.0f} %",
                _met(r["flex_goodput_ratio"] >= GOODPUT),
            ],
        ]
    if rows:
        first = i.get("one_process") or i.get("two_processes") or {}
        lines += [
            f"`bench/classes.py`: a fake upstream answering after {first.get('service_secs', 0)} "
            f"s, {first.get('slots', 0)} slots in two `worker.py`; flex requests in a closed "
            "loop of three times the slots, and a trickle of default requests at a fixed rate, "
            "alone and together. Queue wait = latency - service time - the trickle's own "
            "overhead alone. Work thrown away is bounded by one service time per preemption.",
            "",
            *table(
                [
                    "layout",
                    "flex alone / beside people",
                    "interactive wait p50 / p95",
                    "preemptions",
                    "errors",
                ],
                rows,
            ),
            "",
            *table(["target", "measured", "met?"], targets),
            "",
        ]
    return lines
