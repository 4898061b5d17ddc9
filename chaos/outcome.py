"""What a scenario found: its checks, its calls' verdicts, and the checks every scenario ends with.

After its faults, every scenario is judged the same way (:func:`final_checks`), on
top of its own checks:

- **answers**: every client got a terminal answer within its deadline
  (REQUEST_TIMEOUT_SECS plus a little for the answer to travel);
- **verdicts**: every answer is one the spec allows for what was staged (status
  codes and envelopes of SPEC §5, streams ended by the SSE error event of §6);
- **streams**: no duplicated, missing or reordered bytes in any stream;
- **slots**: ``GET /admin/workers`` shows load 0 and nothing in flight on every
  worker, ``/health`` queue depth 0 and ``/admin/stats`` nothing in flight;
- **backend**: no request is still running at the fake backend (every cancel and
  every lost worker reached it);
- **workers**: exactly the expected workers are registered again;
- **server**: the process is up and answers ``/health``;
- **logs**: no traceback, "Exception inside application" or ERROR line in any
  server or worker log.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from chaos.calls import Call
from chaos.rig import ChaosError, Rig, until


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    #: What the check counted, for telling a known product failure from a new one.
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    name: str
    title: str
    checks: list[Check] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    #: Figures worth reporting beyond the checks (fuzz counts, RSS, timings).
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def check(
        self, name: str, ok: bool, detail: str = "", data: dict[str, Any] | None = None
    ) -> bool:
        self.checks.append(Check(name, bool(ok), detail, data or {}))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def verdicts(self) -> Counter[str]:
        return Counter(call.verdict for call in self.calls)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "passed": self.passed,
            "seconds": round(self.seconds, 1),
            "requests": len(self.calls),
            "verdicts": dict(sorted(self.verdicts().items())),
            "checks": [c.__dict__ for c in self.checks],
            "figures": self.figures,
        }


#: How long after REQUEST_TIMEOUT_SECS a client still waits for its answer to arrive.
SLACK = 3.0


def start_calls(rig: Rig, outcome: Outcome, calls: Iterable[Call]) -> list[Call]:
    """Send ``calls`` at once; each must be answered within REQUEST_TIMEOUT_SECS + SLACK."""
    started = list(calls)
    for call in started:
        call.start(rig.port, rig.request_timeout + SLACK)
    outcome.calls.extend(started)
    return started


async def finish(calls: Iterable[Call]) -> None:
    for call in calls:
        await call.finish()


def call_checks(outcome: Outcome) -> None:
    """answers, verdicts, streams: over every call of the scenario."""
    calls = outcome.calls
    silent = [c for c in calls if c.verdict.startswith("no-answer")]
    outcome.check(
        "answers",
        not silent,
        f"{len(calls)} requests, all answered"
        if not silent
        else f"{len(silent)} of {len(calls)} without a terminal answer: " + _examples(silent),
    )
    corrupt = [c for c in calls if c.verdict.startswith("corrupt")]
    outcome.check(
        "streams intact",
        not corrupt,
        "no duplicated, missing or reordered bytes"
        if not corrupt
        else f"{len(corrupt)} corrupt: " + _examples(corrupt),
    )
    late = sum(1 for c in calls if c.sse is not None and c.sse.error_after_end)
    if late:
        outcome.figures["error event after the stream's end"] = late
    wrong = [c for c in calls if not c.accepted and c not in silent and c not in corrupt]
    counts = ", ".join(f"{v} {n}" for v, n in sorted(outcome.verdicts().items()))
    outcome.check(
        "verdicts",
        not wrong,
        counts if not wrong else f"{len(wrong)} unexpected: " + _examples(wrong),
        {
            "unexpected": dict(Counter(c.verdict for c in wrong)),
            "problems": [p for c in wrong for p in c.problems],
        },
    )


def _examples(calls: list[Call], limit: int = 4) -> str:
    out = []
    for call in calls[:limit]:
        expected = "|".join(sorted(call.expect))
        problems = f" ({'; '.join(call.problems)})" if call.problems else ""
        elapsed = call.reply.elapsed if call.reply is not None else 0.0
        out.append(
            f"{call.tag}[{call.group}] got {call.verdict}{problems} after {elapsed:.1f}s, "
            f"expected {expected}"
        )
    more = f" (+{len(calls) - limit} more)" if len(calls) > limit else ""
    return "; ".join(out) + more


async def final_checks(rig: Rig, outcome: Outcome, workers: Iterable[int], settle: float) -> None:
    """slots, backend, workers, server, logs — after the scenario's faults are over."""
    call_checks(outcome)
    indexes = list(workers)
    alive = rig.server_alive()
    outcome.check("server up", alive, "" if alive else f"server exited:\n{_tail(rig)}")
    if alive:
        try:
            await rig.wait_workers(indexes, timeout=settle + 10)
            outcome.check("workers", True, f"{len(indexes)} registered")
        except ChaosError as exc:
            names = [w["name"] for w in await rig.admin_workers()]
            outcome.check("workers", False, f"{exc}; registered: {names}")
        snapshot: dict[str, Any] = {}

        async def idle() -> bool:
            workers_now = await rig.admin_workers()
            health = await rig.health()
            stats = await rig.stats()
            snapshot.update(workers=workers_now, health=health, in_flight=stats["in_flight"])
            return (
                all(w["load"] == 0 and w["in_flight"] == 0 for w in workers_now)
                and health["queue_depth"] == 0
                and stats["in_flight"] == 0
            )

        started = time.monotonic()
        try:
            await until("every slot free and the queue empty", idle, settle, step=0.1)
            outcome.check(
                "slots",
                True,
                f"load 0 on every worker, queue 0 (after {time.monotonic() - started:.1f}s)",
            )
        except ChaosError:
            loads = {w["name"]: (w["load"], w["in_flight"]) for w in snapshot.get("workers", [])}
            outcome.check(
                "slots",
                False,
                f"after {settle:g}s: (load, in_flight) by worker {loads}, queue depth "
                f"{snapshot.get('health', {}).get('queue_depth')}, in flight "
                f"{snapshot.get('in_flight')}",
            )
    if rig.upstream is not None and rig.upstream.alive():
        seen: dict[str, Any] = {}

        async def backend_idle() -> bool:
            seen.update(await rig.upstream_stats())
            return int(seen["active"]) == 0

        try:
            await until("the backend idle", backend_idle, settle, step=0.1)
            outcome.check("backend idle", True, f"{seen['requests']} backend requests, none left")
        except ChaosError:
            outcome.check(
                "backend idle",
                False,
                f"{seen.get('active')} still running at the backend after {settle:g}s: "
                f"{seen.get('active_tags', [])[:8]}",
            )
    found = rig.log_incidents()
    signatures = Counter(i.signature for i in found)
    outcome.check(
        "logs clean",
        not found,
        "no traceback or ERROR line"
        if not found
        else f"{len(found)} errors logged ("
        + "; ".join(f"{n}x {sig}" for sig, n in signatures.most_common(4))
        + "), e.g. "
        + " || ".join(f"{i.process}: {i.excerpt}" for i in found[:2]),
        {"signatures": dict(signatures)},
    )


def _tail(rig: Rig) -> str:
    return rig.server.tail(15) if rig.server is not None else ""
