"""``make chaos``: the request path under staged faults, and a fuzzer, on 127.0.0.1.

Usage::

    python chaos/run.py                       # the full matrix and the fuzzer, under
                                              # daphne and under uvicorn
    python chaos/run.py --quick               # small counts, daphne only
    python chaos/run.py --only mixed,fuzz     # some scenarios (comma list)
    python chaos/run.py --servers uvicorn     # one server

Each scenario starts its own fake backend (``chaos/upstream.py``), a ModelRelay server
(``manage.py serve``) and real ``worker.py`` processes, stages its faults, checks
what every client got and what the server shows afterwards, and stops every process
it started. See docs/RELIABILITY.md for the matrix and the last full run's figures.
Exits 1 when any check failed, known product failures (:mod:`chaos.known`) included.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from chaos import cluster, failover, report  # noqa: E402
from chaos.matrix import FUZZ, PROFILES, SCENARIOS_BY_NAME, Profile, run_scenario  # noqa: E402
from chaos.outcome import Outcome  # noqa: E402

RUN_LIMIT_SECS = 40 * 60


async def run_matrix(
    names: list[str], profile: Profile, servers: list[str], workdir: Path, *, verbose: bool = True
) -> list[tuple[str, Outcome]]:
    """Run ``names`` (in order) under each server; logs go under ``workdir``."""
    results = []
    for server in servers:
        for name in names:
            if verbose:
                print(f"{name} ({server}) ...", flush=True)
            if name == cluster.NAME:
                out = await cluster.run_cluster(profile.name, workdir / f"{server}-{name}", server)
            elif name in (failover.NAME, f"{failover.NAME}-valkey"):
                flavor = "valkey" if name.endswith("-valkey") else "redis"
                out = await failover.run_failover(
                    profile.name, workdir / f"{server}-{name}", server, flavor
                )
            else:
                scenario = FUZZ if name == FUZZ.name else SCENARIOS_BY_NAME[name]
                out = await run_scenario(scenario, profile, workdir / f"{server}-{name}", server)
            results.append((server, out))
            if verbose:
                state = "pass" if out.passed else "FAIL " + ", ".join(c.name for c in out.failures)
                print(f"  {state} in {out.seconds:.0f} s; {len(out.calls)} requests", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    all_names = [
        *SCENARIOS_BY_NAME,
        FUZZ.name,
        cluster.NAME,
        failover.NAME,
        f"{failover.NAME}-valkey",
    ]
    p = argparse.ArgumentParser(description="ModelRelay under staged faults, and a fuzzer.")
    p.add_argument("--quick", action="store_true", help="small counts (the 'quick' profile)")
    p.add_argument("--profile", choices=sorted(PROFILES), help="full, quick or test")
    p.add_argument("--only", default="", help="comma list of: " + ", ".join(all_names))
    p.add_argument(
        "--servers",
        help="comma list: daphne, uvicorn (default: both for a full run, daphne otherwise)",
    )
    p.add_argument("--mixed-secs", type=float, help="duration of the mixed run")
    p.add_argument("--mixed-clients", type=int, help="concurrent clients in the mixed run")
    p.add_argument("--fuzz-frames", type=int, help="mutated worker frames to send")
    p.add_argument("--fuzz-http", type=int, help="malformed HTTP requests to send")
    p.add_argument("--seed", type=int, help="random seed (mixed run and fuzzer)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the logs even when all passed")
    p.add_argument("-v", "--verbose", action="store_true", help="list every check")
    args = p.parse_args(argv)

    profile = PROFILES[args.profile or ("quick" if args.quick else "full")]
    overrides = {
        "mixed_seconds": args.mixed_secs,
        "mixed_clients": args.mixed_clients,
        "fuzz_frames": args.fuzz_frames,
        "fuzz_http": args.fuzz_http,
        "seed": args.seed,
    }
    profile = dataclasses.replace(profile, **{k: v for k, v in overrides.items() if v is not None})
    names = [n.strip() for n in args.only.split(",") if n.strip()] or all_names
    unknown = set(names) - set(all_names)
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(all_names)}")
    default_servers = "daphne,uvicorn" if profile.name == "full" else "daphne"
    servers = [s.strip() for s in (args.servers or default_servers).split(",") if s.strip()]
    if not set(servers) <= {"daphne", "uvicorn"}:
        p.error("--servers takes daphne, uvicorn")
    command = " ".join(["python", "chaos/run.py", *(sys.argv[1:] if argv is None else argv)])

    _raise_fd_limit()
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(RUN_LIMIT_SECS)
    workdir = Path(tempfile.mkdtemp(prefix="modelrelay-chaos-"))
    started = time.monotonic()
    print(f"ModelRelay chaos ({profile.name}; {', '.join(names)}; logs in {workdir})", flush=True)
    results: list[tuple[str, Outcome]] = []
    try:
        results = asyncio.run(run_matrix(names, profile, servers, workdir))
    finally:
        signal.alarm(0)
    took = time.monotonic() - started
    passed = all(out.passed for _, out in results)
    print()
    print(report.table(results))
    print()
    print(report.figures(results))
    if args.verbose:
        print()
        print(report.checks(results))
    if not passed:
        print()
        print(report.failures(results))
        legend = report.known_legend(results)
        if legend:
            print("\nKnown product failures (docs/RELIABILITY.md):")
            print(legend)
    print(
        f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
        f"{took:.0f} s: {command}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": command,
                    "profile": dataclasses.asdict(profile),
                    "cores": os.cpu_count(),
                    "seconds": round(took, 1),
                    "results": [dict(out.to_dict(), server=s) for s, out in results],
                },
                indent=1,
                default=str,
            )
        )
    if passed and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir}")
    return 0 if passed else 1


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _too_long(signum: int, frame: object) -> None:
    raise TimeoutError(f"the chaos run went over {RUN_LIMIT_SECS} s; stopped")


if __name__ == "__main__":
    sys.exit(main())
