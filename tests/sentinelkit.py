"""A replicated Redis of the test's own, watched by Sentinel (SPEC §20): one master, one
replica and three sentinels on 127.0.0.1, which the test may fail over, kill, stop or
restart at will (``redis-server --sentinel``; Valkey's ``valkey-server`` the same way).

Timings are shrunk through the sentinels' configuration (a master unanswered for
:data:`DOWN_AFTER_MS` is down, a failover may take :data:`FAILOVER_TIMEOUT_MS`); waits
poll a predicate with a bound, never the clock. Ports are free ones, or taken from
``RELAY_TEST_REDIS_PORTS`` (``first-last``) when the machine reserves a range for them:
then each port is claimed with a lock file for as long as the test process lives, so
that the processes of one run (pytest-xdist) never pick the same one.
The chaos scenario (``chaos/cluster.py``) uses the same set.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

MASTER = "relaytest"
#: A master that does not answer for this long is down (the sentinels' default: 30 s).
DOWN_AFTER_MS = 1000
#: How long a failover may take before the sentinels try again (default: 3 minutes).
FAILOVER_TIMEOUT_MS = 3000
#: The longest a failover takes here, from the master going away to the new one
#: accepting writes (the down-after, the election, the promotion; generous for a busy
#: machine).
FAILOVER_SECS = 20.0

_ports_taken: set[int] = set()
#: The lock files of the ports this process claimed from the range (held until it exits).
_claims: list[int] = []


def _port_range() -> Iterator[int] | None:
    spec = os.environ.get("RELAY_TEST_REDIS_PORTS", "")
    if not spec:
        return None
    first, _, last = spec.partition("-")
    return iter(range(int(first), int(last or first) + 1))


def free_ports(count: int) -> list[int]:
    """``count`` ports nobody listens on (from ``RELAY_TEST_REDIS_PORTS`` when set)."""
    found: list[int] = []
    candidates = _port_range()
    while len(found) < count:
        if candidates is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        else:
            port = next(candidates, 0)
            if not port:
                raise RuntimeError("RELAY_TEST_REDIS_PORTS has too few free ports")
        if port in _ports_taken or port in found or _listening(port):
            continue
        if candidates is not None and not _claim(port):
            continue  # another test process has it
        found.append(port)
    _ports_taken.update(found)
    return found


def _claim(port: int) -> bool:
    """Whether this process now holds ``port`` (no other process of the machine does)."""
    path = os.path.join(tempfile.gettempdir(), f"modelrelay-test-port-{port}.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims.append(fd)
    return True


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def server_binary(flavor: str = "redis") -> str | None:
    """``redis-server``, or ``valkey-server`` (``RELAY_TEST_VALKEY_SERVER`` may name it)."""
    if flavor == "valkey":
        return os.environ.get("RELAY_TEST_VALKEY_SERVER") or shutil.which("valkey-server")
    return shutil.which("redis-server")


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (redis.RedisError, OSError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class SentinelSet:
    """The master, the replica and the sentinels; ``data`` holds the two data nodes by
    port (which one is master changes with each failover)."""

    binary: str
    workdir: Path
    data_ports: list[int]
    sentinel_ports: list[int]
    name: str = MASTER
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    # -- what tests hand the relay -------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The settings that point a relay process at this set."""
        return {
            "REDIS_URL": "",
            "REDIS_SENTINELS": ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports),
            "REDIS_SENTINEL_MASTER": self.name,
        }

    # -- processes ---------------------------------------------------------------------

    def _data_argv(self, port: int, replica_of: int | None) -> list[str]:
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.workdir)]
        # What docs/CLUSTER.md recommends: a master without a replica refuses writes
        # (a failover would lose them).
        argv += ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"]
        argv += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        return argv

    def _sentinel_conf(self, port: int, master: int) -> Path:
        path = self.workdir / f"sentinel-{port}.conf"
        path.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {master} 2\n"
            f"sentinel down-after-milliseconds {self.name} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {self.name} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {self.name} 1\n"
        )
        return path

    def _spawn(self, port: int, argv: list[str]) -> None:
        log = open(self.workdir / f"{port}.log", "ab")  # noqa: SIM115 (the process's own)
        self.processes[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def start(self) -> None:
        master, replica = self.data_ports
        self._spawn(master, self._data_argv(master, None))
        self._spawn(replica, self._data_argv(replica, master))
        for port in self.sentinel_ports:
            self._spawn(port, [self.binary, str(self._sentinel_conf(port, master)), "--sentinel"])
        self.wait_healthy()

    def start_data(self, port: int) -> None:
        """Start a data node again (after a kill): it comes back as it was configured,
        and the sentinels make it a replica of the current master."""
        other = next(p for p in self.data_ports if p != port)
        self._spawn(port, self._data_argv(port, other))

    def kill(self, port: int) -> None:
        process = self.processes.pop(port)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def signal(self, port: int, sig: int) -> None:
        self.processes[port].send_signal(sig)

    def stop(self) -> None:
        for process in self.processes.values():
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGKILL)
        for process in self.processes.values():
            process.wait(10)
        self.processes.clear()

    # -- what the set says -------------------------------------------------------------

    def client(self, port: int, **options: Any) -> redis.Redis:
        return redis.Redis(
            port=port,
            socket_timeout=2,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
            **options,
        )

    def master(self) -> int:
        """The port the first answering sentinel names as master."""
        for port in self.sentinel_ports:
            try:
                with self.client(port) as sentinel:
                    _, master = sentinel.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name
                    )
                    return int(master)
            except (redis.RedisError, OSError):
                continue
        raise AssertionError("no sentinel answers")

    def replica(self) -> int:
        return next(p for p in self.data_ports if p != self.master())

    def writable(self, port: int) -> bool:
        """``port`` is a master with its replica attached: it takes writes."""
        with self.client(port) as node:
            return bool(node.set(f"{self.name}:probe", "1", px=1000))

    def wait_healthy(self, timeout: float = FAILOVER_SECS) -> int:
        """Until every sentinel names the same master, that master takes writes and the
        other data node replicates it; returns the master's port."""

        def healthy() -> int | None:
            masters = set()
            for port in self.sentinel_ports:
                if port not in self.processes:
                    continue
                with self.client(port) as sentinel:
                    _, master = sentinel.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name
                    )
                    masters.add(int(master))
                    if len(sentinel.execute_command("SENTINEL", "SENTINELS", self.name)) < 2:
                        return None  # the sentinels have not all found each other yet
            if len(masters) != 1:
                return None
            master = masters.pop()
            with self.client(master) as node:
                info = node.info("replication")
            if info.get("role") != "master" or info.get("connected_slaves", 0) < 1:
                return None
            # Every sentinel sees the other data node as a sound replica: a fault staged
            # before they have settled would meet a half-made configuration.
            for port in self.sentinel_ports:
                if port not in self.processes:
                    continue
                with self.client(port) as sentinel:
                    replicas = sentinel.execute_command("SENTINEL", "REPLICAS", self.name)
                sound = [
                    r
                    for r in replicas
                    if r.get("flags") == "slave"
                    and r.get("master-link-status") == "ok"
                    and r.get("master-port") == str(master)
                ]
                if not sound:
                    return None
            return master if self.writable(master) else None

        return int(wait_for(healthy, timeout, "the sentinel set to be healthy"))

    def failover(self, *, hurry: bool = True) -> int:
        """``SENTINEL FAILOVER``: the replica becomes master, the master its replica.
        Returns the new master's port once it takes writes.

        The sentinels turn the old master into a replica at their next look at it (every
        10 s), and until then the new master has no replica, so it refuses writes
        (``min-replicas-to-write 1``). ``hurry``: the kit does it at once, so that tests
        need not wait 10 s (``make chaos`` waits, as production does)."""
        old = self.master()
        with self.client(self.sentinel_ports[0]) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", self.name)
        new = wait_for(lambda: (m := self.master()) != old and m, FAILOVER_SECS, "another master")
        if hurry:
            with self.client(old) as node:
                node.execute_command("REPLICAOF", "127.0.0.1", str(new))
            return self.wait_healthy()
        return self.wait_healthy(FAILOVER_SECS + 30)  # (the sentinels' 10 s look, and more)

    def kill_master(self) -> int:
        """``kill -9`` of the master, then (once the sentinels promoted the replica) the
        old master started again, as its service manager would, to be the new replica."""
        old = self.master()
        self.kill(old)
        wait_for(lambda: self.master() != old, FAILOVER_SECS, "the sentinels to promote")
        self.start_data(old)
        return self.wait_healthy()


@contextmanager
def sentinel_set(workdir: Path, flavor: str = "redis") -> Iterator[SentinelSet]:
    """A started set (skipped when the server binary is missing); stopped afterwards."""
    import pytest

    binary = server_binary(flavor)
    if binary is None:
        pytest.skip(f"{flavor}-server is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(5)
    found = SentinelSet(binary, workdir, ports[:2], ports[2:])
    try:
        found.start()
        yield found
    finally:
        found.stop()


def names_on(port: int) -> set[str]:
    """The roles of the relay connections on a Redis node (``modelrelay:<id>:<role>``)."""
    with redis.Redis(port=port, socket_timeout=2, decode_responses=True) as node:
        return {
            str(c["name"]).rsplit(":", 1)[1]
            for c in node.client_list()
            if str(c.get("name", "")).startswith("modelrelay:")
        }


__all__ = [
    "DOWN_AFTER_MS",
    "FAILOVER_SECS",
    "MASTER",
    "SentinelSet",
    "free_ports",
    "names_on",
    "sentinel_set",
    "wait_for",
]
