"""The cluster scenario: several server processes on one Redis, under the faults of docs/CLUSTER.md.

Two (``quick``) or three (``full``) ``manage.py serve`` processes share a private
``redis-server``, a scratch database and a pepper, behind nginx round-robin; real
``worker.py`` processes connect through nginx (the fake backend counts each worker's
requests in progress). Clients send a steady mixed load through nginx (streaming and
not, both APIs) while each fault is staged, in turn:

- **redis-restart**: Redis killed and started again, empty;
- **flushall**: ``FLUSHALL``;
- **client-kill-<kind>**: ``CLIENT KILL`` of every connection of one kind — ``place``
  (the lean client of the request path), ``cluster`` (redis-py's control connection),
  ``pubsub``, ``control`` (control messages), ``layer`` (the channel layer's);
- **busy-script**: a script of the operator's own runs for twice the tick, so every
  script the processes send meanwhile gets ``-BUSY`` (``busy-reply-threshold`` lowered);
- **oom**: ``maxmemory`` set below what Redis uses, so every write gets ``-OOM``, for
  twice the tick;
- **sigstop**: a process stopped for twice ``CLUSTER_TTL_SECS``, then continued;
- **sigkill**: a process killed, then started again;
- **rolling-restart**: every process in turn SIGTERMed and started again, under load.

After each, within :data:`RECOVERY_SECS`: every process says ``ok`` and
``/admin/workers`` lists exactly every worker, the same on every process; every process
routes to every worker (as many held requests as the cluster has slots, sent to one
process, fill every worker's slots); an idle cluster holds no lease in Redis; no worker
ever had more than ``max_concurrent`` requests at the backend; every client got an
answer it may get, within its deadline (for the rolling restart: every request
succeeded).
"""

from __future__ import annotations

import asyncio
import itertools
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
from chaos.cluster_rig import TICK_SECS, TTL_SECS, ClusterRig, pause, shared_database
from chaos.outcome import SLACK, Outcome
from chaos.rig import ChaosError, until

#: How long every process may take to converge after a fault is over.
RECOVERY_SECS = 10.0
OK = frozenset({"ok"})
#: A process killed under load: a stream it was relaying to its own client is cut
#: (the connection is gone: nginx cannot finish it), one it was serving for another
#: process's client ends with the error event; everything else must succeed.
KILLED = OK | {
    "no-answer:stream cut after * tokens (eof)",
    "no-answer:eof",
    "no-answer:reset",
    "stream-error:worker_lost",
}


@dataclass(frozen=True)
class ClusterProfile:
    processes: int
    workers: int
    max_concurrent: int
    clients: int
    #: Seconds of load after each fault's own action.
    load_secs: float
    rolling_rounds: int = 1


PROFILES = {
    "full": ClusterProfile(processes=3, workers=4, max_concurrent=2, clients=24, load_secs=3),
    "quick": ClusterProfile(processes=2, workers=3, max_concurrent=2, clients=12, load_secs=1.5),
    "test": ClusterProfile(processes=2, workers=2, max_concurrent=2, clients=8, load_secs=1),
}


@dataclass
class Load:
    """Client loops sending mixed requests through nginx until stopped."""

    rig: ClusterRig
    out: Outcome
    clients: int
    fault: str
    rng: random.Random
    expect: frozenset[str] = OK
    calls: list[Call] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        numbers = itertools.count()

        async def client() -> None:
            while not self._stop.is_set():
                stream = self.rng.random() < 0.5
                call = Call(
                    f"{self.fault}-{next(numbers)}",
                    "anthropic" if self.rng.random() < 0.25 else "openai",
                    stream=stream,
                    tokens=self.rng.randint(3, 10),
                    gap=0.01 if stream else 0.0,
                    delay=0.0 if stream else self.rng.uniform(0, 0.05),
                    group=self.fault,
                    expect=self.expect,
                )
                call.start(self.rig.front_port, self.rig.request_timeout + SLACK)
                self.calls.append(call)
                await call.finish()

        self._tasks = [asyncio.ensure_future(client()) for _ in range(self.clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self.out.calls.extend(self.calls)


Act = Callable[[ClusterRig], Awaitable[None]]


async def redis_restart(rig: ClusterRig) -> None:
    await rig.kill_redis()
    await rig.start_redis()


async def flushall(rig: ClusterRig) -> None:
    await rig.redis_command("FLUSHALL")


def client_kill(kind: str) -> Act:
    """``CLIENT KILL`` every connection of one kind, told apart by the name each process
    gives its connections (``modelrelay:<instance>:<role>``) and the pub/sub flag."""

    async def act(rig: ClusterRig) -> None:
        victims = [c for c in await rig.connections() if _kind(c) == kind]
        if not victims:
            raise ChaosError(f"no {kind} connection to kill: {await rig.connections()}")
        for conn in victims:
            await rig.redis_command("CLIENT", "KILL", "ID", conn["id"])

    return act


def _kind(conn: dict[str, str]) -> str:
    name = conn.get("name", "")
    if "P" in conn.get("flags", "") or conn.get("sub", "0") != "0":
        return "pubsub"
    if name.startswith("modelrelay:"):
        return name.rsplit(":", 1)[1]
    if conn.get("cmd") in ("client|list", "client", "client|kill"):
        return "harness"
    return "layer"


async def busy_script(rig: ClusterRig) -> None:
    await rig.redis_command("CONFIG", "SET", "busy-reply-threshold", "50")
    spin = """
    local t = redis.call('TIME')
    local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
    repeat t = redis.call('TIME') until tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop
    return 1
    """
    try:
        await rig.redis_command("EVAL", spin, 0, int(2 * TICK_SECS * 1_000_000))
    finally:
        await rig.redis_command("CONFIG", "SET", "busy-reply-threshold", "5000")


async def oom(rig: ClusterRig) -> None:
    await rig.redis_command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    await rig.redis_command("CONFIG", "SET", "maxmemory", "1")
    try:
        await pause(2 * TICK_SECS)
    finally:
        await rig.redis_command("CONFIG", "SET", "maxmemory", "0")


async def sigstop(rig: ClusterRig) -> None:
    victim = rig.indexes[0]
    rig.signal_process(victim, signal.SIGSTOP)
    try:
        await pause(2 * TTL_SECS)
    finally:
        rig.signal_process(victim, signal.SIGCONT)


async def sigkill(rig: ClusterRig) -> None:
    victim = rig.indexes[-1]
    await rig.kill_process(victim)
    await pause(TTL_SECS)  # its keys lapse before it comes back
    await rig.start_process(victim)


@dataclass(frozen=True)
class Fault:
    name: str
    act: Act
    expect: frozenset[str] = OK


FAULTS = [
    Fault("redis-restart", redis_restart),
    Fault("flushall", flushall),
    *(Fault(f"client-kill-{k}", client_kill(k)) for k in ("place", "cluster", "pubsub")),
    *(Fault(f"client-kill-{k}", client_kill(k)) for k in ("control", "layer")),
    Fault("busy-script", busy_script),
    Fault("oom", oom),
    Fault("sigstop", sigstop),
    Fault("sigkill", sigkill, KILLED),
]


async def cluster_scenario(out: Outcome, profile_name: str, workdir: Path, server: str) -> None:
    """The whole scenario on a fresh cluster; every process is stopped afterwards."""
    profile = PROFILES[profile_name]
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    with shared_database(workdir) as database, Processes(workdir) as procs:
        rig = ClusterRig(
            procs,
            workdir,
            database,
            server=server,
            processes=profile.processes,
            workers=profile.workers,
            max_concurrent=profile.max_concurrent,
        )
        out.figures["database"] = database.split(":", 1)[0]
        await rig.start()
        rng = random.Random(1)
        recovery: dict[str, float] = {}
        for fault in FAULTS:
            load = Load(rig, out, profile.clients, fault.name, rng, fault.expect)
            load.start()
            await pause(0.3)  # the fault meets requests in flight
            await fault.act(rig)
            await pause(profile.load_secs)
            await load.stop()
            recovery[fault.name] = await after(rig, out, fault.name, load.calls)
        await rolling_restart(rig, out, profile, rng)
        out.figures["recovery (s)"] = ", ".join(f"{k} {v:.1f}" for k, v in recovery.items())
        # A process says at ERROR level that it went degraded (what an operator must
        # see): expected here, where Redis fails on purpose. Anything else counts.
        logged = rig.log_incidents()
        found = [i for i in logged if "cluster degraded (" not in i.signature]
        out.figures["degraded notices logged"] = len(logged) - len(found)
        kinds = Counter(i.signature for i in found)
        out.check(
            "logs clean",
            not found,
            "no traceback or ERROR line"
            if not found
            else f"{len(found)} errors logged: "
            + "; ".join(f"{n}x {sig}" for sig, n in kinds.most_common(4)),
            {"signatures": dict(kinds)},
        )


async def after(rig: ClusterRig, out: Outcome, fault: str, calls: list[Call]) -> float:
    """The checks that follow every fault; returns the seconds convergence took."""
    started = time.monotonic()
    try:
        took = await rig.wait_converged(RECOVERY_SECS)
        out.check(f"{fault}: converged", True, f"in {took:.1f}s")
    except ChaosError:
        took = time.monotonic() - started
        out.check(
            f"{fault}: converged",
            False,
            f"after {RECOVERY_SECS:g}s: states {await rig.states()}, "
            f"workers {await rig.listings()}",
        )
    await _routes_everywhere(rig, out, fault)
    await _no_leases(rig, out, fault)
    await _capacity(rig, out, fault)
    _answers(rig, out, fault, calls)
    return took


async def _routes_everywhere(rig: ClusterRig, out: Outcome, fault: str) -> None:
    """As many held requests as the cluster has slots, sent to one process, fill every
    worker's slots: that process routes to every worker. Then the same at the next."""
    problems = []
    for i in rig.indexes:
        await rig.hold()
        probes = [
            Call(f"{fault}-probe-{rig.letter(i)}{n}", hold=True, group="probe", api_key=rig.api_key)
            for n in range(rig.capacity)
        ]
        for call in probes:
            call.start(rig.ports[i], rig.request_timeout + SLACK)
        seen: dict[str, int] = {}

        async def full(seen: dict[str, int] = seen) -> bool:
            seen.clear()
            seen.update((await rig.upstream_stats())["in_flight"])
            return all(
                seen.get(rig.worker_name(w), 0) == rig.max_concurrent for w in rig.worker_indexes
            )

        try:
            await until(f"process {rig.letter(i)} to fill every slot", full, RECOVERY_SECS)
        except ChaosError:
            problems.append(f"{rig.letter(i)}: backend in flight by worker {dict(seen)}")
        finally:
            await rig.release()
        for call in probes:
            await call.finish()
        bad = Counter(c.verdict for c in probes if c.verdict != "ok")
        if bad:
            problems.append(f"{rig.letter(i)}: probes answered {dict(bad)}")
        out.calls.extend(probes)
    out.check(
        f"{fault}: routes everywhere",
        not problems,
        "every process filled every worker's slots" if not problems else "; ".join(problems),
    )


async def _no_leases(rig: ClusterRig, out: Outcome, fault: str) -> None:
    held: dict[str, list[str]] = {}

    async def none() -> bool:
        held.clear()
        held.update(await rig.leases())
        return not held

    try:
        await until("no lease in Redis", none, RECOVERY_SECS, 0.1)
        out.check(f"{fault}: no lease idle", True)
    except ChaosError:
        out.check(f"{fault}: no lease idle", False, f"an idle cluster holds {held}")


async def _capacity(rig: ClusterRig, out: Outcome, fault: str) -> None:
    peak = (await rig.upstream_stats())["peak"]
    over = {w: n for w, n in peak.items() if n > rig.max_concurrent}
    out.check(
        f"{fault}: capacity",
        not over,
        f"most at once per worker {peak} (max_concurrent {rig.max_concurrent})",
    )


def _answers(rig: ClusterRig, out: Outcome, fault: str, calls: list[Call]) -> None:
    deadline = rig.request_timeout + 1
    wrong = [c for c in calls if not c.accepted]
    late = [c for c in calls if c.reply is not None and c.reply.elapsed > deadline]
    verdicts = Counter(c.verdict for c in calls)
    out.check(
        f"{fault}: answers",
        bool(calls) and not wrong and not late,
        f"{len(calls)} requests: {dict(verdicts)}"
        + (f"; unexpected: {[(c.tag, c.verdict, c.problems) for c in wrong[:4]]}" if wrong else "")
        + (f"; {len(late)} past the deadline" if late else ""),
        {"unexpected": dict(Counter(c.verdict for c in wrong))},
    )


async def rolling_restart(
    rig: ClusterRig, out: Outcome, profile: ClusterProfile, rng: random.Random
) -> None:
    """SIGTERM every process in turn behind nginx and start it again, under steady load:
    every request succeeds; each process exits 0."""
    load = Load(rig, out, profile.clients, "rolling-restart", rng)
    started = time.monotonic()
    load.start()
    codes = []
    for _ in range(profile.rolling_rounds):
        for i in rig.indexes:
            await rig.nginx_takes_all()
            codes.append(await rig.stop_process(i))
            await rig.start_process(i)
            await rig.wait_converged(RECOVERY_SECS)
    await pause(0.5)
    await load.stop()
    took = time.monotonic() - started
    ok = sum(1 for c in load.calls if c.verdict == "ok")
    out.figures["rolling restart"] = (
        f"{len(load.calls)} requests in {took:.1f}s ({len(load.calls) / took:.0f}/s), "
        f"{ok / max(1, len(load.calls)):.2%} ok"
    )
    out.check(
        "rolling-restart: exits",
        all(code == 0 for code in codes),
        f"exit codes {codes}",
    )
    await after(rig, out, "rolling-restart", load.calls)


NAME = "cluster"
TITLE = (
    "processes behind nginx on one Redis: Redis restarted, flushed, its connections killed, "
    "error replies, a process stopped, killed, a rolling restart"
)


async def run_cluster(profile_name: str, workdir: Path, server: str) -> Outcome:
    """The cluster scenario as one :class:`Outcome`, whatever happened."""
    out = Outcome(NAME, TITLE)
    started = time.monotonic()
    try:
        await cluster_scenario(out, profile_name, workdir, server)
    except Exception as exc:
        out.check("scenario ran", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    else:
        out.check("scenario ran", True)
    out.seconds = time.monotonic() - started
    return out
