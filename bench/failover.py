"""(p) Cluster mode on a Redis watched by Sentinel (SPEC §20).

A master, a replica and three sentinels of the run's own on 127.0.0.1
(``tests/sentinelkit.py``: ``redis-server --sentinel``, ``min-replicas-to-write 1``, the
sentinels' timings shrunk), and ``manage.py serve`` processes (daphne) that find the
master through them:

- *one process*: A alone with two ``worker.py``, wrk with 32 connections as in (a);
- *two processes placing across each other*: B joins, and each process has one worker;
  wrk with 16 connections against each at once. Server CPU per request, both processes
  summed, against one process's (the target: ≤ :data:`SPREAD_CPU_RATIO`); then the same
  with two more processes started with ``CLUSTER_LOCAL_SLACK`` (:data:`LOCAL_SLACK`), which
  keeps a request on its own process's worker within that many requests of the least;
- *a failover under load*: the same split load for :data:`FAILOVER_LOAD_SECS`, with
  ``SENTINEL FAILOVER`` after two seconds (the sentinels make the old master a replica
  at their next look at it, up to 10 s later; until then the new master refuses writes,
  and the processes are degraded, serving their own workers): requests, non-2xx
  answers, and how long each process was degraded.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench import scenarios
from bench.cluster import _serves_model, _split_throughput, _wait
from bench.procs import Processes
from bench.targets import Target, health, start_server, start_workers, wait_workers
from tests.sentinelkit import SentinelSet, free_ports, server_binary

#: Two processes placing across each other: summed server CPU per request, against one.
SPREAD_CPU_RATIO = 1.3
#: The same measured again with CLUSTER_LOCAL_SLACK at this (the default is 0).
LOCAL_SLACK = 1
FAILOVER_LOAD_SECS = 20


def run(
    procs: Processes,
    workdir: Path,
    upstream_url: str,
    upstream_pid: int,
    s: dict[str, Any],
    log: Any,
) -> dict[str, Any]:
    binary = server_binary()
    if binary is None:
        return {"skipped": "redis-server is not installed"}
    ports = free_ports(5)
    (workdir / "sentinel").mkdir()
    sentinels = SentinelSet(binary, workdir / "sentinel", ports[:2], ports[2:])
    sentinels.start()
    env = {
        **sentinels.env,
        "REDIS_PREFIX": f"bench-{secrets.token_hex(4)}",
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    }
    started = []
    try:
        a, a_url = start_server(procs, workdir, "sentinel-a", None, "daphne", **env)
        started.append(a)
        on_a = start_workers(procs, a_url, upstream_url, 2, "sentinel-a")
        started += on_a
        wait_workers(a_url, 2, a, timeout=60)
        one = Target("one process", int(a_url.rsplit(":", 1)[1]))
        one.cpu_pids = {"server": [a.pid], "workers": [w.pid for w in on_a]}
        res: dict[str, Any] = {
            "one": scenarios.throughput(one, upstream_pid, workdir, s["a_seconds"], s["warmup"])
        }
        log(f"  (p) one process on Sentinel: {res['one']['rps']:,.0f} req/s")

        shared = {**env, "DATABASE_URL": f"sqlite:///{workdir / 'data-sentinel-a' / 'db.sqlite3'}"}
        b, b_url = start_server(procs, workdir, "sentinel-b", None, "daphne", **shared)
        started.append(b)
        procs.stop(on_a[1])
        started.remove(on_a[1])
        on_b = start_workers(procs, b_url, upstream_url, 1, "sentinel-b")
        started += on_b
        wait_workers(a_url, 1, a, timeout=60)
        wait_workers(b_url, 1, b, timeout=60)
        _wait(lambda: _serves_model(b_url) and _serves_model(a_url), "both processes serving")
        spread = Target("two processes", 0)
        spread.cpu_pids = {"server": [a.pid, b.pid], "workers": [on_a[0].pid, on_b[0].pid]}
        res["spread"] = _split_throughput(spread, [a_url, b_url], upstream_pid, workdir, s)
        res["spread"]["us_per_request"] = _us(res["spread"])
        res["spread"]["one_us_per_request"] = _us(res["one"])
        log(
            f"  (p) two processes, one worker each: {res['spread']['rps']:,.0f} req/s, "
            f"{res['spread']['us_per_request']:.0f} µs server CPU per request (one process: "
            f"{res['spread']['one_us_per_request']:.0f} µs)"
        )
        res["local"] = _local_spread(procs, workdir, upstream_url, upstream_pid, env, s)
        res["local"]["one_us_per_request"] = _us(res["one"])
        log(
            f"  (p) the same with CLUSTER_LOCAL_SLACK={LOCAL_SLACK}: {res['local']['rps']:,.0f} "
            f"req/s, {res['local']['us_per_request']:.0f} µs server CPU per request"
        )
        res["failover"] = _failover_under_load(sentinels, [a_url, b_url], workdir)
        res["load_average"] = round(os.getloadavg()[0], 2)
        f = res["failover"]
        log(
            f"  (p) SENTINEL FAILOVER under load: {f['requests']:,} requests, "
            f"{f['errors']} not 2xx, degraded {f['degraded']}"
        )
        return res
    finally:
        for proc in reversed(started):
            procs.stop(proc)
        sentinels.stop()


def _local_spread(
    procs: Processes, workdir: Path, upstream_url: str, upstream_pid: int,
    env: dict[str, str], s: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Two more processes, a cluster of their own on the same Redis (another prefix),
    with CLUSTER_LOCAL_SLACK set, one worker each, the same split load."""
    local = {
        **env,
        "REDIS_PREFIX": f"bench-{secrets.token_hex(4)}",
        "CLUSTER_LOCAL_SLACK": str(LOCAL_SLACK),
    }
    started = []
    try:
        c, c_url = start_server(procs, workdir, "sentinel-c", None, "daphne", **local)
        started.append(c)
        database = workdir / "data-sentinel-c" / "db.sqlite3"
        shared = {**local, "DATABASE_URL": f"sqlite:///{database}"}
        d, d_url = start_server(procs, workdir, "sentinel-d", None, "daphne", **shared)
        started.append(d)
        on_c = start_workers(procs, c_url, upstream_url, 1, "sentinel-c")
        on_d = start_workers(procs, d_url, upstream_url, 1, "sentinel-d")
        started += on_c + on_d
        wait_workers(c_url, 1, c, timeout=60)
        wait_workers(d_url, 1, d, timeout=60)
        _wait(lambda: _serves_model(c_url) and _serves_model(d_url), "both processes serving")
        spread = Target("two processes, local slack", 0)
        spread.cpu_pids = {"server": [c.pid, d.pid], "workers": [on_c[0].pid, on_d[0].pid]}
        res = _split_throughput(spread, [c_url, d_url], upstream_pid, workdir, s)
        res["us_per_request"] = _us(res)
        res["slack"] = LOCAL_SLACK
        return res
    finally:
        for proc in reversed(started):
            procs.stop(proc)


def _us(run: dict[str, Any]) -> float:
    return float(run["cpu"]["server"]) / max(1, run["requests"]) * 1e6


def _failover_under_load(sentinels: SentinelSet, urls: list[str], workdir: Path) -> dict[str, Any]:
    """16 wrk connections against each process while the master fails over."""
    script = workdir / "post.lua"
    script.write_text(scenarios.WRK_SCRIPT)
    argv = [scenarios.WRK, "-t1", "-c16", f"-d{FAILOVER_LOAD_SECS}s", "--timeout", "10s"]
    loads = [
        subprocess.Popen(
            [*argv, "-s", str(script), url + "/v1/chat/completions"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for url in urls
    ]
    degraded = dict.fromkeys(urls, 0.0)
    stop = threading.Event()

    def watch() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.05)
            now = time.monotonic()
            for url in urls:
                try:
                    state = health(url).get("cluster", {})
                except OSError:
                    continue
                if isinstance(state, dict) and state.get("state") != "ok":
                    degraded[url] += now - last
            last = now

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(2)
    sentinels.failover(hurry=False)
    outs = [p.communicate(timeout=FAILOVER_LOAD_SECS + 60)[0] for p in loads]
    stop.set()
    watcher.join()
    parsed = [scenarios.parse_wrk(out) for out in outs]
    return {
        "requests": sum(p["requests"] for p in parsed),
        "errors": sum(p["errors"] for p in parsed),
        "rps": sum(p["rps"] for p in parsed),
        "seconds": FAILOVER_LOAD_SECS,
        "degraded": ", ".join(f"{chr(97 + i)} {s:.1f} s" for i, s in enumerate(degraded.values())),
        "wrk": " ".join(argv),
    }
