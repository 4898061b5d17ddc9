"""Processes the harness starts, and what /proc says about them.

Every process is started in its own process group with output to a log file in the
run's temporary directory; :class:`Processes` stops each group (SIGTERM, then SIGKILL)
when the run ends, however it ends. CPU time comes from ``/proc/<pid>/stat``
(utime + stime, all threads) and memory from ``/proc/<pid>/status`` (VmRSS).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until the log has a line matching ``pattern``; raises with the log tail."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                match = regex.search(self.log.read_text(errors="replace"))
                if match:
                    return match
            if not self.alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not print {pattern!r}:\n{self.tail()}")


class Processes:
    """Starts processes and guarantees they are stopped (use as a context manager)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        cpus: str | None = None,
    ) -> Proc:
        """Start ``argv`` in a new process group, optionally pinned to ``cpus`` (taskset)."""
        log = self.log_dir / f"{name}.log"
        if cpus is not None:
            argv = ["taskset", "-c", cpus, *argv]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                process_group=0,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 10.0) -> None:
        """SIGTERM the process group; SIGKILL it if anything is left after ``timeout``."""
        if proc in self.procs:
            self.procs.remove(proc)
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # Children (nginx's worker, uvicorn's) may outlive the leader: kill the group.
        deadline = time.monotonic() + 3
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(5)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader keeps the group "alive" until reaped; look for live members.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(entry.path, "stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def group_pids(pgid: int) -> list[int]:
    """Live members of process group ``pgid`` (e.g. nginx's master and worker)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all threads) in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class CpuMeter:
    """CPU seconds used by named pids between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}
        self.used: dict[str, float] = {}
        self.t0 = 0.0
        self.wall = 0.0

    def _sample(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.pids.items()}

    def start(self) -> CpuMeter:
        self.before = self._sample()
        self.t0 = time.monotonic()
        return self

    def stop(self) -> CpuMeter:
        after = self._sample()
        self.wall = time.monotonic() - self.t0
        self.used = {name: after[name] - self.before[name] for name in after}
        return self

    def share(self, name: str) -> float:
        """Fraction of one core ``name`` used over the window."""
        return self.used.get(name, 0.0) / self.wall if self.wall else 0.0


def machine_busy() -> float:
    """CPU seconds all cores spent in user, nice, system and steal time since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, steal = int(fields[0]), int(fields[1]), int(fields[2]), int(fields[7])
    return (user + nice + system + steal) / TICK


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
