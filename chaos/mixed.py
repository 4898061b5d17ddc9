"""The mixed run: many concurrent clients while workers are killed and restarted at random.

``clients`` client loops send requests back to back for ``seconds`` seconds: half
streaming (3-30 tokens, 10-40 ms apart), half not (0-300 ms before the backend
answers), a quarter on ``/v1/messages``, one in twenty abandoned by its client at a
random moment. Meanwhile a "monkey" picks a random worker every 1-3 s and either
SIGKILLs it (three times in four) or SIGTERMs it (the worker's own drain: it must
finish what it has and exit 0), then restarts it 0.3-1.5 s later. At most one
worker is down at a time.

Every answer must be one a client of a relay losing workers may get: the full
answer, a stream cut by the SSE error event after a clean prefix (its worker died
after the first byte), 503 "requeue exhausted" or 504 "queue timeout".
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time

from chaos.calls import Call
from chaos.outcome import SLACK, Outcome
from chaos.rig import Rig, wait_exit

UNARY = frozenset({"ok", "error:503:requeue_exhausted", "error:504:queue_timeout"})
STREAM = UNARY | {"stream-error:worker_lost"}


async def mixed(
    rig: Rig, out: Outcome, *, seconds: float, clients: int, seed: int, terms: bool = True
) -> None:
    rng = random.Random(seed)
    numbers = itertools.count()
    stop_at = time.monotonic() + seconds
    actions: list[str] = []
    drained: list[tuple[str, int | None]] = []

    async def client() -> None:
        await asyncio.sleep(rng.uniform(0, 1))  # not all at once
        while time.monotonic() < stop_at:
            i = next(numbers)
            stream = rng.random() < 0.5
            call = Call(
                f"m{i}",
                "anthropic" if rng.random() < 0.25 else "openai",
                stream=stream,
                tokens=rng.randint(3, 30),
                gap=rng.uniform(0.01, 0.04) if stream else 0.0,
                delay=0.0 if stream else rng.uniform(0, 0.3),
                group="stream" if stream else "unary",
                expect=STREAM if stream else UNARY,
            )
            call.start(rig.port, rig.request_timeout + SLACK)
            out.calls.append(call)
            if rng.random() < 0.05:
                call.expect = call.expect | {"hung-up"}
                call.group += ", abandoned"
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                call.hangup()
            await call.finish()

    async def monkey() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.uniform(1, 3))
            index = rng.randint(1, 3)
            name = rig.worker_name(index)
            if not terms or rng.random() < 0.75:
                actions.append(f"kill {name}")
                await rig.kill_worker(index)
            else:
                actions.append(f"term {name}")
                proc = rig.workers[index]
                rig.signal_worker(index, signal.SIGTERM)
                drained.append((name, await wait_exit(proc, 20)))
            await asyncio.sleep(rng.uniform(0.3, 1.5))
            rig.start_worker(index)

    started = time.monotonic()
    async with asyncio.TaskGroup() as group:
        for _ in range(clients):
            group.create_task(client())
        group.create_task(monkey())
    took = time.monotonic() - started
    bad = [(name, code) for name, code in drained if code != 0]
    out.check(
        "drained workers exit 0",
        not bad,
        f"{len(drained)} SIGTERMs, all exited 0" if not bad else f"exit codes {bad}",
    )
    kills = sum(1 for a in actions if a.startswith("kill"))
    out.figures.update(
        {
            "clients": clients,
            "seconds": round(took, 1),
            "worker kills": kills,
            "worker SIGTERMs": len(actions) - kills,
            "requests per second": round(len(out.calls) / took, 1),
        }
    )
