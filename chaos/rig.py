"""The processes of one scenario: the fake backend, a ModelRelay server, real workers.

Everything listens on 127.0.0.1 on ports chosen up front, so a restarted server or
backend comes back where the workers expect it. Each process runs in its own process
group with its output in the scenario's log directory (:mod:`bench.procs`); the
harness sends the faults itself (``SIGKILL``, ``SIGSTOP``/``SIGCONT``, ``SIGTERM``)
and :class:`bench.procs.Processes` stops whatever is left when the scenario ends.

Waiting is always on a condition polled with a bound (:func:`until`), never a bare
sleep standing in for "long enough".
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import Proc, Processes, free_port, rss_bytes
from chaos.calls import MODEL
from chaos.client import fetch

ROOT = Path(__file__).resolve().parent.parent
WORKER_SECRET = "mrw_chaos-secret-0123456789abcdef"
ADMIN_TOKEN = "chaos-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
#: Lines in a server or worker log that mean an unhandled error.
_BAD_LINE = re.compile(r"Traceback|Exception inside application|\d ERROR |\d CRITICAL ")
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
#: The timestamp and level that start a logged line (server and worker formats).
_LOGGED = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ +[A-Z]+ +")


def project_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


class ChaosError(Exception):
    """The rig could not stage a fault (a process did not start, a condition never held)."""


async def until(
    what: str, predicate: Callable[[], Awaitable[bool]], timeout: float, step: float = 0.05
) -> None:
    """Poll ``predicate`` until it holds; :class:`ChaosError` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():
            return
        if time.monotonic() >= deadline:
            raise ChaosError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(step)


def server_env(data_dir: Path, overrides: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODELRELAY_", "DJANGO_"))
        and k not in ("REDIS_URL", "DATABASE_URL", "ASGI_SERVER", "LISTEN_ADDR")
    }
    env.update(
        {
            "DATA_DIR": str(data_dir),
            "DATABASE_URL": f"sqlite:///{data_dir / 'db.sqlite3'}",
            "WORKER_SECRET": WORKER_SECRET,
            "PROVIDER_NAME": "local",
            "MODELRELAY_ADMIN_TOKEN": ADMIN_TOKEN,
            "LOG_LEVEL": "info",
            "PYTHONUNBUFFERED": "1",
            "MAX_QUEUE_LEN": "5000",
            "QUEUE_TIMEOUT_SECS": "10",
            "REQUEST_TIMEOUT_SECS": "15",
            "HEARTBEAT_INTERVAL_SECS": "1",
            "HEARTBEAT_TIMEOUT_SECS": "3",
            "SHUTDOWN_GRACE_SECS": "3",
        }
    )
    env.update(overrides)
    return env


class Rig:
    """One scenario's processes and the server's view of them."""

    def __init__(
        self,
        procs: Processes,
        workdir: Path,
        *,
        server: str,
        env: dict[str, str],
        worker_concurrency: int,
        worker_args: tuple[str, ...] = (),
    ) -> None:
        self.procs = procs
        self.workdir = workdir
        self.server_kind = server
        self.env = server_env(workdir / "data", env)
        self.request_timeout = float(self.env["REQUEST_TIMEOUT_SECS"])
        self.heartbeat = float(self.env["HEARTBEAT_INTERVAL_SECS"])
        self.worker_concurrency = worker_concurrency
        self.worker_args = worker_args
        self.port = free_port()
        self.upstream_port = free_port()
        self.server: Proc | None = None
        self.upstream: Proc | None = None
        self.workers: dict[int, Proc] = {}
        self.logs: list[Proc] = []
        self._incarnations: dict[str, int] = {}

    def _name(self, base: str) -> str:
        n = self._incarnations.get(base, 0) + 1
        self._incarnations[base] = n
        return base if n == 1 else f"{base}.{n}"

    # -- processes ---------------------------------------------------------------

    async def start_upstream(self) -> None:
        proc = self.procs.start(
            self._name("upstream"),
            [
                project_python(),
                str(ROOT / "chaos" / "upstream.py"),
                "--port",
                str(self.upstream_port),
            ],
            cwd=ROOT,
        )
        self.upstream = proc
        await wait_line(proc, r"upstream listening", 30)

    def kill_upstream(self) -> None:
        """The backend crashes: SIGKILL, its connections reset, its port refuses."""
        assert self.upstream is not None
        os.kill(self.upstream.pid, signal.SIGKILL)
        self.upstream.popen.wait(10)

    async def start_server(self) -> None:
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        proc = self.procs.start(
            self._name("server"),
            [
                project_python(),
                "manage.py",
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--server",
                self.server_kind,
            ],
            env=self.env,
            cwd=ROOT,
        )
        self.server = proc
        self.logs.append(proc)
        await wait_line(proc, r"Listening on http://", 90)

    async def stop_server(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM the server; wait for it to exit. Returns (exit code, seconds taken)."""
        assert self.server is not None
        started = time.monotonic()
        os.kill(self.server.pid, signal.SIGTERM)
        code = await wait_exit(self.server, timeout)
        return code, time.monotonic() - started

    def server_alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def server_rss(self) -> int:
        assert self.server is not None
        return rss_bytes(self.server.pid)

    def worker_name(self, index: int) -> str:
        return f"chaos-w{index}"

    def start_worker(self, index: int) -> Proc:
        proc = self.procs.start(
            self._name(self.worker_name(index)),
            [
                project_python(),
                "worker.py",
                "--proxy-url",
                f"http://127.0.0.1:{self.port}",
                "--worker-secret",
                WORKER_SECRET,
                "--backend-url",
                f"http://127.0.0.1:{self.upstream_port}",
                "--models",
                MODEL,
                "--max-concurrent",
                str(self.worker_concurrency),
                "--worker-name",
                self.worker_name(index),
                "--log-level",
                "info",
                "--backoff-min-secs",
                "0.1",
                "--backoff-max-secs",
                "0.5",
                "--fatal-retry-secs",
                "1",
                # A backend that comes back is found within a second (not up to ten).
                "--backend-probe-max-secs",
                "1",
                *self.worker_args,
            ],
            env=worker_env(),
            cwd=ROOT,
        )
        self.workers[index] = proc
        self.logs.append(proc)
        return proc

    def signal_worker(self, index: int, sig: signal.Signals) -> None:
        os.kill(self.workers[index].pid, sig)

    async def kill_worker(self, index: int) -> None:
        """SIGKILL: the worker's sockets reset at once, nothing is said to anyone."""
        proc = self.workers[index]
        os.kill(proc.pid, signal.SIGKILL)
        await wait_exit(proc, 10)

    async def start(self, workers: int) -> None:
        await self.start_upstream()
        await self.start_server()
        for index in range(1, workers + 1):
            self.start_worker(index)
        await self.wait_workers(range(1, workers + 1))

    # -- the server's view -------------------------------------------------------

    async def get_json(self, path: str, *, admin: bool = False, port: int | None = None) -> Any:
        reply = await fetch(port or self.port, "GET", path, headers=ADMIN if admin else None)
        if not reply.answered:
            raise ChaosError(f"GET {path}: {reply.error or 'no answer'}")
        return json.loads(reply.body)

    async def health(self) -> dict[str, Any]:
        document: dict[str, Any] = await self.get_json("/health")
        return document

    async def admin_workers(self) -> list[dict[str, Any]]:
        document: list[dict[str, Any]] = await self.get_json("/admin/workers", admin=True)
        return document

    async def stats(self) -> dict[str, Any]:
        document: dict[str, Any] = await self.get_json("/admin/stats", admin=True)
        return document

    async def upstream_stats(self) -> dict[str, Any]:
        document: dict[str, Any] = await self.get_json("/chaos/stats", port=self.upstream_port)
        return document

    async def release(self) -> None:
        """Let every held backend request (and every later one) answer."""
        await self.get_json("/chaos/release", port=self.upstream_port)

    async def hold(self) -> None:
        """Hold requests that ask for it again, until the next :meth:`release`."""
        await self.get_json("/chaos/hold", port=self.upstream_port)

    async def worker_named(self, index: int) -> dict[str, Any] | None:
        for worker in await self.admin_workers():
            if worker["name"] == self.worker_name(index):
                return worker
        return None

    async def wait_workers(self, indexes: Any, timeout: float = 30.0) -> None:
        """Until exactly the workers ``indexes`` are registered (each once)."""
        wanted = sorted(self.worker_name(i) for i in indexes)

        async def registered() -> bool:
            try:
                names = sorted(w["name"] for w in await self.admin_workers())
            except ChaosError:
                return False
            return names == wanted

        await until(f"workers {', '.join(wanted) or '(none)'} registered", registered, timeout)

    async def wait_gone(self, index: int, timeout: float) -> None:
        async def gone() -> bool:
            return await self.worker_named(index) is None

        await until(f"{self.worker_name(index)} gone from the server", gone, timeout)

    async def wait_active(
        self, count: int, *, seen: int | None = None, timeout: float = 20.0
    ) -> None:
        """Until the backend has exactly ``count`` requests in progress (and, when given,
        has received ``seen`` requests in all: a count on the way down is not mistaken
        for one on the way up)."""

        async def active() -> bool:
            stats = await self.upstream_stats()
            return int(stats["active"]) == count and (seen is None or stats["requests"] == seen)

        what = f"{count} requests in progress at the backend"
        await until(what if seen is None else f"{what}, {seen} received", active, timeout)

    def log_incidents(self) -> list[Incident]:
        """Unhandled errors in every server and worker log of this scenario."""
        return logged_incidents(self.logs)


@dataclass
class Incident:
    process: str
    #: The logged message (no timestamp) and the exception's last line, numbers
    #: blanked: ``relay.http: unexpected error serving POST /v1/x / RuntimeError: …``.
    signature: str
    excerpt: str


def logged_incidents(procs: list[Proc]) -> list[Incident]:
    """Unhandled errors in the logs of ``procs``."""
    found = []
    for proc in procs:
        try:
            lines = proc.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found.extend(incidents(proc.name, lines))
    return found


def incidents(process: str, lines: list[str]) -> list[Incident]:
    """ERROR/CRITICAL lines and tracebacks, one incident per logged error with its traceback."""
    found: list[Incident] = []
    number = 0
    while number < len(lines):
        line = lines[number]
        if not _BAD_LINE.search(line):
            number += 1
            continue
        message = _ADDRESS.sub("0xN", _LOGGED.sub("", line).strip())
        end = number + 1
        if "Traceback" in line or (end < len(lines) and lines[end].startswith("Traceback")):
            while end < len(lines) and (
                lines[end].startswith((" ", "Traceback")) or not _LOGGED.match(lines[end])
            ):
                end += 1
            last = _NUMBERS.sub("N", lines[end - 1].strip())
            message = f"{message} / {last}" if message != last else last
        excerpt = " | ".join(lines[number : min(end, number + 3)] + lines[end - 1 : end])
        found.append(Incident(process, message, excerpt[:500]))
        number = end
    return found


def worker_env() -> dict[str, str]:
    names = ("PROXY_URL", "WORKER_", "PROVIDER_NAME", "BACKEND_", "MODELS", "MAX_")
    return {k: v for k, v in os.environ.items() if not k.startswith(names)} | {
        "PYTHONUNBUFFERED": "1"
    }


async def wait_line(proc: Proc, pattern: str, timeout: float) -> None:
    regex = re.compile(pattern)

    async def printed() -> bool:
        if not proc.alive():
            raise ChaosError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            return regex.search(proc.log.read_text(errors="replace")) is not None
        except OSError:
            return False

    try:
        await until(f"{proc.name} to print {pattern!r}", printed, timeout)
    except ChaosError as exc:
        raise ChaosError(f"{exc}\n{proc.tail()}") from None


async def wait_exit(proc: Proc, timeout: float) -> int | None:
    """The exit code once ``proc`` exited (reaped), or None if it outlived ``timeout``."""

    async def exited() -> bool:
        return proc.popen.poll() is not None

    try:
        await until(f"{proc.name} to exit", exited, timeout)
    except ChaosError:
        return None
    return proc.popen.returncode
