"""The processes of the cluster scenario: a private Redis, a shared database, several
``manage.py serve`` processes behind nginx round-robin, real workers and the fake backend.

Nothing is shared with anyone else: the scenario's own ``redis-server`` listens on a
free port (it may be killed, flushed or stalled at will; the Redis on 6379 is never
touched), the database is a scratch PostgreSQL database created on 127.0.0.1:5432 and
dropped afterwards (a SQLite file in the scenario's directory when PostgreSQL is not
reachable), and nginx runs ``deploy/nginx.conf`` with every process in its upstream.
Workers dial the relay through nginx, as they would in production, so a stopped
process's workers come back through the others; each one's ``--backend-url`` ends with
``/w/<its name>``, which the fake backend uses to count every worker's requests in
progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import string
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.procs import Proc, Processes, free_port
from chaos.calls import MODEL
from chaos.client import fetch
from chaos.rig import (
    ADMIN,
    WORKER_SECRET,
    ChaosError,
    Incident,
    logged_incidents,
    project_python,
    server_env,
    until,
    wait_exit,
    wait_line,
    worker_env,
)

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
#: nginx takes a server that refused a connection out of its upstream for this long
#: (``fail_timeout``, 10 s by default, which deploy/nginx.conf keeps).
NGINX_FAIL_SECS = 10.0
#: Timings shrunk so that a stall past the TTL takes two seconds, not ten.
TICK_SECS = 0.2
TTL_SECS = 1.0
CLUSTER_ENV = {
    "CLUSTER_TICK_SECS": str(TICK_SECS),
    "CLUSTER_TTL_SECS": str(TTL_SECS),
    "SYNC_SECS": "0.2",
    "QUEUE_TIMEOUT_SECS": "10",
    "REQUEST_TIMEOUT_SECS": "15",
    "SHUTDOWN_GRACE_SECS": "3",
}


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def shared_database(workdir: Path) -> Iterator[str]:
    """A scratch PostgreSQL database (dropped afterwards), or a SQLite file."""
    if not _reachable("127.0.0.1", 5432):
        yield f"sqlite:///{workdir / 'shared.sqlite3'}"
        return
    import psycopg

    name = f"mrchaos_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ClusterRig:
    """The scenario's processes, the faults it stages on them, and what each one shows."""

    def __init__(
        self,
        procs: Processes,
        workdir: Path,
        database_url: str,
        *,
        server: str,
        processes: int,
        workers: int,
        max_concurrent: int,
    ) -> None:
        self.procs = procs
        self.workdir = workdir
        self.server_kind = server
        self.indexes = list(range(processes))
        self.worker_indexes = list(range(1, workers + 1))
        self.max_concurrent = max_concurrent
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.prefix = f"chaos-{secrets.token_hex(3)}"
        self.ports = {i: free_port() for i in self.indexes}
        self.front_port = free_port()
        self.upstream_port = free_port()
        shared = {
            **CLUSTER_ENV,
            "REDIS_URL": self.redis_url,
            "REDIS_PREFIX": self.prefix,
            "DATABASE_URL": database_url,
            "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        }
        self.env = {i: server_env(workdir / f"data-{self.letter(i)}", shared) for i in self.indexes}
        self.request_timeout = float(CLUSTER_ENV["REQUEST_TIMEOUT_SECS"])
        self.servers: dict[int, Proc] = {}
        self.workers: dict[int, Proc] = {}
        self.redis: Proc | None = None
        self.upstream: Proc | None = None
        self.nginx: Proc | None = None
        self.logs: list[Proc] = []
        #: The API key the scenario's own probes carry (when keys are required).
        self.api_key: str | None = None
        #: When each process last listened again after being stopped or killed.
        self.back_at: dict[int, float] = {}
        self._incarnations: dict[str, int] = {}

    @staticmethod
    def letter(index: int) -> str:
        return string.ascii_lowercase[index]

    def _name(self, base: str) -> str:
        n = self._incarnations.get(base, 0) + 1
        self._incarnations[base] = n
        return base if n == 1 else f"{base}.{n}"

    def worker_name(self, index: int) -> str:
        return f"chaos-w{index}"

    @property
    def capacity(self) -> int:
        return len(self.worker_indexes) * self.max_concurrent

    # -- processes ---------------------------------------------------------------

    async def start(self) -> None:
        await self.start_redis()
        upstream = [str(ROOT / "chaos" / "upstream.py"), "--port", str(self.upstream_port)]
        proc = self.procs.start("upstream", [project_python(), *upstream], cwd=ROOT)
        self.upstream = proc
        await wait_line(proc, r"upstream listening", 30)
        for i in self.indexes:  # one after the other: the first one migrates the database
            await self.start_process(i)
        await self.start_nginx()
        for index in self.worker_indexes:
            self.start_worker(index)
        await self.wait_converged(60)

    async def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ChaosError("redis-server is not installed")
        argv = [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.redis = self.procs.start(self._name("redis"), argv, cwd=self.workdir)
        await wait_line(self.redis, r"Ready to accept connections", 15)

    async def kill_redis(self) -> None:
        assert self.redis is not None
        os.kill(self.redis.pid, signal.SIGKILL)
        await wait_exit(self.redis, 10)

    async def start_process(self, index: int) -> None:
        argv = [project_python(), "manage.py", "serve", "--server", self.server_kind]
        argv += ["--listen", f"127.0.0.1:{self.ports[index]}"]
        (self.workdir / f"data-{self.letter(index)}").mkdir(parents=True, exist_ok=True)
        proc = self.procs.start(
            self._name(f"server-{self.letter(index)}"), argv, env=self.env[index], cwd=ROOT
        )
        self.servers[index] = proc
        self.logs.append(proc)
        await wait_line(proc, r"Listening on http://", 90)
        self.back_at[index] = time.monotonic()

    async def nginx_takes_all(self) -> None:
        """Until nginx may send traffic to every process again: one that refused a
        connection is out of its upstream for ``fail_timeout`` (a process stopped while
        every other one is still out leaves nginx nothing but 502 to answer)."""
        last = max(self.back_at.values(), default=0.0)
        await pause(max(0.0, last + NGINX_FAIL_SECS - time.monotonic()))

    async def stop_process(self, index: int, timeout: float = 20) -> int | None:
        """SIGTERM, as a deploy does; the exit code (None: it did not exit in time)."""
        proc = self.servers[index]
        os.kill(proc.pid, signal.SIGTERM)
        return await wait_exit(proc, timeout)

    async def kill_process(self, index: int) -> None:
        proc = self.servers[index]
        os.kill(proc.pid, signal.SIGKILL)
        await wait_exit(proc, 10)

    def signal_process(self, index: int, sig: signal.Signals) -> None:
        os.kill(self.servers[index].pid, sig)

    async def start_nginx(self) -> None:
        from tests.test_deploy_proxies import nginx_command, nginx_main_config, render_loopback

        binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
        if binary is None:
            raise ChaosError("nginx is not installed (bash scripts/install-deb.sh nginx)")
        workdir = self.workdir / "nginx"
        workdir.mkdir(parents=True, exist_ok=True)
        first = self.ports[self.indexes[0]]
        site = render_loopback(first, self.front_port)
        every = "\n".join(f"    server 127.0.0.1:{p};" for p in self.ports.values())
        site = site.replace(f"    server 127.0.0.1:{first};", every, 1)
        conf = nginx_main_config(workdir, site)
        text = conf.read_text().replace("worker_connections 256", "worker_connections 4096")
        conf.write_text(text)
        self.nginx = self.procs.start("nginx", nginx_command(binary, workdir, conf), cwd=workdir)

        async def listening() -> bool:
            return _reachable("127.0.0.1", self.front_port)

        await until("nginx to listen", listening, 15)

    def start_worker(self, index: int) -> Proc:
        name = self.worker_name(index)
        argv = [project_python(), "worker.py", "--proxy-url", f"http://127.0.0.1:{self.front_port}"]
        argv += ["--worker-secret", WORKER_SECRET, "--models", MODEL, "--worker-name", name]
        argv += ["--backend-url", f"http://127.0.0.1:{self.upstream_port}/w/{name}"]
        argv += ["--max-concurrent", str(self.max_concurrent), "--log-level", "info"]
        argv += ["--backoff-min-secs", "0.1", "--backoff-max-secs", "0.5"]
        argv += ["--fatal-retry-secs", "1"]
        proc = self.procs.start(self._name(name), argv, env=worker_env(), cwd=ROOT)
        self.workers[index] = proc
        self.logs.append(proc)
        return proc

    # -- what each process shows -------------------------------------------------

    async def get_json(self, port: int, path: str, *, admin: bool = False) -> Any:
        reply = await fetch(port, "GET", path, headers=ADMIN if admin else None, timeout=5)
        if not reply.answered or reply.status != 200:
            raise ChaosError(f"GET {path} on {port}: {reply.error or reply.status}")
        return json.loads(reply.body)

    async def states(self) -> dict[str, str]:
        """``cluster.state`` of every process (``down`` when it does not answer)."""
        found = {}
        for i in self.indexes:
            try:
                health = await self.get_json(self.ports[i], "/health")
                found[self.letter(i)] = str(health.get("cluster", {}).get("state"))
            except ChaosError:
                found[self.letter(i)] = "down"
        return found

    async def listings(self) -> dict[str, list[tuple[str, str]]]:
        """``(name, id)`` of the workers ``/admin/workers`` lists, by process."""
        found = {}
        for i in self.indexes:
            try:
                workers = await self.get_json(self.ports[i], "/admin/workers", admin=True)
                found[self.letter(i)] = sorted((w["name"], w["id"]) for w in workers)
            except ChaosError as exc:
                found[self.letter(i)] = [("unreachable", str(exc))]
        return found

    async def converged(self) -> bool:
        """Every process ``ok``, and every one lists exactly every worker (the same ids)."""
        if set((await self.states()).values()) != {"ok"}:
            return False
        listed = list((await self.listings()).values())
        names = sorted(self.worker_name(i) for i in self.worker_indexes)
        return all(ls == listed[0] for ls in listed) and [n for n, _ in listed[0]] == names

    async def wait_converged(self, timeout: float) -> float:
        started = time.monotonic()
        await until("every process ok and listing every worker", self.converged, timeout, 0.05)
        return time.monotonic() - started

    async def upstream_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self.get_json(self.upstream_port, "/chaos/stats")
        return stats

    async def hold(self) -> None:
        await self.get_json(self.upstream_port, "/chaos/hold")

    async def release(self) -> None:
        await self.get_json(self.upstream_port, "/chaos/release")

    # -- Redis ---------------------------------------------------------------------

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(
            host="127.0.0.1", port=self.redis_port, socket_timeout=10, decode_responses=True
        )

    async def redis_command(self, *args: Any) -> Any:
        async with self.client() as redis:
            return await redis.execute_command(*args)

    async def leases(self) -> dict[str, list[str]]:
        """Reservations Redis holds (``<process>|<request id>``), by worker key
        (``P:l:<worker>``)."""
        async with self.client() as redis:
            keys = [k async for k in redis.scan_iter(match=f"{self.prefix}:l:*")]
            found = {str(k): [str(m) for m in await redis.zrange(k, 0, -1)] for k in keys}
        return {k: members for k, members in found.items() if members}

    async def connections(self) -> list[dict[str, Any]]:
        async with self.client() as redis:
            found: list[dict[str, Any]] = await redis.client_list()
            return found

    def log_incidents(self) -> list[Incident]:
        return logged_incidents(self.logs)


async def pause(seconds: float) -> None:
    """A fault that lasts a given time (a stall, an outage): the one place the scenario
    waits on the clock, because the duration is what is being staged."""
    await asyncio.sleep(seconds)
