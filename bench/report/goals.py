"""The performance targets, met or not, for ModelRelay as deployed and under uvicorn.

The table judges the default deployment (daphne); a second pair of columns gives the
same targets measured with ``manage.py serve --server uvicorn``, everything else equal.
"""

from __future__ import annotations

from typing import Any

from bench.report.table import DEFAULT, HEADER, RELAYS, num, per, ratio, share, table

Goal = tuple[str, str, bool | None]


def goals(res: dict[str, Any], relay: str = DEFAULT) -> list[Goal]:
    """``(goal, measured, met)`` for each performance target; ``None`` when not measured."""
    a, b, c, e, f = (res.get(k, {}) for k in "abcef")
    out: list[Goal] = []

    def add(goal: str, measured: str | None, met: bool | None) -> None:
        out.append((goal, measured if measured is not None else "not measured", met))

    rps = a.get(relay, {}).get("rps")
    add(
        "relayed non-streaming ≥ 1,000 req/s per server process",
        num(rps, 0) if rps else None,
        rps >= 1000 if rps else None,
    )
    lit = a.get("LiteLLM", {}).get("rps")
    add(
        "… and ≥ 2x LiteLLM",
        ratio(rps, lit) if rps and lit else None,
        rps / lit >= 2 if rps and lit else None,
    )
    direct = b.get("direct", {}).get("p50_ms")
    mine = b.get(relay, {}).get("p50_ms")
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
    s250 = c.get(relay, {}).get("250")
    add(
        "≥ 250 concurrent 20-token/s streams: p99 chunk delay < 50 ms, every stream intact",
        f"p99 {s250['delay_p99_ms']:.1f} ms, {s250['intact']}/{s250['streams']} intact"
        if s250
        else None,
        s250["delay_p99_ms"] < 50 and s250["intact"] == s250["streams"] if s250 else None,
    )
    per_chunk = per(s250, "server", "chunks")
    add(
        "server CPU ≤ 150 µs per relayed chunk (K=250)",
        f"{per_chunk:.0f} µs" if per_chunk is not None else None,
        per_chunk <= 150 if per_chunk is not None else None,
    )
    per_req = per(a.get(relay), "server", "requests")
    add(
        "server CPU ≤ 500 µs per relayed non-streaming request",
        f"{per_req:.0f} µs" if per_req is not None else None,
        per_req <= 500 if per_req is not None else None,
    )
    # Throughput per core at vLLM scale: tighter bounds, lower again under uvicorn.
    daphne = relay == DEFAULT
    chunk_max, req_max = (70, 300) if daphne else (50, 200)
    add(
        "server CPU per relayed chunk (K=250) ≤ 70 µs under daphne, ≤ 50 µs under uvicorn",
        f"{per_chunk:.0f} µs" if per_chunk is not None else None,
        per_chunk <= chunk_max if per_chunk is not None else None,
    )
    add(
        "server CPU per non-streaming request ≤ 300 µs under daphne, ≤ 200 µs under uvicorn",
        f"{per_req:.0f} µs" if per_req is not None else None,
        per_req <= req_max if per_req is not None else None,
    )
    add(
        "added p50 latency at one in flight ≤ 1.0 ms over direct",
        f"{added:.3f} ms" if added is not None else None,
        added <= 1.0 if added is not None else None,
    )
    worker_chunk = per(s250, "workers", "chunks")
    add(
        "worker.py CPU ≤ 40 µs per relayed chunk (K=250)",
        f"{worker_chunk:.0f} µs" if worker_chunk is not None else None,
        worker_chunk <= 40 if worker_chunk is not None else None,
    )
    worker_req = per(a.get(relay), "workers", "requests")
    add(
        "worker.py CPU ≤ 300 µs per non-streaming request",
        f"{worker_req:.0f} µs" if worker_req is not None else None,
        worker_req <= 300 if worker_req is not None else None,
    )
    mem = e.get(relay) or {}
    q = mem.get("queued")
    add(
        "≤ 50 MB RSS for 1,000 queued requests (growth over the idle server)",
        f"+{q['delta_mb']:.1f} MB (total {q['rss_mb']:.1f} MB)" if q else None,
        q["delta_mb"] <= 50 if q else None,
    )
    big = f.get(relay)
    window = big["window"] if big else None
    add(
        "one big box, 200 streams x 50 tokens/s through one worker.py: every stream intact, "
        "p99 chunk delay ≤ 20 ms",
        f"p99 {big['delay_p99_ms']:.1f} ms, {big['intact']}/{big['streams']} intact"
        if big
        else None,
        big["delay_p99_ms"] <= 20 and big["intact"] == big["streams"] if big else None,
    )
    worker_cores = share(window, ("workers",)) / 100 if window else None
    add(
        "… worker.py CPU ≤ 0.5 core",
        f"{worker_cores:.2f} core" if worker_cores is not None else None,
        worker_cores <= 0.5 if worker_cores is not None else None,
    )
    server_cores = share(window, ("server",)) / 100 if window else None
    add(
        "… server CPU ≤ 0.6 core",
        f"{server_cores:.2f} core" if server_cores is not None else None,
        server_cores <= 0.6 if server_cores is not None else None,
    )
    idle = mem.get("idle") or mem.get("idle_short")
    label = " (shortened heartbeat only)" if idle and not mem.get("idle") else ""
    add(
        "1,000 idle connected workers cost ≤ 5 % of a core",
        f"{100 * idle['cpu_share']:.2f} %{label}" if idle else None,
        idle["cpu_share"] <= 0.05 if idle else None,
    )
    return out


def _met(met: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "-"}[met]


def goals_table(res: dict[str, Any]) -> list[str]:
    measured = {r: goals(res, r) for r in RELAYS}
    relays = [DEFAULT] + [
        r for r in RELAYS[1:] if any(met is not None for _, _, met in measured[r])
    ]
    head = ["target"]
    for r in relays:
        head += [HEADER[r], "met?"]
    rows = []
    for i, (goal, _, _) in enumerate(measured[DEFAULT]):
        row = [goal]
        for r in relays:
            _, value, met = measured[r][i]
            row += [value, _met(met)]
        rows.append(row)
    intro = []
    if len(relays) > 1:
        intro = [
            "Judged on the default deployment (daphne); the uvicorn columns are the same "
            "targets with `manage.py serve --server uvicorn`, everything else equal.",
            "",
        ]
    return ["### Targets", "", *intro, *table(head, rows), ""]
