"""(g) two server processes through Redis, (h) what per-key limits cost, and (p) cluster
mode on a Redis watched by Sentinel."""

from __future__ import annotations

from typing import Any

from bench.report.table import num, per, share, table

#: Cluster-mode targets: (label, measured, limit) are filled in by :func:`cluster`.
ADDED_P50_RATIO = 2.0
CHUNK_CPU_RATIO = 2.5
SCALING = 1.6
#: Per-key limits: what they may add per request in one process, and Redis round trips.
LIMITS_ADDED_US = 50.0
LIMITS_ROUND_TRIPS = 1.0


def _met(ok: bool | None) -> str:
    if ok is None:
        return "-"
    return "**met**" if ok else "**not met**"


def cluster(res: dict[str, Any]) -> list[str]:
    g = res.get("cluster")
    if not g:
        return []
    title = "### (g) Cluster mode — two server processes through Redis"
    if "skipped" in g:
        return [title, "", f"Not run: {g['skipped']}.", ""]
    direct_p50 = g["direct"]["b"]["p50_ms"]
    rows = []
    for key, label in (("same", "same process"), ("cross", "cross process")):
        r = g[key]
        rows.append(
            [
                label,
                num(r["a"]["rps"], 0),
                num(r["a"]["p50_ms"], 2),
                num(per(r["a"], "server", "requests"), 0),
                num(r["b"]["p50_ms"], 3),
                num(r["b"]["p50_ms"] - direct_p50, 3),
                num(r["b"]["p99_ms"] - g["direct"]["b"]["p99_ms"], 3),
                f"{r['c']['intact']}/{r['c']['streams']}",
                num(r["c"]["delay_p99_ms"], 2),
                num(per(r["c"], "server", "chunks"), 0),
            ]
        )
    same, cross, two = g["same"], g["cross"], g["two"]
    added = [x["b"]["p50_ms"] - direct_p50 for x in (same, cross)]
    chunk = [per(x["c"], "server", "chunks") for x in (same, cross)]
    one_rps, two_rps = same["a"]["rps"], two["rps"]
    targets = [
        [
            f"cross-process added p50 ≤ {ADDED_P50_RATIO:g}x the same-process added p50",
            f"{added[1]:.3f} ms vs {added[0]:.3f} ms ({added[1] / added[0]:.2f}x)",
            _met(added[1] <= ADDED_P50_RATIO * added[0]),
        ],
        [
            f"server CPU per cross-process streamed chunk ≤ {CHUNK_CPU_RATIO:g}x the "
            "same-process figure (both processes)",
            f"{num(chunk[1], 0)} µs vs {num(chunk[0], 0)} µs"
            + (f" ({chunk[1] / chunk[0]:.2f}x)" if chunk[0] and chunk[1] else ""),
            _met(None if not (chunk[0] and chunk[1]) else chunk[1] <= CHUNK_CPU_RATIO * chunk[0]),
        ],
        [
            f"two processes ≥ {SCALING:g}x the non-streaming throughput of one",
            f"{two_rps:,.0f} vs {one_rps:,.0f} req/s ({two_rps / one_rps:.2f}x)",
            _met(two_rps >= SCALING * one_rps),
        ],
    ]
    cores = two["cores"]
    same_cost = num(per(same["a"], "server", "requests"), 0)
    split = ", ".join(
        f"{name} {share(two, (key,)) / 100:.2f}"
        for name, key in (
            ("servers", "server"),
            ("worker.py", "workers"),
            ("load generator", "client"),
            ("upstream", "upstream"),
            ("other", "other"),
        )
    )
    return [
        title,
        "",
        "Two `manage.py serve` processes (daphne) share Redis, a pepper and the database; "
        "two `worker.py` are connected to process A. *Same process*: the load goes to A; "
        "*cross process*: to B, which places each request on A's workers through Redis and "
        "relays it over A's internal link. Server CPU is both processes together. Loads "
        "as in (a), (b) and (c) "
        f"({same['c']['streams']} streams of {same['c']['tokens']} tokens).",
        "",
        *table(
            [
                "client reaches",
                "req/s (a)",
                "p50 ms (a)",
                "server µs / request (a)",
                "p50 ms, one in flight",
                "added p50 ms",
                "added p99 ms",
                "streams intact",
                "chunk delay p99 ms",
                "server µs / chunk",
            ],
            rows,
        ),
        "",
        *table(["target", "measured", "met?"], targets),
        "",
        f"Scaling: with two more `worker.py` connected to B, 16 connections of wrk against "
        f"each process at once served {two_rps:,.0f} req/s ({two['errors']} errors) against "
        f"{one_rps:,.0f} req/s with 32 connections against A alone. Everything shares this "
        f"machine's {cores} cores; CPU during the two-process run, in cores: {split}. The "
        "servers could not have a core each here, and in cluster mode every request also "
        f"costs them the placement's Redis round trips ({same_cost} µs per request "
        "same-process above, against (d)'s one process without Redis).",
        "",
        *_spread_and_rolling(g),
    ]


#: Two processes with one worker each: summed server CPU per request, against one process.
SPREAD_CPU_RATIO = 1.25


def _spread_and_rolling(g: dict[str, Any]) -> list[str]:
    """One worker on each process, the load split; a rolling restart through nginx."""
    lines: list[str] = []
    spread, rolling = g.get("spread"), g.get("rolling")
    if spread:
        mine, one = spread["us_per_request"], spread["one_us_per_request"]
        ratio = mine / one if one else float("nan")
        lines += [
            *table(
                ["one worker on each process, 16 connections on each", "measured", "met?"],
                [
                    [
                        "req/s (one process, same-process run above)",
                        f"{spread['rps']:,.0f} ({g['same']['a']['rps']:,.0f})",
                        "-",
                    ],
                    [
                        f"server CPU per request, both processes, ≤ {SPREAD_CPU_RATIO:g}x "
                        "one process's",
                        f"{mine:,.0f} µs vs {one:,.0f} µs ({ratio:.2f}x)",
                        _met(ratio <= SPREAD_CPU_RATIO),
                    ],
                ],
            ),
            "",
        ]
    if rolling:
        exits = ", ".join("not in time" if code is None else str(code) for code in rolling["exits"])
        lines += [
            f"Rolling restart: `{rolling['wrk']}` through nginx (deploy/nginx.conf, both "
            "processes in its upstream) while each process in turn was SIGTERMed, started "
            "again on its port and left alone for nginx's `fail_timeout` (10 s): "
            f"{rolling['requests']:,} requests in {rolling['wall']:.0f} s, "
            f"{rolling['rps']:,.0f} req/s, {rolling['ok_share']:.2%} answered 200 (target "
            f"100 %: {_met(rolling['ok_share'] >= 1.0)}); exit codes: {exits}.",
            "",
        ]
    return lines


def limits(res: dict[str, Any]) -> list[str]:
    h = res.get("limits")
    if not h:
        return []
    rows = [
        ["admission: admit + close, every limit set", f"{h['admission_us']:.2f} µs"],
        ["dispatcher: submit + completion, no key", f"{h['dispatch_bare_us']:.2f} µs"],
        ["dispatcher: submit + completion, with admission", f"{h['dispatch_keyed_us']:.2f} µs"],
        [
            "fair queue: push + pop, 100 keys backlogged (10,000 waiting)",
            f"{h['fair_queue_us']:.2f} µs",
        ],
    ]
    targets = [
        [
            f"limit checks add ≤ {LIMITS_ADDED_US:g} µs per request in one process",
            f"{h['added_us']:.2f} µs",
            _met(h["added_us"] <= LIMITS_ADDED_US),
        ]
    ]
    if "redis_commands_per_request" in h:
        rows.append(
            [
                "Redis admission round trip (cluster mode)",
                f"p50 {h['redis_p50_us']:.0f} µs, p99 {h['redis_p99_us']:.0f} µs",
            ]
        )
        targets.append(
            [
                f"≤ {LIMITS_ROUND_TRIPS:g} Redis round trip per request in cluster mode",
                f"{h['redis_commands_per_request']:.3f} commands per admission",
                _met(h["redis_commands_per_request"] <= LIMITS_ROUND_TRIPS),
            ]
        )
    return [
        "### (h) Per-key limits — what they cost per request",
        "",
        "`bench/limits.py` on the relay core in this process (no HTTP): medians of rounds of "
        "requests; Redis commands counted at the client while admitting (ticket closes are "
        f"batched off the request path). Load average meanwhile: {h['load_average']:.2f}.",
        "",
        *table(["measure", "per request"], rows),
        "",
        *table(["target", "measured", "met?"], targets),
        "",
    ]


def failover(res: dict[str, Any]) -> list[str]:
    m = res.get("failover")
    if not m:
        return []
    from bench.failover import FAILOVER_LOAD_SECS, SPREAD_CPU_RATIO

    title = "### (p) Cluster mode on a Redis watched by Sentinel"
    if "skipped" in m:
        return [title, "", f"Not run: {m['skipped']}.", ""]
    one, spread, f = m["one"], m["spread"], m["failover"]
    mine, alone = spread["us_per_request"], spread["one_us_per_request"]
    ratio = mine / alone if alone else float("nan")
    split = ", ".join(
        f"{name} {share(spread, (key,)) / 100:.2f}"
        for name, key in (
            ("servers", "server"),
            ("worker.py", "workers"),
            ("load generator", "client"),
            ("upstream", "upstream"),
            ("other", "other"),
        )
    )
    return [
        title,
        "",
        "A master, a replica and three sentinels of the run's own on this machine "
        "(`min-replicas-to-write 1`); `manage.py serve` processes (daphne) find the master "
        "through the sentinels (`REDIS_SENTINELS`). *One process*: A with two `worker.py`, "
        "wrk with 32 connections as in (a). *Two processes placing across each other*: "
        "B joins, each process has one worker, 16 connections against each at once.",
        "",
        *table(
            ["measure", "measured", "met?"],
            [
                ["one process: req/s", f"{one['rps']:,.0f}", "-"],
                ["two processes: req/s", f"{spread['rps']:,.0f} ({spread['errors']} errors)", "-"],
                [
                    f"server CPU per request, both processes, ≤ {SPREAD_CPU_RATIO:g}x one "
                    "process's",
                    f"{mine:,.0f} µs vs {alone:,.0f} µs ({ratio:.2f}x)",
                    _met(ratio <= SPREAD_CPU_RATIO),
                ],
                *_local_rows(m.get("local"), alone, SPREAD_CPU_RATIO),
            ],
        ),
        "",
        f"CPU during the two-process run, in cores: {split}"
        + (
            f"; the machine's load average after the scenario: {m['load_average']:.2f}."
            if "load_average" in m
            else "."
        ),
        "",
        f"A failover under load: `{f['wrk']}` against each process for "
        f"{FAILOVER_LOAD_SECS} s, `SENTINEL FAILOVER` after 2 s: {f['requests']:,} requests "
        f"({f['rps']:,.0f} req/s), {f['errors']} not answered 2xx. The processes were "
        f"degraded, serving their own workers, for {f['degraded']}: the new master refuses "
        "writes (`min-replicas-to-write 1`) until the sentinels make the old one its "
        "replica, at their next look at it (every 10 s).",
        "",
    ]


def _local_rows(local: dict[str, Any] | None, alone: float, bound: float) -> list[list[str]]:
    """(p)'s split load again on two processes started with CLUSTER_LOCAL_SLACK."""
    if not local:
        return []
    mine = local["us_per_request"]
    ratio = mine / alone if alone else float("nan")
    slack = local["slack"]
    return [
        [
            f"two processes with `CLUSTER_LOCAL_SLACK={slack}`: req/s",
            f"{local['rps']:,.0f} ({local['errors']} errors)",
            "-",
        ],
        [
            f"… server CPU per request, both processes, ≤ {bound:g}x one process's",
            f"{mine:,.0f} µs vs {alone:,.0f} µs ({ratio:.2f}x)",
            _met(ratio <= bound),
        ],
    ]
