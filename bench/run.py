"""``make bench``: ModelRelay against the upstream alone, LiteLLM and nginx, on loopback.

Usage::

    python bench/run.py                 # everything; rewrites docs/BENCHMARKS.md
    python bench/run.py --quick         # a reduced pass (~2 min) for optimising
    python bench/run.py --only c        # one scenario (a to p; comma list)

Scenarios (see bench/README.md for what each measures): (a) non-streaming
throughput, (b) added latency at one request in flight, (c) concurrent 20 token/s
streams, (d) server CPU per request and per chunk (measured inside a and c), (e) RSS
with 1,000 queued requests and with 1,000 idle workers, and the idle workers' CPU.
ModelRelay is measured as deployed (daphne) and with ``manage.py serve --server
uvicorn``.

Every process is started here, on 127.0.0.1, in its own process group, and stopped
when the run ends however it ends (:mod:`bench.procs`); :mod:`bench.campaign` runs
the measurements and :mod:`bench.report` writes the results.
"""

from __future__ import annotations

import argparse
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import environment, report  # noqa: E402
from bench.campaign import ALL_TARGETS, Campaign, cpu_set  # noqa: E402
from bench.procs import Processes  # noqa: E402
from bench.report.document import markdown  # noqa: E402
from bench.report.notes import notes  # noqa: E402
from bench.report.profiles import profile_lines  # noqa: E402

DOCS = ROOT / "docs" / "BENCHMARKS.md"
#: A full run with the scenarios on real llama-servers ((k), (m), (n)) takes most of an
#: hour on two cores; past this it is stopped.
RUN_LIMIT_SECS = 60 * 60


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ModelRelay benchmarks against its peers.")
    p.add_argument("--quick", action="store_true", help="reduced pass (~2.5 min)")
    p.add_argument(
        "--only",
        default="",
        help="scenarios to run: a to m, o, p (d = a + c; f = one big box; "
        "g = two processes through Redis; h = per-key limits; i = batches; "
        "j = priority classes; k = cache-aware routing; l = fleet observability; "
        "m = models on demand; n = speed-aware routing; o = streams that survive a "
        "dropped connection; p = cluster mode on Sentinel)",
    )
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

    only = {x.strip() for x in args.only.split(",") if x.strip()} or set("abcdefghijklmnop")
    if not only <= set("abcdefghijklmnop"):
        p.error("--only takes a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p")
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
        background = environment.background_load()
        with Processes(workdir) as procs:
            run = Campaign(args, workdir, procs)
            res = run.res
            res["settings"] = dict(
                run.s,
                pin=run.pin,
                sut_cpus=run.sut_cpus,
                rig_cpus=run.rig_cpus,
                workers=args.workers,
                cores=os.cpu_count() or 1,
                rig_cores=len(cpu_set(run.rig_cpus)),
            )
            print(
                f"ModelRelay benchmarks ({'quick' if args.quick else 'full'}; scenarios "
                f"{','.join(sorted(only))}; logs in {workdir})",
                flush=True,
            )
            run.execute(only, names)
            res["meta"] = {
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": environment.machine(),
                "versions": environment.versions(run.bench_python),
                "background_load": background,
                "runtime_secs": time.monotonic() - started,
            }
        res["notes"] = notes(res)
        print()
        print(report.tables(res))
        for note in res["notes"]:
            print("note:", note)
        if res.get("profiles"):
            print("\n".join(profile_lines(res["profiles"], rows=8, res=res)))
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
