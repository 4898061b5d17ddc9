"""The report's measurement sections: (a) throughput, (b) one in flight, (c) streaming,
(d) CPU per request and chunk, (e) memory and idle cost, (f) one big box. Each returns
Markdown lines (none when its scenario did not run).
"""

from __future__ import annotations

from typing import Any

from bench.report.table import HEADER, OWN, RELAYS, RIG, SERVER, num, per, present, share, table


def throughput(res: dict[str, Any]) -> list[str]:
    a = res.get("a")
    if not a:
        return []
    s = res["settings"]
    rows = []
    for t in present(a):
        r = a[t]
        rows.append(
            [
                t,
                num(r["rps"], 0),
                num(r["p50_ms"], 2),
                num(r["p99_ms"], 2),
                str(r["errors"]),
                num(share(r, OWN[t]), 0) if OWN[t] else "-",
                num(share(r, RIG), 0),
                num(share(r, ("other",)), 0),
            ]
        )
    out = [
        f"### (a) Non-streaming throughput — 32 keep-alive connections, {s['a_seconds']} s, wrk",
        "",
        *table(
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
    for t in present(b):
        r = b[t]
        added50 = r["p50_ms"] - base["p50_ms"] if base and t != "direct" else None
        added99 = r["p99_ms"] - base["p99_ms"] if base and t != "direct" else None
        rows.append(
            [
                t,
                num(r["p50_ms"], 3),
                num(r["p99_ms"], 3),
                num(added50, 3),
                num(added99, 3),
                str(r["errors"]),
                _same_body(r, base, t),
            ]
        )
    count = next(iter(b.values()))["count"]
    return [
        f"### (b) One request in flight — {count} sequential requests per target",
        "",
        *table(
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
    for t in present(c):
        for k, r in sorted(c[t].items(), key=lambda kv: int(kv[0])):
            problems = ", ".join(f"{v} {p}" for p, v in r["problems"].items()) or ""
            rows.append(
                [
                    t,
                    str(k),
                    f"{r['intact']}/{r['streams']}" + (f" ({problems})" if problems else ""),
                    num(r["delay_p50_ms"], 2),
                    num(r["delay_p99_ms"], 2),
                    num(r["delay_max_ms"], 1),
                    num(r["gap_p50_ms"], 1),
                    num(r["gap_p99_ms"], 1),
                    num(share(r, OWN[t]), 0) if OWN[t] else "-",
                    num(share(r, RIG), 0),
                    num(share(r, ("other",)), 0),
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
        *table(
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


def cpu(res: dict[str, Any]) -> list[str]:
    a, b, c = res.get("a", {}), res.get("b", {}), res.get("c", {})
    if not a and not c and not b:
        return []
    ks = sorted({int(k) for runs in c.values() for k in runs})
    rows = []
    processes = [(t, name) for t in RELAYS for name in ("server", "workers")]
    processes += [("LiteLLM", "litellm"), ("nginx", "nginx"), ("direct", "upstream")]
    for t, name in processes:
        if t not in a and t not in b and t not in c:
            continue
        if t in RELAYS:
            label = f"{t} " + ("server process" if name == "server" else "worker.py")
        else:
            label = f"{t} ({name})" if t == "direct" else t
        row = [label, num(per(a.get(t), name, "requests"), 0)]
        row.append(num(per(b.get(t), name, "count"), 0))
        for k in ks:
            row.append(num(per(c.get(t, {}).get(str(k)), name, "chunks"), 0))
        rows.append(row)
    return [
        "### (d) CPU per relayed request and per relayed chunk",
        "",
        "utime+stime from `/proc/<pid>/stat` over the measured window ÷ requests completed "
        "(a, b) or SSE events delivered (c); worker figures are all worker processes together.",
        "",
        *table(
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


def _heartbeat(run: dict[str, Any]) -> str:
    hb = (run.get("env") or {}).get("HEARTBEAT_INTERVAL_SECS")
    return f"{hb} s" if hb else "15 s, the default"


def _memory_rows(e: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """``(measurement, {server: value})`` for the runs of (e), in a fixed order."""
    rows: dict[str, dict[str, str]] = {}
    for relay in RELAYS:
        runs = e.get(relay) or {}
        q = runs.get("queued")
        if q:
            rows.setdefault(
                f"server RSS with {q['queued']} queued requests (+1 held by a silent worker)", {}
            )[relay] = (
                f"{num(q['rss_mb'])} MB (baseline {num(q['baseline_rss_mb'])} MB, "
                f"+{num(q['delta_mb'])} MB)"
            )
        for key in ("idle", "idle_short"):
            i = runs.get(key)
            if not i:
                continue
            hb = _heartbeat(i)
            rows.setdefault(f"server RSS with {i['workers']} idle workers (heartbeat {hb})", {})[
                relay
            ] = (
                f"{num(i['rss_mb'])} MB (baseline {num(i['baseline_rss_mb'])} MB, "
                f"+{num(i['delta_mb'])} MB); {i['still_connected']} connected in "
                f"{i['connect_secs']} s"
            )
            rows.setdefault(
                f"server CPU with {i['workers']} idle workers (heartbeat {hb}; "
                f"{i['window_secs']:.0f} s window)",
                {},
            )[relay] = (
                f"{num(100 * i['cpu_share'], 2)} % of a core "
                f"(no workers: {num(100 * i['baseline_cpu_share'], 2)} %)"
            )
    return list(rows.items())


def memory(res: dict[str, Any]) -> list[str]:
    e = res.get("e")
    if not e:
        return []
    relays = [r for r in RELAYS if e.get(r)]
    head = ["measurement", *[HEADER[r] for r in relays]]
    rows = [[m, *[v.get(r, "-") for r in relays]] for m, v in _memory_rows(e)]
    return ["### (e) Memory and idle cost", "", *table(head, rows), ""]


def big_box(res: dict[str, Any]) -> list[str]:
    f = res.get("f")
    if not f:
        return []
    rows = []
    shape = next(iter(f.values()))
    for relay in [r for r in RELAYS if r in f]:
        r = f[relay]
        w = r["window"]
        problems = ", ".join(f"{v} {p}" for p, v in r["problems"].items())
        rows.append(
            [
                SERVER[relay],
                f"{r['intact']}/{r['streams']}" + (f" ({problems})" if problems else ""),
                num(w["chunks"] / w["wall"] if w["wall"] else None, 0),
                num(r["delay_p50_ms"], 2),
                num(r["delay_p99_ms"], 2),
                num(r["delay_max_ms"], 1),
                num(r["gap_p99_ms"], 1),
                num(share(w, ("workers",)) / 100, 2),
                num(per(w, "workers", "chunks"), 0),
                num(share(w, ("server",)) / 100, 2),
                num(per(w, "server", "chunks"), 0),
                num(share(w, ("upstream", "client")) / 100, 2),
                num(share(w, ("other",)) / 100, 2),
            ]
        )
    return [
        f"### (f) One big box — {shape['streams']} concurrent streams at {shape['rate']:g} "
        f"tokens/s through one worker.py ({shape['tokens']} tokens each)",
        "",
        "One `worker.py` (as on a big vLLM box) in front of the fake upstream, through one "
        "ModelRelay server. Delay, gap and integrity as in (c), over the whole run. CPU (in "
        "cores, i.e. shares of one core, and µs per chunk) over the steady state only: from "
        "the moment every stream runs until the first one ends.",
        "",
        *table(
            [
                "server",
                "intact",
                "chunks/s (steady)",
                "delay p50 ms",
                "delay p99 ms",
                "delay max ms",
                "gap p99 ms",
                "worker.py CPU (cores)",
                "worker.py µs / chunk",
                "server CPU (cores)",
                "server µs / chunk",
                "upstream + load generator (cores)",
                "other (cores)",
            ],
            rows,
        ),
        "",
    ]
