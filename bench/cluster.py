"""(g) Cluster mode: two server processes sharing Redis, against one process.

Two ``manage.py serve`` processes (daphne) share a Redis prefix, a pepper and a
database; two ``worker.py`` are connected to process A only. The same loads as (a),
(b) and (c) are sent to A (*same process*: client and worker on one process) and to B
(*cross process*: B places each request on A's worker through Redis and relays it
over A's internal link), in the same run. Server CPU is the two processes' together.

Then *scaling*: two more workers join process B, and the non-streaming load is split
over A and B (two wrk runs of 16 connections at once), against the same load on A
alone. On a 2-core machine the load generator, the workers and the fake upstream
share the cores with the servers; their CPU is measured and reported beside the
ratio rather than assumed away.

Then *one worker each*: one worker of A and one of B leave, so each process has one
worker, and the same split load runs again: server CPU per request, both processes
summed, against the one-process figure (the same-process run: A alone with two workers,
32 connections); the target is ≤ 1.25x, the 2-core stand-in for "two processes on two
cores serve ≥ 1.6x one".

Last, a *rolling restart*: nginx (deploy/nginx.conf, both processes in its upstream) in
front, 16 wrk connections through it for the whole sequence while each process in turn
is SIGTERMed, started again on its port, and left alone for nginx's ``fail_timeout``
(10 s: nginx takes a process that refused a connection out of its upstream for that
long, and stopping the other one meanwhile would leave it none); requests/s and the
share of them answered 200 (target: 100 %).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import peers, scenarios
from bench.procs import Processes
from bench.scenarios import Window
from bench.targets import MODEL, ROOT, Target, start_server, start_workers, wait_workers

#: The Redis (g) shares (``BENCH_REDIS_URL`` names another, e.g. a private one).
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
_redis = urlsplit(REDIS_URL)
REDIS = (_redis.hostname or "127.0.0.1", _redis.port or 6379)


def redis_reachable() -> bool:
    try:
        with socket.create_connection(REDIS, timeout=1):
            return True
    except OSError:
        return False


def _serves_model(url: str) -> bool:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
        return any(m.get("id") == MODEL for m in json.loads(resp.read()).get("data", []))


def _wait(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"cluster bench: {what} not reached in {timeout:.0f} s")


def _forget(prefix: str) -> None:
    """Delete the run's keys in Redis (the servers are stopped by then)."""
    import redis

    client = redis.Redis(*REDIS)
    try:
        stale = list(client.scan_iter(match=f"{prefix}:*"))
        if stale:
            client.delete(*stale)
    finally:
        client.close()


def run(
    procs: Processes,
    workdir: Path,
    upstream_url: str,
    upstream_pid: int,
    s: dict[str, Any],
    log: Any,
) -> dict[str, Any]:
    if not redis_reachable():
        return {"skipped": f"Redis is not reachable at {REDIS[0]}:{REDIS[1]}"}
    prefix = f"bench-{secrets.token_hex(4)}"
    env = {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": prefix,
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        # (The rolling restart waits for each SIGTERMed process to exit: 5 s of grace.)
        "SHUTDOWN_GRACE_SECS": "5",
    }
    started = []
    try:
        a, a_url = start_server(procs, workdir, "cluster-a", None, "daphne", **env)
        started.append(a)
        shared = {**env, "DATABASE_URL": f"sqlite:///{workdir / 'data-cluster-a' / 'db.sqlite3'}"}
        b, b_url = start_server(procs, workdir, "cluster-b", None, "daphne", **shared)
        started.append(b)
        on_a = start_workers(procs, a_url, upstream_url, 2, "cluster-a")
        started += on_a
        wait_workers(a_url, 2, a, timeout=60)
        _wait(lambda: _serves_model(b_url), "process B learning A's workers")
        servers = [a.pid, b.pid]
        workers = [w.pid for w in on_a]

        def target(url: str, label: str, workers: list[int]) -> Target:
            t = Target(label, int(url.rsplit(":", 1)[1]))
            t.cpu_pids = {"server": servers, "workers": workers}
            return t

        same = target(a_url, "same process", workers)
        cross = target(b_url, "cross process", workers)
        res: dict[str, Any] = {"direct": {}, "same": {}, "cross": {}}
        log("  (g) one request in flight: direct, same process, cross process")
        direct = Target("direct", int(upstream_url.rsplit(":", 1)[1]))
        res["direct"]["b"] = scenarios.one_in_flight(direct, upstream_pid, s["b_count"])
        for key, t in (("same", same), ("cross", cross)):
            res[key]["b"] = scenarios.one_in_flight(t, upstream_pid, s["b_count"])
            res[key]["a"] = scenarios.throughput(
                t, upstream_pid, workdir, s["a_seconds"], s["warmup"]
            )
            res[key]["c"] = scenarios.streaming(
                t, upstream_pid, s["g_streams"], s["c_tokens"], s["c_ramp"]
            )
            r = res[key]
            log(
                f"  (g) {t.name:14} {r['a']['rps']:,.0f} req/s; one in flight p50 "
                f"{r['b']['p50_ms']:.3f} ms; {r['c']['streams']} streams intact "
                f"{r['c']['intact']}/{r['c']['streams']}"
            )

        # Scaling: workers on both processes, the load split over both.
        on_b = start_workers(procs, b_url, upstream_url, 2, "cluster-b")
        started += on_b
        wait_workers(b_url, 2, b, timeout=60)
        both = Target("two processes", 0)
        both.cpu_pids = {"server": servers, "workers": workers + [w.pid for w in on_b]}
        res["two"] = _split_throughput(both, [a_url, b_url], upstream_pid, workdir, s)
        log(f"  (g) two processes: {res['two']['rps']:,.0f} req/s")

        # One worker each: one of A's and one of B's leave.
        for proc in (on_a[1], on_b[1]):
            procs.stop(proc)
            started.remove(proc)
        wait_workers(a_url, 1, a, timeout=60)
        wait_workers(b_url, 1, b, timeout=60)
        spread = Target("one worker each", 0)
        spread.cpu_pids = {"server": servers, "workers": [on_a[0].pid, on_b[0].pid]}
        res["spread"] = _split_throughput(spread, [a_url, b_url], upstream_pid, workdir, s)
        one = res["same"]["a"]
        res["spread"]["us_per_request"] = _server_us(res["spread"])
        res["spread"]["one_us_per_request"] = _server_us(one)
        log(
            f"  (g) one worker each, load split: {res['spread']['rps']:,.0f} req/s, "
            f"{res['spread']['us_per_request']:.0f} µs server CPU per request "
            f"(one process: {one['rps']:,.0f} req/s, {res['spread']['one_us_per_request']:.0f} µs)"
        )

        # A rolling restart through nginx, under load.
        restarts = {"cluster-a": (a, a_url, env), "cluster-b": (b, b_url, shared)}
        res["rolling"] = _rolling_restart(procs, workdir, restarts, started, s)
        r = res["rolling"]
        log(
            f"  (g) rolling restart: {r['requests']:,} requests in {r['wall']:.0f} s "
            f"({r['rps']:,.0f} req/s), {r['ok_share']:.2%} answered 200, exits {r['exits']}"
        )
        return res
    finally:
        for proc in reversed(started):
            procs.stop(proc)
        _forget(prefix)


def _server_us(run: dict[str, Any]) -> float:
    """Server CPU (all server processes) per request, in µs."""
    return run["cpu"]["server"] / max(1, run["requests"]) * 1e6


def _rolling_restart(
    procs: Processes,
    workdir: Path,
    servers: dict[str, tuple[Any, str, dict[str, str]]],
    started: list[Any],
    s: dict[str, Any],
) -> dict[str, Any]:
    """wrk through nginx while each process is SIGTERMed and started again in turn."""
    from bench.procs import free_port
    from bench.targets import project_python, server_env
    from tests.test_deploy_proxies import nginx_command, nginx_main_config, render_loopback

    ports = [int(url.rsplit(":", 1)[1]) for _, url, _ in servers.values()]
    front = free_port()
    nginx_dir = workdir / "nginx-cluster"
    nginx_dir.mkdir()
    site = render_loopback(ports[0], front)
    lines = "\n".join(f"    server 127.0.0.1:{p};" for p in ports)
    site = site.replace(f"    server 127.0.0.1:{ports[0]};", lines, 1)
    conf = nginx_main_config(nginx_dir, site)
    conf.write_text(conf.read_text().replace("worker_connections 256", "worker_connections 4096"))
    nginx = procs.start("nginx-cluster", nginx_command(peers.NGINX, nginx_dir, conf), cwd=nginx_dir)
    started.append(nginx)
    url = f"http://127.0.0.1:{front}"
    _wait(lambda: _serves_model(url), "nginx in front of the cluster")
    script = workdir / "post.lua"
    script.write_text(scenarios.WRK_SCRIPT)
    fail_timeout = 10.0
    seconds = int(len(servers) * (fail_timeout + 12) + 5)
    argv = [scenarios.WRK, "-t1", "-c16", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    load = subprocess.Popen(
        [*argv, "-s", str(script), url + "/v1/chat/completions"], stdout=subprocess.PIPE, text=True
    )
    exits: list[int | None] = []
    t0 = time.monotonic()
    time.sleep(2)
    for label, (proc, server_url, env) in servers.items():
        os.kill(proc.pid, signal.SIGTERM)
        try:
            exits.append(proc.popen.wait(20))
        except subprocess.TimeoutExpired:
            exits.append(None)  # still running: killed below, counted as not exiting
            procs.stop(proc)
        port = server_url.rsplit(":", 1)[1]
        again = procs.start(
            f"server-{label}.2",
            [project_python(), "manage.py", "serve", "--listen", f"127.0.0.1:{port}"],
            env=server_env(workdir / f"data-{label}", **env),
            cwd=ROOT,
        )
        started.append(again)
        again.wait_for_line(r"Listening on", timeout=90)
        _wait(lambda u=server_url: _serves_model(u), f"process {label} serving again")
        time.sleep(fail_timeout)  # nginx takes it back only after fail_timeout
    out = load.communicate(timeout=seconds + 60)[0]
    wall = time.monotonic() - t0
    parsed = scenarios.parse_wrk(out)
    return {
        "requests": parsed["requests"],
        "rps": parsed["rps"],
        "errors": parsed["errors"],
        "ok_share": 1 - parsed["errors"] / max(1, parsed["requests"]),
        "wall": round(wall, 1),
        "exits": exits,
        "wrk": " ".join(argv),
    }


def _split_throughput(
    target: Target, urls: list[str], upstream_pid: int, workdir: Path, s: dict[str, Any]
) -> dict[str, Any]:
    """wrk with 16 connections against each URL at once (32 in all, as in (a))."""
    script = workdir / "post.lua"
    script.write_text(scenarios.WRK_SCRIPT)
    seconds = s["a_seconds"]

    def wrk(url: str, secs: int) -> subprocess.Popen[str]:
        argv = [scenarios.WRK, "-t1", "-c16", f"-d{secs}s", "--latency", "--timeout", "10s"]
        argv += ["-s", str(script)]
        return subprocess.Popen(
            [*argv, url + "/v1/chat/completions"], stdout=subprocess.PIPE, text=True
        )

    if s["warmup"]:
        for p in [wrk(u, s["warmup"]) for u in urls]:
            p.communicate(timeout=s["warmup"] + 60)
    with Window(target, upstream_pid) as window:
        runs = [wrk(u, seconds) for u in urls]
        outs = [p.communicate(timeout=seconds + 60)[0] for p in runs]
    parsed = [scenarios.parse_wrk(out) for out in outs]
    return {
        "rps": sum(p["rps"] for p in parsed),
        "requests": sum(p["requests"] for p in parsed),
        "errors": sum(p["errors"] for p in parsed),
        "cpu": window.cpu(),
        "wall": round(window.wall, 3),
        "cores": os.cpu_count() or 1,
    }
