"""One benchmark run's measurements: the upstream, each target in turn, then memory.

A :class:`Campaign` starts the fake upstream once, then for each target starts it,
runs (a), (b) and (c) against it (and, for a ModelRelay deployment, the profiling
pass), and stops it before the next one, so nothing else runs on the machine while a
target is measured. (e) starts fresh servers of its own. The results are plain dicts
in :attr:`Campaign.res`, which the report turns into tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from bench import (
    affinity,
    batches,
    big_box,
    classes,
    cluster,
    failover,
    fleet,
    limits,
    ondemand,
    peers,
    resume,
    scenarios,
    speeds,
    targets,
)
from bench.procs import Processes
from bench.profiler import Profiler, find_py_spy
from bench.targets import RELAYS, ROOT

#: CLI names of the targets, in the order they run and are reported.
ALL_TARGETS = ("direct", "modelrelay", "modelrelay-uvicorn", "litellm", "nginx")


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "a_seconds": 4,
            "access_log_pairs": 1,
            "warmup": 1,
            "b_count": 300,
            "c_ks": [250],
            "c_peer_ks": [],
            "c_tokens": 60,
            "c_ramp": 1.0,
            "token_rate": 20.0,
            "queued": 1000,
            "idle_workers": 1000,
            "idle_default_window": 15,
            "idle_short_window": 0,
            "f_streams": 200,
            "f_rate": 50.0,
            "f_tokens": 300,
            "f_ramp": 1.0,
            "g_streams": 50,
            "h_requests": 5_000,
            "h_rounds": 2,
            "i_lines": 300,
            "i_slots": 4,
            "i_service": 0.2,
            "i_baseline": 10,
            "j_service": 0.2,
            "j_seconds": 6.0,
            "j_slots": 4,
            "j_trickle": 2.0,
            **AFFINITY,
            "k_distinct": 200,
            "k_distinct_rounds": 2,
            "k_rounds": 2,
            "k_llama_rounds": 1,
            "k_index_rounds": 300,
            "k_redis_calls": 1000,
            "m_requests": 20,
            "m_clients": 2,
            "m_skew_requests": 30,
            "m_skew_clients": 3,
            **SPEEDS,
            "n_seconds": 12.0,
            "n_rounds": 1,
            "n_warmup": 30,
            "n_hedge_requests": 200,
            "n_llama_seconds": 15.0,
            "n_cost_rounds": 500,
            "n_conversation_rounds": 1,
            "l_requests": 2_000,
            "l_rounds": 3,
            "l_workers": 100,
            "l_series": 1_000,
            **RESUME,
            "o_reattaches": 2,
            "o_retained": 300,
            "o_cost_rounds": 3,
        }
    return {
        "a_seconds": 10,
        "access_log_pairs": 3,
        "warmup": 2,
        "b_count": 1000,
        "c_ks": [100, 250, 500],
        "c_peer_ks": [100, 250],
        "c_tokens": 100,
        "c_ramp": 1.0,
        "token_rate": 20.0,
        "queued": 1000,
        "idle_workers": 1000,
        "idle_default_window": 30,
        "idle_short_window": 10,
        "f_streams": 200,
        "f_rate": 50.0,
        "f_tokens": 600,
        "f_ramp": 1.0,
        "g_streams": 100,
        "h_requests": 20_000,
        "h_rounds": 5,
        "i_lines": 1000,
        "i_slots": 4,
        "i_service": 0.2,
        "i_baseline": 30,
        "j_service": 0.2,
        "j_seconds": 30.0,
        "j_slots": 4,
        "j_trickle": 2.0,
        **AFFINITY,
        "m_requests": 40,
        "m_clients": 2,
        "m_skew_requests": 60,
        "m_skew_clients": 3,
        **SPEEDS,
        "l_requests": 5_000,
        "l_rounds": 5,
        "l_workers": 100,
        "l_series": 1_000,
        **RESUME,
    }


#: (o) resumable streams (bench/resume.py).
RESUME: dict[str, Any] = {
    "o_events": 2000,
    "o_drop_at": 500,
    "o_token_delay": 0.002,
    "o_reattaches": 5,
    "o_retained": 1000,
    "o_retained_kib": 100,
    "o_bound_mib": 64,
    "o_cost_streams": 200,
    "o_cost_chunks": 100,
    "o_cost_rounds": 7,
}


#: (k) cache-aware routing: the workload and the caching fake backends (bench/affinity.py).
AFFINITY: dict[str, Any] = {
    "k_conversations": 16,
    "k_turns": 8,
    "k_first_bytes": 8000,
    "k_user_bytes": 300,
    "k_think_ms": 100.0,
    "k_llama_conversations": 8,
    "k_llama_turns": 12,
    "k_llama_system_bytes": 2000,
    "k_llama_first_bytes": 2000,
    "k_llama_user_bytes": 200,
    "k_llama_rounds": 2,
    "k_rounds": 3,
    "k_skew_others": 5,
    "k_skew_rounds": 4,
    "k_cost_us": 200.0,
    "k_cache_blocks": 2048,
    "k_distinct": 300,
    "k_distinct_bytes": 4000,
    "k_distinct_rounds": 3,
    "k_index_rounds": 1000,
    "k_memory_conversations": 100_000,
    "k_redis_calls": 2000,
}


#: (n) speed-aware routing: boxes of known speeds and the workload (bench/speeds.py).
SPEEDS: dict[str, Any] = {
    "n_cost_us": 250.0,
    "n_decode_ms": 20.0,
    "n_reply_tokens": 16,
    "n_short_bytes": 800,
    "n_long_bytes": 12000,
    "n_load": 0.25,
    "n_slots": 8,
    "n_warmup": 40,
    "n_seconds": 30.0,
    "n_rounds": 2,
    "n_hedge_requests": 400,
    "n_hedge_share": 0.05,
    "n_stall_secs": 5.0,
    "n_llama_short_bytes": 300,
    "n_llama_long_bytes": 3000,
    "n_llama_cost_us": 800.0,
    "n_llama_warmup": 20,
    "n_llama_seconds": 40.0,
    "n_llama_rounds": 1,
    "n_cost_rounds": 2000,
    "n_conversation_rounds": 2,
}


def cpu_set(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


class Campaign:
    def __init__(self, args: argparse.Namespace, workdir: Path, procs: Processes) -> None:
        self.args = args
        self.workdir = workdir
        self.procs = procs
        self.s = settings(args.quick)
        cores = os.cpu_count() or 1
        self.pin = args.pin and cores >= 2
        self.sut_cpus = "0" if self.pin else None
        self.rig_cpus = f"1-{cores - 1}" if cores > 2 else "1"
        self.res: dict[str, Any] = {"a": {}, "b": {}, "c": {}, "e": {}, "f": {}}
        self.bench_python: Path | None = None
        self.upstream_port = 0
        self.upstream_url = ""
        self.upstream_pid = 0

    def log(self, text: str) -> None:
        print(text, flush=True)

    def start_upstream(self) -> None:
        proc = self.procs.start(
            "upstream",
            [
                targets.project_python(),
                "-m",
                "bench.upstream",
                "--token-rate",
                str(self.s["token_rate"]),
            ],
            cwd=ROOT,
        )
        self.upstream_proc = proc
        match = proc.wait_for_line(r"upstream listening on (http://\S+)", timeout=30)
        self.upstream_url = match.group(1)
        self.upstream_port = int(self.upstream_url.rsplit(":", 1)[1])
        self.upstream_pid = proc.pid

    def ensure_upstream(self) -> None:
        """Start the shared upstream again if a scenario stopped it (those that start
        processes of their own stop every process when they are done)."""
        if not self.upstream_proc.alive():
            self.start_upstream()

    def start_target(self, name: str) -> targets.Target:
        if name == "direct":
            return targets.direct(self.upstream_port)
        if name in RELAYS:
            return targets.start_modelrelay(
                self.procs,
                self.workdir,
                self.upstream_url,
                self.args.workers,
                self.sut_cpus,
                name,
            )
        if name == "litellm":
            assert self.bench_python is not None
            return targets.start_litellm(
                self.procs, self.bench_python, self.workdir, self.upstream_url, self.sut_cpus
            )
        return targets.start_nginx(self.procs, self.workdir, self.upstream_port, self.sut_cpus)

    def measure_target(self, name: str, only: set[str]) -> None:
        s = self.s
        t0 = time.monotonic()
        target = self.start_target(name)
        label = target.name
        try:
            if "a" in only:
                r = scenarios.throughput(
                    target, self.upstream_pid, self.workdir, s["a_seconds"], s["warmup"]
                )
                self.res["a"][label] = r
                self.log(
                    f"  (a) {label:<20} {r['rps']:>9,.0f} req/s  p50 {r['p50_ms']:.2f} ms  "
                    f"p99 {r['p99_ms']:.2f} ms  errors {r['errors']}"
                )
            if "b" in only:
                r = scenarios.one_in_flight(target, self.upstream_pid, s["b_count"])
                self.res["b"][label] = r
                self.log(
                    f"  (b) {label:<20} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                    f"errors {r['errors']}"
                )
            if "c" in only:
                ks = s["c_ks"] if name == "direct" or name in RELAYS else s["c_peer_ks"]
                for k in ks:
                    r = scenarios.streaming(
                        target, self.upstream_pid, k, s["c_tokens"], s["c_ramp"]
                    )
                    self.res["c"].setdefault(label, {})[str(k)] = r
                    self.log(
                        f"  (c) {label:<20} K={k:<4} intact {r['intact']}/{k}  delay p50 "
                        f"{r['delay_p50_ms']:.2f} ms p99 {r['delay_p99_ms']:.2f} ms  "
                        f"gap p99 {r['gap_p99_ms']:.1f} ms"
                    )
            if self.args.profile and name in RELAYS:
                self.profile(name, target, only)
        finally:
            targets.stop(self.procs, target)
        self.log(f"  {label} done in {time.monotonic() - t0:.0f} s")

    def access_log(self) -> None:
        """(a) again, with the access log off and on, in alternated pairs (daphne): what
        one log line per request costs the server."""
        s = self.s
        runs: dict[str, list[dict[str, Any]]] = {"false": [], "true": []}
        for round_ in range(s["access_log_pairs"]):
            for value in ("false", "true"):
                target = targets.start_modelrelay(
                    self.procs,
                    self.workdir,
                    self.upstream_url,
                    self.args.workers,
                    self.sut_cpus,
                    label=f"access-log-{value}-{round_ + 1}",
                    env={"ACCESS_LOG": value},
                )
                try:
                    runs[value].append(
                        scenarios.throughput(
                            target, self.upstream_pid, self.workdir, s["a_seconds"], s["warmup"]
                        )
                    )
                finally:
                    targets.stop(self.procs, target)
        self.res["access_log"] = runs

    def profile(self, name: str, target: targets.Target, only: set[str]) -> None:
        """py-spy (samples holding the GIL) on the server, and on a worker for the default."""
        py_spy = find_py_spy(self.bench_python)
        if py_spy is None:
            self.log("  (profile) py-spy not found; skipped")
            return
        # worker.py is the same under either server: profile it once, with the default.
        worker = name == "modelrelay"
        profiler = Profiler(self.procs, self.workdir, py_spy)
        found = profiler.sample(target, self.upstream_pid, only, self.s, worker=worker)
        self.res.setdefault("profiles", {})[target.name] = found
        self.log(f"  (profile) {target.name} server{' and worker' if worker else ''} sampled")

    def big_box(self, name: str, upstream: tuple[str, int]) -> None:
        """(f): one worker.py in front of a fast upstream, many streams, through ``name``."""
        s = self.s
        t0 = time.monotonic()
        url, pid = upstream
        target = targets.start_modelrelay(
            self.procs, self.workdir, url, 1, self.sut_cpus, name, label=f"big-{name}"
        )
        label = target.name
        shape = (s["f_streams"], s["f_tokens"], s["f_rate"], s["f_ramp"])
        try:
            r = big_box.measure(target, pid, *shape)
            self.res["f"][label] = r
            w = r["window"]
            self.log(
                f"  (f) {label:<20} {r['streams']} x {r['rate']:g} tok/s: intact "
                f"{r['intact']}/{r['streams']}  delay p99 {r['delay_p99_ms']:.2f} ms  "
                f"worker {w['cpu']['workers'] / w['wall']:.2f} core  "
                f"server {w['cpu']['server'] / w['wall']:.2f} core"
            )
            if self.args.profile:
                py_spy = find_py_spy(self.bench_python)
                if py_spy is None:
                    self.log("  (profile) py-spy not found; skipped")
                else:
                    profiler = Profiler(self.procs, self.workdir, py_spy)
                    tag = f"big-{name}"
                    found = big_box.profile(profiler, tag, target, pid, *shape)
                    self.res.setdefault("profiles", {}).setdefault(label, {})["f"] = found
                    self.log(f"  (profile) {label} server and worker sampled under (f)")
        finally:
            targets.stop(self.procs, target)
        self.log(f"  {label} one big box done in {time.monotonic() - t0:.0f} s")

    def memory(self, name: str) -> None:
        s = self.s
        t0 = time.monotonic()
        label, server = RELAYS[name]
        out = self.res["e"].setdefault(label, {})
        q = scenarios.queued_memory(
            self.procs,
            self.workdir,
            self.upstream_url,
            s["queued"],
            self.sut_cpus,
            f"queue-{name}",
            server,
        )
        out["queued"] = q
        self.log(
            f"  (e) {label}: {q['queued']} queued: server RSS {q['rss_mb']:.1f} MB "
            f"(+{q['delta_mb']:.1f} MB over {q['baseline_rss_mb']:.1f} MB)"
        )
        runs = []
        if s["idle_default_window"]:
            runs.append(("idle", s["idle_default_window"], {}))
        # The shortened heartbeat is the application's cost, not the server's: measure it
        # with the default server only.
        if s["idle_short_window"] and name == "modelrelay":
            short = {"HEARTBEAT_INTERVAL_SECS": "1", "HEARTBEAT_TIMEOUT_SECS": "10"}
            runs.append(("idle_short", s["idle_short_window"], short))
        for key, window, env in runs:
            i = scenarios.idle_workers(
                self.procs,
                self.workdir,
                s["idle_workers"],
                window,
                self.sut_cpus,
                f"{key}-{name}",
                server,
                **env,
            )
            out[key] = i
            self.log(
                f"  (e) {label}: {i['still_connected']} idle workers ({key}): server "
                f"{100 * i['cpu_share']:.2f} % of a core, RSS {i['rss_mb']:.1f} MB "
                f"(+{i['delta_mb']:.1f} MB)"
            )
        self.log(f"  {label} memory and idle done in {time.monotonic() - t0:.0f} s")

    def execute(self, only: set[str], names: list[str]) -> None:
        if self.pin:
            os.sched_setaffinity(0, cpu_set(self.rig_cpus))
        if "litellm" in names and only & {"a", "b", "c"}:
            self.bench_python = peers.ensure_bench_venv(self.workdir / "bench-venv.log")
        elif self.args.profile:
            with contextlib.suppress(Exception):
                self.bench_python = peers.ensure_bench_venv(self.workdir / "bench-venv.log")
        self.start_upstream()
        if only & {"a", "b", "c"}:
            for name in names:
                self.log(f"{name}:")
                self.measure_target(name, only)
        relays = [name for name in names if name in RELAYS]
        if "a" in only and "modelrelay" in relays:
            self.log("access log (ACCESS_LOG off and on, alternated):")
            self.access_log()
        if "f" in only and relays:
            upstream = big_box.start_upstream(self.procs, self.s["f_rate"])
            for name in relays:
                self.log(f"{RELAYS[name][0]} one big box:")
                self.big_box(name, upstream)
        if "g" in only:
            self.log("ModelRelay cluster (two processes, Redis):")
            self.res["cluster"] = cluster.run(
                self.procs, self.workdir, self.upstream_url, self.upstream_pid, self.s, self.log
            )
        if "h" in only:
            self.log("per-key limits (relay core, in process; Redis admission):")
            redis_url = cluster.REDIS_URL if cluster.redis_reachable() else None
            self.res["limits"] = asyncio.run(
                limits.measure(self.s["h_requests"], self.s["h_rounds"], redis_url)
            )
        if "i" in only:
            self.log("batches on idle capacity (daphne):")
            self.res["batches"] = batches.run(self.procs, self.workdir, self.s, self.log)
        if "j" in only:
            self.log("priority classes (flex at 3x capacity, a default trickle):")
            self.res["classes"] = classes.run(self.procs, self.workdir, self.s, self.log)
        if "k" in only:
            self.log("cache-aware routing (caching fake backends):")
            self.res["affinity"] = affinity.run(self.procs, self.workdir, self.s, self.log)
        if "m" in only:
            self.log("models on demand (real llama-servers in router mode):")
            self.res["ondemand"] = ondemand.run(self.procs, self.workdir, self.s, self.log)
        if "n" in only:
            self.log("speed-aware routing (fake boxes of known speeds, a llama-server pair):")
            self.res["speeds"] = speeds.run(self.procs, self.workdir, self.s, self.log)
        if "l" in only:
            self.log("fleet observability (tracing off and on, federation of 100 workers):")
            self.res["fleet"] = fleet.run(self.s, self.log)
        if "o" in only:
            self.log("streams that survive a dropped connection (background mode, replay):")
            self.res["resume"] = resume.run(self.procs, self.workdir, self.s, self.log)
        if "p" in only:
            self.ensure_upstream()
            self.log("ModelRelay cluster on a Redis watched by Sentinel:")
            self.res["failover"] = failover.run(
                self.procs, self.workdir, self.upstream_url, self.upstream_pid, self.s, self.log
            )
        if "e" in only:
            self.ensure_upstream()
            for name in names:
                if name in RELAYS:
                    self.log(f"{RELAYS[name][0]} memory and idle workers:")
                    self.memory(name)
