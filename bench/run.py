"""``make bench``: ModelRelay against the upstream alone, LiteLLM and nginx, on loopback.

Usage::

    python bench/run.py                 # everything; rewrites docs/BENCHMARKS.md
    python bench/run.py --quick         # a reduced pass (~2 min) for optimising
    python bench/run.py --only c        # one scenario (a, b, c, d or e; comma list)

Scenarios (see docs/BENCHMARKS.md for what each measures): (a) non-streaming
throughput, (b) added latency at one request in flight, (c) concurrent 20 token/s
streams, (d) server CPU per request and per chunk (measured inside a and c), (e) RSS
with 1,000 queued requests and with 1,000 idle workers, and the idle workers' CPU.

Every process is started here, on 127.0.0.1, in its own process group, and stopped
when the run ends however it ends. On a machine with two or more cores the target
under test (ModelRelay's server process, LiteLLM or nginx) is pinned to core 0 and the
rig — load generator, fake upstream, ModelRelay's worker.py processes (which run on
the GPU boxes in a deployment) — to the other cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import peers, report, scenarios, targets  # noqa: E402
from bench.procs import Proc, Processes  # noqa: E402
from bench.profile import command as profile_command  # noqa: E402
from bench.profile import parse as parse_profile  # noqa: E402

DOCS = ROOT / "docs" / "BENCHMARKS.md"
ALL_TARGETS = ("direct", "modelrelay", "litellm", "nginx")
RUN_LIMIT_SECS = 20 * 60


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "a_seconds": 4,
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
        }
    return {
        "a_seconds": 10,
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
    }


# --------------------------------------------------------------------------- machine


def _cpu_busy() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle, sum(fields[:8])


def background_load(seconds: float = 1.0) -> float:
    """Share of the whole machine busy before the run starts (other people's work)."""
    busy0, total0 = _cpu_busy()
    time.sleep(seconds)
    busy1, total1 = _cpu_busy()
    return (busy1 - busy0) / max(1, total1 - total0)


def machine() -> dict[str, str]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "os": _os_name(),
        "python": platform.python_version(),
    }


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.platform()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except OSError:
        return ""
    return out.stdout.strip()


def versions(bench_python: Path | None) -> dict[str, str]:
    text = (ROOT / "relay" / "__init__.py").read_text()
    match = re.search(r'__version__ = "([^"]+)"', text)
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "relay", "worker.py", "modelrelay_site")
        else ""
    )
    litellm = "not run"
    if bench_python is not None:
        out = subprocess.run(
            [
                str(bench_python),
                "-c",
                "import importlib.metadata as m; print(m.version('litellm'))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        litellm = out.stdout.strip() or "?"
    daphne = subprocess.run(
        [targets.project_python(), "-c", "import daphne; print(daphne.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    wrk = subprocess.run([scenarios.WRK, "-v"], capture_output=True, text=True).stdout
    return {
        "ModelRelay": f"{match.group(1) if match else '?'} @ {commit or '?'}{dirty}",
        "daphne": daphne or "?",
        "LiteLLM": litellm,
        "nginx": peers.nginx_version(),
        "wrk": wrk.split()[1] if wrk.split() else "?",
    }


# --------------------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace, workdir: Path, procs: Processes) -> None:
        self.args = args
        self.workdir = workdir
        self.procs = procs
        self.s = settings(args.quick)
        cores = os.cpu_count() or 1
        self.pin = args.pin and cores >= 2
        self.sut_cpus = "0" if self.pin else None
        self.rig_cpus = f"1-{cores - 1}" if cores > 2 else "1"
        self.res: dict[str, Any] = {"a": {}, "b": {}, "c": {}, "e": {}}
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
        match = proc.wait_for_line(r"upstream listening on (http://\S+)", timeout=30)
        self.upstream_url = match.group(1)
        self.upstream_port = int(self.upstream_url.rsplit(":", 1)[1])
        self.upstream_pid = proc.pid

    def start_target(self, name: str) -> targets.Target:
        if name == "direct":
            return targets.direct(self.upstream_port)
        if name == "modelrelay":
            return targets.start_modelrelay(
                self.procs, self.workdir, self.upstream_url, self.args.workers, self.sut_cpus
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
                    f"  (a) {label:<10} {r['rps']:>9,.0f} req/s  p50 {r['p50_ms']:.2f} ms  "
                    f"p99 {r['p99_ms']:.2f} ms  errors {r['errors']}"
                )
            if "b" in only:
                r = scenarios.one_in_flight(target, self.upstream_pid, s["b_count"])
                self.res["b"][label] = r
                self.log(
                    f"  (b) {label:<10} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                    f"errors {r['errors']}"
                )
            if "c" in only:
                ks = s["c_ks"] if name in ("direct", "modelrelay") else s["c_peer_ks"]
                for k in ks:
                    r = scenarios.streaming(
                        target, self.upstream_pid, k, s["c_tokens"], s["c_ramp"]
                    )
                    self.res["c"].setdefault(label, {})[str(k)] = r
                    self.log(
                        f"  (c) {label:<10} K={k:<4} intact {r['intact']}/{k}  delay p50 "
                        f"{r['delay_p50_ms']:.2f} ms p99 {r['delay_p99_ms']:.2f} ms  "
                        f"gap p99 {r['gap_p99_ms']:.1f} ms"
                    )
            if self.args.profile and name == "modelrelay":
                self.profile_modelrelay(target, only)
        finally:
            targets.stop(self.procs, target)
        self.log(f"  {label} done in {time.monotonic() - t0:.0f} s")

    def profile_modelrelay(self, target: targets.Target, only: set[str]) -> None:
        """py-spy (samples holding the GIL) on the server and worker, after measuring."""
        py_spy = self.py_spy()
        if py_spy is None:
            self.log("  (profile) py-spy not found; skipped")
            return
        profiles = self.res.setdefault("profiles", {})
        server = target.cpu_pids["server"][0]
        worker = target.cpu_pids["workers"][0]
        s = self.s
        seconds = 8
        pids = {"server": server, "worker": worker}

        def spy(key: str, duration: float) -> tuple[list[Proc], dict[str, Path]]:
            outs = {n: self.workdir / f"prof-{key}-{n}.txt" for n in pids}
            spies = [
                self.procs.start(
                    f"py-spy-{key}-{n}", profile_command(py_spy, pids[n], outs[n], duration)
                )
                for n in pids
            ]
            return spies, outs

        def collect(key: str, spies: list[Proc], outs: dict[str, Path]) -> None:
            for proc in spies:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(30)
                self.procs.stop(proc)
            profiles[key] = {n: self._top(p) for n, p in outs.items()}

        if "a" in only:
            spies, outs = spy("a", seconds)
            scenarios.run_wrk(target.url, 32, seconds + 2, self.workdir / "post.lua")
            collect("a", spies, outs)
        if "c" in only:
            k = 250 if 250 in s["c_ks"] else s["c_ks"][-1]
            spies, outs = spy(f"c{k}", s["c_tokens"] / s["token_rate"])
            scenarios.streaming(target, self.upstream_pid, k, s["c_tokens"], s["c_ramp"])
            collect(f"c{k}", spies, outs)
        self.log("  (profile) ModelRelay server and worker sampled")

    def _top(self, path: Path) -> dict[str, Any]:
        if not path.exists():
            return {"samples": 0, "self": [], "total": []}
        prof = parse_profile(path)
        ours = prof.top_total_in(("(relay/", "(worker.py", "(workers_app/", "(modelrelay_site/"))
        return {"samples": prof.samples, "self": prof.top(15), "ours": ours}

    def py_spy(self) -> str | None:
        for candidate in (
            self.bench_python.parent / "py-spy" if self.bench_python else None,
            ROOT / ".venv" / "bin" / "py-spy",
        ):
            if candidate is not None and candidate.exists():
                return str(candidate)
        return shutil.which("py-spy")

    def memory(self) -> None:
        s = self.s
        t0 = time.monotonic()
        q = scenarios.queued_memory(
            self.procs, self.workdir, self.upstream_url, s["queued"], self.sut_cpus
        )
        self.res["e"]["queued"] = q
        self.log(
            f"  (e) {q['queued']} queued: server RSS {q['rss_mb']:.1f} MB "
            f"(+{q['delta_mb']:.1f} MB over {q['baseline_rss_mb']:.1f} MB)"
        )
        runs = []
        if s["idle_default_window"]:
            runs.append(("idle", s["idle_default_window"], {}))
        if s["idle_short_window"]:
            short = {"HEARTBEAT_INTERVAL_SECS": "1", "HEARTBEAT_TIMEOUT_SECS": "10"}
            runs.append(("idle_short", s["idle_short_window"], short))
        for key, window, env in runs:
            i = scenarios.idle_workers(
                self.procs, self.workdir, s["idle_workers"], window, self.sut_cpus, key, **env
            )
            self.res["e"][key] = i
            self.log(
                f"  (e) {i['still_connected']} idle workers ({key}): server "
                f"{100 * i['cpu_share']:.2f} % of a core, RSS {i['rss_mb']:.1f} MB "
                f"(+{i['delta_mb']:.1f} MB)"
            )
        self.log(f"  memory and idle done in {time.monotonic() - t0:.0f} s")

    def execute(self, only: set[str], names: list[str]) -> None:
        if self.pin:
            os.sched_setaffinity(0, _cpu_set(self.rig_cpus))
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
        if "e" in only and "modelrelay" in names:
            self.log("ModelRelay memory and idle workers:")
            self.memory()


def _cpu_set(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


# --------------------------------------------------------------------------- output


def markdown(res: dict[str, Any], command: str) -> str:
    meta, s = res["meta"], res["settings"]
    m, v = meta["machine"], meta["versions"]
    layout = (
        f"target under test pinned to core {s['sut_cpus']}; load generator, fake upstream and "
        f"ModelRelay's worker.py on core(s) {s['rig_cpus']} (`taskset`)"
        if s["pin"]
        else "no CPU pinning: the scheduler spreads every process over all cores (`--pin` "
        "isolates the target on core 0)"
    )
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run.py`); do not edit by hand. "
        "What each scenario does and how to read it: `bench/README.md`.",
        "",
        f"- **Command:** `{command}` — finished {meta['date']} in {meta['runtime_secs']:.0f} s",
        f"- **Machine:** {m['cpu']}, {m['cores']} cores, {m['memory']} RAM; {m['os']}, "
        f"{m['kernel']}; Python {m['python']}",
        f"- **Versions:** ModelRelay {v['ModelRelay']} (daphne {v['daphne']}); "
        f"LiteLLM {v['LiteLLM']}; nginx {v['nginx']}; wrk {v['wrk']}",
        f"- **Layout:** {layout}. ModelRelay: one `manage.py serve` process (SQLite, "
        f"LOG_LEVEL=warning) and {s['workers']} `worker.py` process(es) with `--max-concurrent "
        "512`. LiteLLM: one uvicorn worker, no database, access log off. nginx: one worker "
        "process, `proxy_buffering off`, upstream keep-alive.",
        f"- **Background load** before the run (other processes on this machine): "
        f"{100 * meta['background_load']:.0f} % of all cores.",
        "",
        report.tables(res),
    ]
    notes = res.get("notes") or []
    if notes:
        lines += ["### Notes", "", *[f"- {n}" for n in notes], ""]
    profiles = res.get("profiles")
    if profiles:
        lines += profile_lines(profiles)
    return "\n".join(lines).rstrip() + "\n"


def profile_lines(profiles: dict[str, Any], rows: int = 15) -> list[str]:
    out = [
        "### Profiles (py-spy, samples holding the GIL, during a separate unmeasured pass)",
        "",
    ]
    titles = {"a": "(a) non-streaming, 32 connections"}
    for key, procs in profiles.items():
        title = titles.get(key, f"(c) {key[1:]} streams")
        for name, prof in procs.items():
            out += [f"**{title} — {name}** ({prof['samples']} samples); top by own time:", ""]
            out += ["| self % | total % | function |", "|---|---|---|"]
            out += [f"| {s:.1f} | {t:.1f} | `{fn}` |" for fn, s, t in prof["self"][:rows]]
            ours = prof.get("ours") or []
            if ours:
                out += [
                    "",
                    "ModelRelay's own functions, inclusive: "
                    + "; ".join(f"`{fn}` {t:.1f} %" for fn, t in ours),
                ]
            out.append("")
    return out


def notes(res: dict[str, Any]) -> list[str]:
    """Caveats read off the CPU figures: perturbed windows and saturated rigs or machines."""
    out = []
    st = res["settings"]
    for scen in ("a", "c"):
        for t, runs in res.get(scen, {}).items():
            items = runs.items() if scen == "c" else [("", runs)]
            for k, r in items:
                where = f"({scen}) {t}" + (f" K={k}" if k else "")
                other = report._share(r, ("other",))
                if other >= 15:
                    out.append(
                        f"{where}: processes outside the benchmark used {other:.0f} % of a core "
                        "during this measurement; the figure may be perturbed."
                    )
                shares = {n: 100 * c / r["wall"] for n, c in r["cpu"].items() if r["wall"]}
                busiest = max((n for n in shares if n != "other"), key=lambda n: shares[n])
                if st["pin"]:
                    rig = report._share(r, report.RIG)
                    if rig < 90 * st["rig_cores"]:
                        continue
                    note = f"{where}: the rig core(s) were {rig:.0f} % busy"
                else:
                    total = sum(shares.values())
                    if total < 90 * st["cores"]:
                        continue
                    note = f"{where}: the machine's {st['cores']} cores were {total:.0f} % busy"
                note += (
                    f" (busiest: {busiest}, {shares[busiest]:.0f} % of a core), so this figure "
                    "is bounded by the CPU of the benchmark machine"
                )
                per = report._per(r, "server", "requests" if scen == "a" else "chunks")
                if t == "ModelRelay" and per:
                    unit = "req/s" if scen == "a" else "chunks/s"
                    note += (
                        f"; the server process used {shares.get('server', 0):.0f} % of a "
                        f"core, and at {per:.0f} µs per {'request' if scen == 'a' else 'chunk'} "
                        f"one fully busy core would relay about {1e6 / per:,.0f} {unit}"
                    )
                out.append(note + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ModelRelay benchmarks against its peers.")
    p.add_argument("--quick", action="store_true", help="reduced pass (~2 min)")
    p.add_argument("--only", default="", help="scenarios to run: a,b,c,d,e (d = a + c)")
    p.add_argument(
        "--targets", default=",".join(ALL_TARGETS), help="comma list of " + ",".join(ALL_TARGETS)
    )
    p.add_argument("--workers", type=int, default=2, help="worker.py processes (default 2)")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin the target under test to core 0 and the rig to the others (default: off)",
    )
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="py-spy the ModelRelay server and worker in an extra pass after measuring "
        "(default: on for a full run, off for --quick/--only)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="rewrite docs/BENCHMARKS.md even when "
        "--quick or --only is given (a full run always does)",
    )
    p.add_argument("--no-docs", action="store_true", help="never rewrite docs/BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = p.parse_args(argv)

    only = {x.strip() for x in args.only.split(",") if x.strip()} or set("abcde")
    if not only <= set("abcde"):
        p.error("--only takes a, b, c, d, e")
    if "d" in only:
        only |= {"a", "c"}
    names = [n.strip().lower() for n in args.targets.split(",") if n.strip()]
    if not set(names) <= set(ALL_TARGETS):
        p.error("--targets takes " + ", ".join(ALL_TARGETS))
    names = [n for n in ALL_TARGETS if n in names]
    full = not args.quick and not args.only
    write_docs = not args.no_docs and (args.docs or full)
    if args.profile is None:
        args.profile = full
    command = " ".join(["python", "bench/run.py", *(sys.argv[1:] if argv is None else argv)])

    _raise_fd_limit()
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(RUN_LIMIT_SECS)
    started = time.monotonic()
    res: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="modelrelay-bench-"))
    ok = False
    try:
        background = background_load()
        with Processes(workdir) as procs:
            run = Run(args, workdir, procs)
            res = run.res
            res["settings"] = dict(
                run.s,
                pin=run.pin,
                sut_cpus=run.sut_cpus,
                rig_cpus=run.rig_cpus,
                workers=args.workers,
                cores=os.cpu_count() or 1,
                rig_cores=len(_cpu_set(run.rig_cpus)),
            )
            print(
                f"ModelRelay benchmarks ({'quick' if args.quick else 'full'}; scenarios "
                f"{','.join(sorted(only))}; logs in {workdir})",
                flush=True,
            )
            run.execute(only, names)
            res["meta"] = {
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine(),
                "versions": versions(run.bench_python),
                "background_load": background,
                "runtime_secs": time.monotonic() - started,
            }
        res["notes"] = notes(res)
        print()
        print(report.tables(res))
        for note in res["notes"]:
            print("note:", note)
        if res.get("profiles"):
            print("\n".join(profile_lines(res["profiles"], rows=8)))
        if write_docs:
            DOCS.parent.mkdir(exist_ok=True)
            DOCS.write_text(markdown(res, command))
            print(f"wrote {DOCS.relative_to(ROOT)}")
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=str))
        ok = True
    finally:
        signal.alarm(0)
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"benchmark failed; logs kept in {workdir}", file=sys.stderr)
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < 8192:
        print(f"warning: only {want} open files allowed; (e) needs ~3,000", file=sys.stderr)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _too_long(signum: int, frame: object) -> None:
    raise TimeoutError(f"the benchmark ran over {RUN_LIMIT_SECS} s; stopped")


if __name__ == "__main__":
    sys.exit(main())
