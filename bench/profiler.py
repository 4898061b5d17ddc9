"""The profiling pass: py-spy on a ModelRelay deployment after its measured runs.

The load of (a) and of (c) at K=250 is replayed while ``py-spy record --gil
--nonblocking`` samples the server process (and, when asked, one worker.py), so the
profiles say where the CPU of the measured figures went without perturbing them.
Each profile is kept as a summary: the top functions by own time, ModelRelay's own
functions by inclusive time, and the share of samples per package.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench import scenarios
from bench.procs import Proc, Processes
from bench.profile import command, parse
from bench.targets import ROOT, Target

#: Frames of ModelRelay's own code ...
OURS = ("(relay/", "(worker.py", "(workers_app/", "(modelrelay_site/")
#: ... except the entry points that start the event loop (on every stack).
ENTRY = ("<module> (", "main (worker.py)", "Serving.run (modelrelay_site/", "Command.handle (")
SECONDS = 8


def find_py_spy(bench_python: Path | None) -> str | None:
    for candidate in (
        bench_python.parent / "py-spy" if bench_python else None,
        ROOT / ".venv" / "bin" / "py-spy",
    ):
        if candidate is not None and candidate.exists():
            return str(candidate)
    return shutil.which("py-spy")


def summary(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"samples": 0, "self": [], "ours": [], "packages": {}}
    prof = parse(path)
    return {
        "samples": prof.samples,
        "self": prof.top(15),
        "ours": prof.top_total_in(OURS, skip=ENTRY),
        "packages": prof.packages(),
    }


class Profiler:
    def __init__(self, procs: Processes, workdir: Path, py_spy: str) -> None:
        self.procs = procs
        self.workdir = workdir
        self.py_spy = py_spy

    def spy(
        self, key: str, pids: dict[str, int], duration: float
    ) -> tuple[list[Proc], dict[str, Path]]:
        """Start py-spy on each of ``pids`` (name -> pid) for ``duration`` seconds."""
        outs = {n: self.workdir / f"prof-{key}-{n}.txt" for n in pids}
        spies = [
            self.procs.start(f"py-spy-{key}-{n}", command(self.py_spy, pids[n], outs[n], duration))
            for n in pids
        ]
        return spies, outs

    def collect(self, spies: list[Proc], outs: dict[str, Path]) -> dict[str, Any]:
        """Wait for the py-spy processes of :meth:`spy`; each profile's summary by name."""
        for proc in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(30)
            self.procs.stop(proc)
        return {n: summary(p) for n, p in outs.items()}

    def sample(
        self,
        target: Target,
        upstream_pid: int,
        only: set[str],
        s: dict[str, Any],
        *,
        worker: bool,
    ) -> dict[str, Any]:
        """Profiles of ``target``'s server (and first worker) under the load of (a) and (c)."""
        pids = {"server": target.cpu_pids["server"][0]}
        if worker:
            pids["worker"] = target.cpu_pids["workers"][0]
        tag = re.sub(r"[^a-z0-9]+", "-", target.name.lower()).strip("-")
        out: dict[str, Any] = {}
        if "a" in only:
            spies, outs = self.spy(f"{tag}-a", pids, SECONDS)
            scenarios.run_wrk(target.url, 32, SECONDS + 2, self.workdir / "post.lua")
            out["a"] = self.collect(spies, outs)
        if "c" in only:
            k = 250 if 250 in s["c_ks"] else s["c_ks"][-1]
            spies, outs = self.spy(f"{tag}-c{k}", pids, s["c_tokens"] / s["token_rate"])
            scenarios.streaming(target, upstream_pid, k, s["c_tokens"], s["c_ramp"])
            out[f"c{k}"] = self.collect(spies, outs)
        return out
