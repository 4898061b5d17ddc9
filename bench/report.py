"""Turns a run's results into the tables printed and written to ``docs/BENCHMARKS.md``."""

from __future__ import annotations

import math
from typing import Any

ORDER = ("direct", "ModelRelay", "LiteLLM", "nginx")
#: Processes whose CPU is the target's own (the rest is the rig: client, upstream, workers).
OWN = {"ModelRelay": ("server",), "LiteLLM": ("litellm",), "nginx": ("nginx",), "direct": ()}
RIG = ("client", "upstream", "workers")


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return "-"
    ratio = a / b
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _share(run: dict[str, Any], names: tuple[str, ...]) -> float:
    wall = run.get("wall") or 0
    used = sum(run.get("cpu", {}).get(n, 0.0) for n in names)
    return 100 * used / wall if wall else float("nan")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _targets(section: dict[str, Any]) -> list[str]:
    return [t for t in ORDER if t in section]


# --------------------------------------------------------------------------- sections


def throughput(res: dict[str, Any]) -> list[str]:
    a = res.get("a")
    if not a:
        return []
    s = res["settings"]
    rows = []
    for t in _targets(a):
        r = a[t]
        rows.append(
            [
                t,
                _f(r["rps"], 0),
                _f(r["p50_ms"], 2),
                _f(r["p99_ms"], 2),
                str(r["errors"]),
                _f(_share(r, OWN[t]), 0) if OWN[t] else "-",
                _f(_share(r, RIG), 0),
                _f(_share(r, ("other",)), 0),
            ]
        )
    out = [
        f"### (a) Non-streaming throughput — 32 keep-alive connections, {s['a_seconds']} s, wrk",
        "",
        *_table(
            [
                "target",
                "req/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "target CPU % of a core",
                "rig CPU % of a core",
                "other CPU %",
            ],
            rows,
        ),
    ]
    return [*out, ""]


def latency(res: dict[str, Any]) -> list[str]:
    b = res.get("b")
    if not b:
        return []
    base = b.get("direct", {})
    rows = []
    for t in _targets(b):
        r = b[t]
        added50 = r["p50_ms"] - base["p50_ms"] if base and t != "direct" else None
        added99 = r["p99_ms"] - base["p99_ms"] if base and t != "direct" else None
        rows.append(
            [
                t,
                _f(r["p50_ms"], 3),
                _f(r["p99_ms"], 3),
                _f(added50, 3),
                _f(added99, 3),
                str(r["errors"]),
                _same_body(r, base, t),
            ]
        )
    count = next(iter(b.values()))["count"]
    return [
        f"### (b) One request in flight — {count} sequential requests per target",
        "",
        *_table(
            [
                "target",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "added p99 ms",
                "errors",
                "body byte-identical to direct",
            ],
            rows,
        ),
        "",
    ]


def _same_body(run: dict[str, Any], direct: dict[str, Any], target: str) -> str:
    if target == "direct" or not direct:
        return "-"
    if target == "LiteLLM":
        return "no (re-encoded, by design)" if run["sample"] != direct["sample"] else "yes"
    return "yes" if run["sample"] == direct["sample"] else "**no**"


def streaming(res: dict[str, Any]) -> list[str]:
    c = res.get("c")
    if not c:
        return []
    s = res["settings"]
    rows = []
    for t in _targets(c):
        for k, r in sorted(c[t].items(), key=lambda kv: int(kv[0])):
            problems = ", ".join(f"{v} {p}" for p, v in r["problems"].items()) or ""
            rows.append(
                [
                    t,
                    str(k),
                    f"{r['intact']}/{r['streams']}" + (f" ({problems})" if problems else ""),
                    _f(r["delay_p50_ms"], 2),
                    _f(r["delay_p99_ms"], 2),
                    _f(r["delay_max_ms"], 1),
                    _f(r["gap_p50_ms"], 1),
                    _f(r["gap_p99_ms"], 1),
                    _f(_share(r, OWN[t]), 0) if OWN[t] else "-",
                    _f(_share(r, RIG), 0),
                    _f(_share(r, ("other",)), 0),
                ]
            )
    return [
        f"### (c) Streaming — K concurrent streams of {s['c_tokens']} tokens at "
        f"{s['token_rate']:g} tokens/s (started over {s['c_ramp']:g} s)",
        "",
        "Chunk delay: upstream write → client read of each token chunk (the upstream stamps "
        "every token with CLOCK_MONOTONIC). Gap: time between consecutive token chunks at the "
        "client (nominally 50 ms). Intact: every token, in order, then `data: [DONE]`.",
        "",
        *_table(
            [
                "target",
                "K",
                "intact",
                "delay p50 ms",
                "delay p99 ms",
                "delay max ms",
                "gap p50 ms",
                "gap p99 ms",
                "target CPU %",
                "rig CPU %",
                "other CPU %",
            ],
            rows,
        ),
        "",
    ]


def _per(run: dict[str, Any] | None, name: str, count_key: str) -> float | None:
    if not run:
        return None
    count = run.get(count_key) or 0
    used = run.get("cpu", {}).get(name)
    if not count or used is None:
        return None
    return 1e6 * used / count


def cpu(res: dict[str, Any]) -> list[str]:
    a, b, c = res.get("a", {}), res.get("b", {}), res.get("c", {})
    if not a and not c and not b:
        return []
    ks = sorted({int(k) for runs in c.values() for k in runs})
    rows = []
    for t, names in (
        ("ModelRelay", ("server", "workers")),
        ("LiteLLM", ("litellm",)),
        ("nginx", ("nginx",)),
        ("direct", ("upstream",)),
    ):
        for name in names:
            if t not in a and t not in b and t not in c:
                continue
            label = {"server": "ModelRelay server process", "workers": "ModelRelay worker.py"}
            row = [label.get(name, f"{t} ({name})" if t == "direct" else t)]
            row.append(_f(_per(a.get(t), name, "requests"), 0))
            row.append(_f(_per(b.get(t), name, "count"), 0))
            for k in ks:
                row.append(_f(_per(c.get(t, {}).get(str(k)), name, "chunks"), 0))
            rows.append(row)
    return [
        "### (d) CPU per relayed request and per relayed chunk",
        "",
        "utime+stime from `/proc/<pid>/stat` over the measured window ÷ requests completed "
        "(a, b) or SSE events delivered (c); worker figures are all worker processes together.",
        "",
        *_table(
            [
                "process",
                "µs / request (a)",
                "µs / request, one in flight (b)",
                *[f"µs / chunk, K={k}" for k in ks],
            ],
            rows,
        ),
        "",
    ]


def memory(res: dict[str, Any]) -> list[str]:
    e = res.get("e")
    if not e:
        return []
    rows = []
    q = e.get("queued")
    if q:
        rows.append(
            [
                f"server RSS with {q['queued']} queued requests (+1 held by a silent worker)",
                f"{_f(q['rss_mb'])} MB (baseline {_f(q['baseline_rss_mb'])} MB, "
                f"+{_f(q['delta_mb'])} MB)",
            ]
        )
    for key in ("idle", "idle_short"):
        i = e.get(key)
        if not i:
            continue
        env = i.get("env") or {}
        hb = env.get("HEARTBEAT_INTERVAL_SECS")
        hb = f"{hb} s" if hb else "15 s, the default"
        rows.append(
            [
                f"server RSS with {i['still_connected']} idle workers (heartbeat {hb})",
                f"{_f(i['rss_mb'])} MB (baseline {_f(i['baseline_rss_mb'])} MB, "
                f"+{_f(i['delta_mb'])} MB); connecting them took {i['connect_secs']} s",
            ]
        )
        rows.append(
            [
                f"server CPU with {i['still_connected']} idle workers (heartbeat {hb}; "
                f"{i['window_secs']} s window)",
                f"{_f(100 * i['cpu_share'], 2)} % of a core "
                f"(no workers: {_f(100 * i['baseline_cpu_share'], 2)} %)",
            ]
        )
    return ["### (e) Memory and idle cost", "", *_table(["measurement", "value"], rows), ""]


def ratios(res: dict[str, Any]) -> list[str]:
    a, b, c = res.get("a", {}), res.get("b", {}), res.get("c", {})
    mr = "ModelRelay"
    rows = []
    peers = ("direct", "LiteLLM", "nginx")
    if mr in a:
        rows.append(
            ["req/s, 32 connections (a)"]
            + [_ratio(a[mr]["rps"], a.get(p, {}).get("rps")) for p in peers]
        )
        rows.append(
            ["p50 latency, 32 connections (a)"]
            + [_ratio(a[mr]["p50_ms"], a.get(p, {}).get("p50_ms")) for p in peers]
        )
    if mr in b:
        rows.append(
            ["p50 latency, one in flight (b)"]
            + [_ratio(b[mr]["p50_ms"], b.get(p, {}).get("p50_ms")) for p in peers]
        )
    for k in sorted({int(k) for runs in c.values() for k in runs}):
        if str(k) in c.get(mr, {}):
            rows.append(
                [f"p99 chunk delay, K={k} (c)"]
                + [
                    _ratio(
                        c[mr][str(k)]["delay_p99_ms"],
                        c.get(p, {}).get(str(k), {}).get("delay_p99_ms"),
                    )
                    for p in peers
                ]
            )
    if not rows:
        return []
    return [
        "### Ratios (same run)",
        "",
        *_table(
            ["measure", "ModelRelay ÷ direct", "ModelRelay ÷ LiteLLM", "ModelRelay ÷ nginx"], rows
        ),
        "",
    ]


# --------------------------------------------------------------------------- targets


def goals(res: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """``(goal, measured, met)`` for each performance target; ``None`` when not measured."""
    a, b, c, e = (res.get(k, {}) for k in "abce")
    mr = "ModelRelay"
    out: list[tuple[str, str, bool | None]] = []

    def add(goal: str, measured: str | None, met: bool | None) -> None:
        out.append((goal, measured if measured is not None else "not measured", met))

    rps = a.get(mr, {}).get("rps")
    add(
        "relayed non-streaming ≥ 1,000 req/s per server process",
        _f(rps, 0) if rps else None,
        rps >= 1000 if rps else None,
    )
    lit = a.get("LiteLLM", {}).get("rps")
    add(
        "… and ≥ 2x LiteLLM",
        _ratio(rps, lit) if rps and lit else None,
        rps / lit >= 2 if rps and lit else None,
    )
    direct = b.get("direct", {}).get("p50_ms")
    mine = b.get(mr, {}).get("p50_ms")
    added = mine - direct if mine is not None and direct is not None else None
    add(
        "added p50 latency at one in flight ≤ 2 ms over direct",
        f"{added:.3f} ms" if added is not None else None,
        added <= 2 if added is not None else None,
    )
    lit_b = b.get("LiteLLM", {}).get("p50_ms")
    lit_added = lit_b - direct if lit_b is not None and direct is not None else None
    add(
        "… and ≤ half of LiteLLM's added latency",
        f"{added:.3f} ms vs LiteLLM {lit_added:.3f} ms"
        if added is not None and lit_added is not None
        else None,
        added <= lit_added / 2 if added is not None and lit_added is not None else None,
    )
    s250 = c.get(mr, {}).get("250")
    add(
        "≥ 250 concurrent 20-token/s streams: p99 chunk delay < 50 ms, every stream intact",
        f"p99 {s250['delay_p99_ms']:.1f} ms, {s250['intact']}/{s250['streams']} intact"
        if s250
        else None,
        s250["delay_p99_ms"] < 50 and s250["intact"] == s250["streams"] if s250 else None,
    )
    per_chunk = _per(s250, "server", "chunks")
    add(
        "server CPU ≤ 150 µs per relayed chunk (K=250)",
        f"{per_chunk:.0f} µs" if per_chunk is not None else None,
        per_chunk <= 150 if per_chunk is not None else None,
    )
    per_req = _per(a.get(mr), "server", "requests")
    add(
        "server CPU ≤ 500 µs per relayed non-streaming request",
        f"{per_req:.0f} µs" if per_req is not None else None,
        per_req <= 500 if per_req is not None else None,
    )
    q = e.get("queued")
    add(
        "≤ 50 MB RSS for 1,000 queued requests (growth over the idle server)",
        f"+{q['delta_mb']:.1f} MB (total {q['rss_mb']:.1f} MB)" if q else None,
        q["delta_mb"] <= 50 if q else None,
    )
    idle = e.get("idle") or e.get("idle_short")
    label = "" if e.get("idle") else " (shortened heartbeat only)"
    add(
        "1,000 idle connected workers cost ≤ 5 % of a core" + label,
        f"{100 * idle['cpu_share']:.2f} %" if idle else None,
        idle["cpu_share"] <= 0.05 if idle else None,
    )
    return out


def goals_table(res: dict[str, Any]) -> list[str]:
    rows = [
        [goal, measured, {True: "**met**", False: "**not met**", None: "-"}[met]]
        for goal, measured, met in goals(res)
    ]
    return ["### Targets", "", *_table(["target", "measured", "met?"], rows), ""]


LEGEND = (
    "CPU columns are shares of one core over the measured window, from `/proc/<pid>/stat`: "
    "*target* is the process under test (ModelRelay's server process, LiteLLM, nginx); *rig* "
    "is the load generator, the fake upstream and ModelRelay's worker.py processes (which "
    "run on the GPU boxes in a deployment); *other* is everything else the machine ran "
    "meanwhile (other users' work), which perturbs the figures when it is large."
)


def tables(res: dict[str, Any]) -> str:
    parts = [
        [LEGEND, ""],
        goals_table(res),
        ratios(res),
        throughput(res),
        latency(res),
        streaming(res),
        cpu(res),
        memory(res),
    ]
    return "\n".join(line for part in parts for line in part)
