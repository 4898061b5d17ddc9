"""What a run ran on: the machine, its background load, and the versions measured."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import time
from pathlib import Path

from bench import peers, scenarios, targets

ROOT = Path(__file__).resolve().parent.parent


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


def _distribution_versions(python: str, names: tuple[str, ...]) -> dict[str, str]:
    code = (
        "import importlib.metadata as m\n"
        f"for n in {names!r}:\n"
        "    try: print(n, m.version(n))\n"
        "    except m.PackageNotFoundError: print(n, '?')\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    found = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    return {n: found.get(n, "?") for n in names}


def versions(bench_python: Path | None) -> dict[str, str]:
    text = (ROOT / "relay" / "__init__.py").read_text()
    match = re.search(r'__version__ = "([^"]+)"', text)
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "relay", "worker.py", "modelrelay_site", "workers_app")
        else ""
    )
    litellm = "not run"
    if bench_python is not None:
        litellm = _distribution_versions(str(bench_python), ("litellm",))["litellm"]
    servers = _distribution_versions(
        targets.project_python(), ("daphne", "uvicorn", "uvloop", "httptools")
    )
    wrk = subprocess.run([scenarios.WRK, "-v"], capture_output=True, text=True).stdout
    return {
        "ModelRelay": f"{match.group(1) if match else '?'} @ {commit or '?'}{dirty}",
        **servers,
        "LiteLLM": litellm,
        "nginx": peers.nginx_version(),
        "wrk": wrk.split()[1] if wrk.split() else "?",
    }
