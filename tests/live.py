"""A real ModelRelay server process (``manage.py serve``) on 127.0.0.1 for tests.

Each server gets its own data directory and SQLite database (or the given
``DATABASE_URL``) and a known worker secret. Timings are shrunk through env, never
by sleeping. The process is always stopped by the fixture that started it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The ASGI server live tests run under (``make test`` runs the live tests under both).
SERVER = os.environ.get("RELAY_TEST_SERVER", "daphne")
WORKER_SECRET = "mrw_test-secret-0123456789"
# (In a LOG_FORMAT=json banner the URL ends at the closing quote.)
_LISTEN_RE = re.compile(r'Listening on (http://[^\s"]+)')


@dataclass
class LiveServer:
    data_dir: Path
    env: dict[str, str]
    url: str = ""
    process: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None
    port: int = 0

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/v1/worker/connect"

    @property
    def secret(self) -> str:
        return self.env["WORKER_SECRET"]

    @property
    def provider(self) -> str:
        return self.env.get("PROVIDER_NAME", "local")

    def start(self, timeout: float = 60.0) -> None:
        listen = f"127.0.0.1:{self.port}"
        if self._reader is not None:
            # The previous process's reader ends by setting _ready; let it finish first
            # so it cannot wake this start() before the new server listens.
            self._reader.join(timeout=10)
        self._ready.clear()
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--listen", listen, "--server", SERVER],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._pump, args=(self.process,), daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log())
        if not self.url or self.process.poll() is not None:
            self.stop()
            raise RuntimeError("server exited:\n" + self.log())

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.url = ""
        for line in process.stdout:
            self.output.append(line)
            match = _LISTEN_RE.search(line)
            if match:
                self.url = match.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()

    def log(self) -> str:
        return "".join(self.output)

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> str:
        """Block until a line containing ``needle`` was printed (returns that line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.output):
                if needle in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not seen in server log:\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        return process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def restart(self) -> None:
        """Stop and start again on the same port (workers reconnect to it)."""
        self.stop()
        self.start()


def server_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELRELAY_")}
    env.update(
        {
            "DATA_DIR": str(data_dir),
            "DATABASE_URL": f"sqlite:///{data_dir / 'db.sqlite3'}",
            "WORKER_SECRET": WORKER_SECRET,
            "PROVIDER_NAME": "local",
            "LOG_LEVEL": "info",
            "PYTHONUNBUFFERED": "1",
            "SHUTDOWN_GRACE_SECS": "5",
        }
    )
    env.pop("REDIS_URL", None)
    env.update(overrides)
    return env


POSTGRES_PASS = os.environ.get("RELAY_TEST_DATABASE") == "postgres"
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def _scratch_postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database for one live server, dropped afterwards."""
    import psycopg

    name = f"mrlive_{uuid.uuid4().hex[:12]}"
    base = POSTGRES_URL.rsplit("/", 1)[0]
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def live_server(data_dir: Path, **overrides: str) -> Iterator[LiveServer]:
    """A started server; on the PostgreSQL pass each gets its own scratch database."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if POSTGRES_PASS and "DATABASE_URL" not in overrides:
            overrides["DATABASE_URL"] = stack.enter_context(_scratch_postgres_database())
        server = LiveServer(data_dir=data_dir, env=server_env(data_dir, **overrides))
        server.start()
        try:
            yield server
        finally:
            server.stop()
