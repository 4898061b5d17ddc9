"""ModelRelay's figures divided by its peers' from the same run, under either server."""

from __future__ import annotations

from typing import Any

from bench.report.table import PEERS, RELAYS, SERVER, ratio, table


def ratios(res: dict[str, Any]) -> list[str]:
    a, b, c = res.get("a", {}), res.get("b", {}), res.get("c", {})
    ks = sorted({int(k) for runs in c.values() for k in runs})
    measures: list[tuple[str, dict[str, Any], str, str]] = [
        ("req/s, 32 connections (a)", a, "", "rps"),
        ("p50 latency, 32 connections (a)", a, "", "p50_ms"),
        ("p50 latency, one in flight (b)", b, "", "p50_ms"),
    ]
    measures += [(f"p99 chunk delay, K={k} (c)", c, str(k), "delay_p99_ms") for k in ks]
    rows = []
    for title, section, k, key in measures:
        for relay in RELAYS:
            mine = section.get(relay, {})
            if k:
                mine = mine.get(k, {})
            if not mine:
                continue
            theirs = [section.get(p, {}) for p in PEERS]
            if k:
                theirs = [t.get(k, {}) for t in theirs]
            rows.append([title, SERVER[relay], *[ratio(mine[key], t.get(key)) for t in theirs]])
    if not rows:
        return []
    return [
        "### Ratios (same run)",
        "",
        *table(["measure", "ModelRelay server", *[f"ModelRelay ÷ {p}" for p in PEERS]], rows),
        "",
    ]
