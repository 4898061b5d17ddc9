"""The measurements: one function per scenario, each returning plain dicts for the report.

(a) :func:`throughput` — wrk, 32 keep-alive connections, non-streaming;
(b) :func:`one_in_flight` — sequential requests from the asyncio client;
(c) :func:`streaming` — K concurrent 20 token/s streams, chunk delay and integrity;
(d) CPU per request/chunk: measured inside (a) and (c) from ``/proc`` deltas;
(e) :func:`queued_memory` and :func:`idle_workers` — RSS and idle CPU of the server.
"""

from __future__ import annotations

import asyncio
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.connection import chat_request
from bench.procs import CpuMeter, Processes, machine_busy, rss_bytes
from bench.targets import (
    ROOT,
    WORKER_SECRET,
    Target,
    health,
    project_python,
    start_server,
    start_workers,
    wait_workers,
)

HOST = "127.0.0.1"
WRK = shutil.which("wrk") or "/usr/bin/wrk"
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '{"model":"bench-model","messages":[{"role":"user","content":"Say hi"}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _children_cpu() -> float:
    self_ = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


class Window:
    """CPU of the target's processes, the upstream and the load generator over a window."""

    def __init__(self, target: Target, upstream_pid: int) -> None:
        pids = dict(target.cpu_pids)
        pids["upstream"] = [upstream_pid]
        self.meter = CpuMeter(pids)
        self.client0 = 0.0
        self.busy0 = 0.0

    def __enter__(self) -> Window:
        self.busy0 = machine_busy()
        self.meter.start()
        self.client0 = _children_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.meter.stop()
        used = self.meter.used
        used["client"] = _children_cpu() - self.client0
        # Whatever else ran meanwhile: other people's processes on a shared machine.
        ours = sum(used.values())
        used["other"] = max(0.0, machine_busy() - self.busy0 - ours)

    def cpu(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.meter.used.items()}

    @property
    def wall(self) -> float:
        return self.meter.wall


# --------------------------------------------------------------------------- (a)


def _wrk_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if match is None:
        return float("nan")
    return float(match.group(1)) * _UNITS[match.group(2)]


def run_wrk(url: str, connections: int, seconds: int, script: Path) -> dict[str, Any]:
    argv = [WRK, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    argv += ["-s", str(script), url + "/v1/chat/completions"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    return {"wrk": " ".join(argv[:-1]), **parse_wrk(out)}


def parse_wrk(out: str) -> dict[str, Any]:
    """Latency percentiles, requests, req/s and errors from ``wrk --latency`` output."""
    result: dict[str, Any] = {}
    for pct in ("50", "99"):
        match = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        result[f"p{pct}_ms"] = _wrk_ms(match.group(1)) if match else float("nan")
    match = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    result["requests"] = int(match.group(1)) if match else 0
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    result["rps"] = float(match.group(1)) if match else 0.0
    match = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(match.group(1)) if match else 0
    match = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if match:
        errors += sum(int(g) for g in match.groups())
    result["errors"] = errors
    if not result["requests"]:
        raise RuntimeError(f"wrk failed:\n{out}")
    return result


def throughput(
    target: Target, upstream_pid: int, workdir: Path, seconds: int, warmup: int
) -> dict[str, Any]:
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT)
    if warmup:
        run_wrk(target.url, 32, warmup, script)
    with Window(target, upstream_pid) as window:
        result = run_wrk(target.url, 32, seconds, script)
    result["cpu"] = window.cpu()
    result["wall"] = round(window.wall, 3)
    return result


# --------------------------------------------------------------------------- (b)


def one_in_flight(target: Target, upstream_pid: int, count: int) -> dict[str, Any]:
    raw = chat_request(HOST, target.port, stream=False)
    asyncio.run(loadgen.sequential(HOST, target.port, raw, max(20, count // 10)))  # warm-up
    with Window(target, upstream_pid) as window:
        result = asyncio.run(loadgen.sequential(HOST, target.port, raw, count))
    lat = result.latencies_us
    return {
        "cpu": window.cpu(),
        "wall": round(window.wall, 3),
        "count": len(lat),
        "errors": result.errors,
        "p50_ms": loadgen.percentile(lat, 50) / 1000,
        "p99_ms": loadgen.percentile(lat, 99) / 1000,
        "mean_ms": sum(lat) / len(lat) / 1000 if lat else float("nan"),
        "sample": result.sample_body.decode(errors="replace"),
    }


# --------------------------------------------------------------------------- (c)


def streaming(
    target: Target, upstream_pid: int, count: int, tokens: int, ramp: float
) -> dict[str, Any]:
    limit = tokens / 20 + ramp + 60
    with Window(target, upstream_pid) as window:
        result = asyncio.run(
            loadgen.streams(HOST, target.port, count=count, tokens=tokens, ramp=ramp, limit=limit)
        )
    delays, gaps = result.delays_us, result.gaps_us
    return {
        "streams": count,
        "tokens": tokens,
        "intact": result.intact,
        "chunks": result.chunks,
        "delay_p50_ms": loadgen.percentile(delays, 50) / 1000,
        "delay_p99_ms": loadgen.percentile(delays, 99) / 1000,
        "delay_max_ms": max(delays) / 1000 if delays else float("nan"),
        "gap_p50_ms": loadgen.percentile(gaps, 50) / 1000,
        "gap_p99_ms": loadgen.percentile(gaps, 99) / 1000,
        "problems": result.problems,
        "elapsed": round(result.elapsed, 2),
        "cpu": window.cpu(),
        "wall": round(window.wall, 3),
    }


# --------------------------------------------------------------------------- (e)


def _wait_queue(url: str, depth: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        seen = int(health(url)["queue_depth"])  # type: ignore[call-overload]
        if seen >= depth:
            return seen
        time.sleep(0.1)
    return seen


def _idle_helper(
    procs: Processes, url: str, label: str, count: int, models: str, max_concurrent: int
) -> Any:
    return procs.start(
        f"idle-{label}",
        [
            project_python(),
            "-m",
            "bench.idle_workers",
            "--url",
            url.replace("http://", "ws://", 1),
            "--secret",
            WORKER_SECRET,
            "--count",
            str(count),
            "--prefix",
            f"{label}-",
            "--models",
            models,
            "--max-concurrent",
            str(max_concurrent),
        ],
        cwd=ROOT,
    )


def queued_memory(
    procs: Processes,
    workdir: Path,
    upstream_url: str,
    queued: int,
    cpus: str | None,
    label: str,
    server_name: str,
) -> dict[str, Any]:
    """Server RSS with ``queued`` requests waiting (one more is held by a silent worker)."""
    server, url = start_server(
        procs,
        workdir,
        label,
        cpus,
        server_name,
        QUEUE_TIMEOUT_SECS="300",
        REQUEST_TIMEOUT_SECS="600",
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        # Warm the request path with a real worker first, so one-time imports and
        # caches are in the baseline rather than counted as the queue's cost.
        (warm_worker,) = start_workers(procs, url, upstream_url, 1, label)
        wait_workers(url, 1, server, timeout=60)
        raw = chat_request(HOST, port, stream=False)
        asyncio.run(loadgen.closed_loop(HOST, port, raw, connections=32, duration=0, count=20))
        procs.stop(warm_worker)
        wait_workers(url, 0, server, timeout=30)
        holder_proc = _idle_helper(procs, url, f"{label}-holder", 1, "bench-model", 1)
        holder_proc.wait_for_line(r"registered 1\b", timeout=60)
        time.sleep(1.5)  # session row written, request-log flush done
        baseline = rss_bytes(server.pid)

        async def hold() -> dict[str, Any]:
            holder = loadgen.Holder()
            try:
                await holder.open(HOST, port, raw, queued + 1)
                depth = await asyncio.to_thread(_wait_queue, url, queued, 60)
                await asyncio.sleep(1.0)
                rss = rss_bytes(server.pid)
                depth = int(health(url)["queue_depth"])  # type: ignore[call-overload]
                answered = holder.answered()
                return {"rss": rss, "depth": depth, "answered_early": answered}
            finally:
                await holder.close()

        held = asyncio.run(hold())
        procs.stop(holder_proc)
    finally:
        procs.stop(server)
    return {
        "queued": held["depth"],
        "baseline_rss_mb": baseline / 2**20,
        "rss_mb": held["rss"] / 2**20,
        "delta_mb": (held["rss"] - baseline) / 2**20,
        "answered_early": held["answered_early"],
    }


def idle_workers(
    procs: Processes,
    workdir: Path,
    count: int,
    window: float,
    cpus: str | None,
    label: str,
    server_name: str,
    helpers: int = 2,
    **env: str,
) -> dict[str, Any]:
    """Server RSS and CPU share with ``count`` connected idle workers (and with none)."""
    server, url = start_server(procs, workdir, label, cpus, server_name, **env)
    try:
        time.sleep(2.0)  # start-up work (provider sync, first flush) out of the window
        base = CpuMeter({"server": [server.pid]}).start()
        time.sleep(min(window / 3, 10.0))
        base.stop()
        baseline_rss = rss_bytes(server.pid)
        started = time.monotonic()
        per = [count // helpers + (1 if i < count % helpers else 0) for i in range(helpers)]
        helper_procs = [
            _idle_helper(procs, url, f"{label}{i}", n, "bench-idle-model", 1)
            for i, n in enumerate(per)
        ]
        for helper, n in zip(helper_procs, per, strict=True):
            helper.wait_for_line(rf"registered {n}\b", timeout=180)
        wait_workers(url, count, server, timeout=60)
        connect_secs = time.monotonic() - started
        time.sleep(3.0)  # session rows written; connection bursts over
        meter = CpuMeter({"server": [server.pid]}).start()
        time.sleep(window)
        meter.stop()
        rss = rss_bytes(server.pid)
        still = int(health(url)["workers_connected"])  # type: ignore[call-overload]
        for helper in helper_procs:
            procs.stop(helper)
    finally:
        procs.stop(server)
    return {
        "workers": count,
        "still_connected": still,
        "connect_secs": round(connect_secs, 1),
        "window_secs": round(meter.wall, 1),
        "cpu_share": meter.share("server"),
        "baseline_cpu_share": base.share("server"),
        "baseline_rss_mb": baseline_rss / 2**20,
        "rss_mb": rss / 2**20,
        "delta_mb": (rss - baseline_rss) / 2**20,
        "env": env,
    }
