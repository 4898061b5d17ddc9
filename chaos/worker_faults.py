"""Scenarios where a worker dies or goes silent under load (SPEC §6 "Worker disconnect",
"Heartbeat").

Requests are pinned where a fault must find them with the fake backend's ``hold``
(the backend has the request and has answered nothing: no byte reached anyone) or
with slow streams whose first tokens the clients have already read.
"""

from __future__ import annotations

import asyncio
import signal
import time

from chaos.calls import Call, Flavor
from chaos.outcome import Outcome, finish, start_calls
from chaos.rig import Rig, until, wait_exit

OK = frozenset({"ok"})
OK_OR_LOST = frozenset({"ok", "stream-error:worker_lost"})


def flavor(i: int) -> Flavor:
    return "anthropic" if i % 3 == 2 else "openai"


async def streaming(calls: list[Call], tokens: int, timeout: float = 20.0) -> None:
    """Until every call in ``calls`` has read at least ``tokens`` tokens."""

    async def read() -> bool:
        return all(c.streamed_tokens >= tokens for c in calls)

    await until(f"{len(calls)} streams to read {tokens} tokens", read, timeout, step=0.02)


async def requeued_tags(rig: Rig) -> dict[str, int]:
    """Tags the backend saw more than once (their request was requeued), with the count."""
    attempts: dict[str, int] = (await rig.upstream_stats())["attempts"]
    return {tag: n for tag, n in attempts.items() if n > 1}


async def kill_before_first_byte(rig: Rig, out: Outcome, size: int) -> None:
    """SIGKILL a worker whose requests reached the backend but got no byte back yet:
    each is requeued to another worker and succeeds; nothing is duplicated."""
    calls = [
        Call(f"kb{i}", flavor(i), stream=i % 2 == 0, tokens=12, hold=True, group="held")
        for i in range(size)
    ]
    start_calls(rig, out, calls)
    await rig.wait_active(size)
    victim = await rig.worker_named(1)
    assert victim is not None
    on_victim = int(victim["in_flight"])
    await rig.kill_worker(1)

    async def requeued() -> bool:
        return int((await rig.stats())["requeues"]) >= on_victim

    await until(f"{on_victim} requests requeued", requeued, 10)
    await rig.release()
    rig.start_worker(1)
    await finish(calls)
    retried = await requeued_tags(rig)
    out.check(
        "requeued once each",
        on_victim > 0 and len(retried) == on_victim and set(retried.values()) == {2},
        f"{on_victim} requests were on the killed worker; the backend saw {len(retried)} "
        f"of them again: {sorted(retried.values())}",
    )
    stats = await rig.stats()
    out.check(
        "server counted the requeues",
        stats["requeues"] == on_victim,
        f"/admin/stats requeues {stats['requeues']}, expected {on_victim}",
    )
    out.figures["on killed worker"] = on_victim


async def kill_after_first_byte(rig: Rig, out: Outcome, size: int) -> None:
    """SIGKILL a worker while its streams are half-way: those streams end with the SSE
    error event (never replayed); its requests that had sent nothing are requeued."""
    streams = [
        Call(f"ka{i}", flavor(i), stream=True, tokens=60, gap=0.04, group="streaming")
        for i in range(2 * size // 3)
    ]
    held = [
        Call(f"kh{i}", flavor(i), stream=i % 2 == 0, hold=True, group="held")
        for i in range(size - len(streams))
    ]
    for call in streams:
        call.expect = OK_OR_LOST
    start_calls(rig, out, streams)
    await streaming(streams, 1)
    start_calls(rig, out, held)
    await rig.wait_active(size)
    await streaming(streams, 2)
    victim = await rig.worker_named(1)
    assert victim is not None
    on_victim = int(victim["in_flight"])
    await rig.kill_worker(1)
    await rig.wait_gone(1, 10)
    await rig.release()
    rig.start_worker(1)
    await finish(streams + held)
    lost = sum(1 for c in streams if c.verdict == "stream-error:worker_lost")
    retried = await requeued_tags(rig)
    out.check(
        "cut streams + requeued = on the killed worker",
        lost >= 1 and lost + len(retried) == on_victim,
        f"{on_victim} requests on the killed worker: {lost} streams ended with the error "
        f"event, {len(retried)} requests requeued",
    )
    stats = await rig.stats()
    counted = stats["requests"]["by_outcome"].get("worker_lost", 0)
    out.check(
        "server counted the cut streams",
        counted == lost,
        f"/admin/stats worker_lost {counted}, clients saw {lost}",
    )
    out.figures["on killed worker"] = on_victim


async def requeue_exhausted(rig: Rig, out: Outcome, size: int) -> None:
    """MAX_REQUEUE_COUNT=1: requests that lose a second worker get 503 "Request could not
    be processed after multiple attempts"; those that lost only one are served."""
    calls = [
        Call(f"rx{i}", flavor(i), stream=i % 2 == 0, hold=True, group="held") for i in range(size)
    ]
    for call in calls:
        call.expect = frozenset({"ok", "error:503:requeue_exhausted"})
    start_calls(rig, out, calls)
    await rig.wait_active(size)
    first = await rig.worker_named(1)
    assert first is not None
    on_first = int(first["in_flight"])
    await rig.kill_worker(1)
    # The requeued ones reached the backend again, through worker 2.
    await rig.wait_active(size, seen=size + on_first)
    await rig.kill_worker(2)

    async def queued() -> bool:
        return int((await rig.health())["queue_depth"]) == size - on_first

    await until(f"{size - on_first} requests back in the queue", queued, 10)
    rig.start_worker(1)
    await rig.wait_active(size - on_first, seen=2 * size)
    await rig.release()
    rig.start_worker(2)
    await finish(calls)
    exhausted = [c for c in calls if c.verdict == "error:503:requeue_exhausted"]
    out.check(
        "exhausted = lost two workers",
        len(exhausted) == on_first and on_first > 0,
        f"{on_first} requests lost two workers, {len(exhausted)} got 503 requeue_exhausted",
    )
    message = "Request could not be processed after multiple attempts"
    wrong = [
        c.tag for c in exhausted if c.reply is not None and message.encode() not in c.reply.body
    ]
    out.check("503 message", not wrong, f"message {message!r}" if not wrong else f"{wrong}")


async def heartbeat_loss(rig: Rig, out: Outcome, size: int) -> None:
    """SIGSTOP a worker: the server closes it after HEARTBEAT_TIMEOUT_SECS and handles it
    as gone; after SIGCONT the worker reconnects and serves again."""
    streams = [
        Call(f"hs{i}", flavor(i), stream=True, tokens=80, gap=0.04, group="streaming")
        for i in range(size // 2)
    ]
    held = [
        Call(f"hh{i}", flavor(i), stream=i % 2 == 0, hold=True, group="held")
        for i in range(size - len(streams))
    ]
    for call in streams:
        call.expect = OK_OR_LOST
    start_calls(rig, out, streams)
    await streaming(streams, 1)
    start_calls(rig, out, held)
    await rig.wait_active(size)
    await streaming(streams, 2)
    victim = await rig.worker_named(1)
    assert victim is not None
    on_victim = int(victim["in_flight"])
    rig.signal_worker(1, signal.SIGSTOP)
    stopped = time.monotonic()
    timeout = float(rig.env["HEARTBEAT_TIMEOUT_SECS"])
    try:
        await rig.wait_gone(1, timeout + 10)
    finally:
        detected = time.monotonic() - stopped
        await rig.release()
        rig.signal_worker(1, signal.SIGCONT)
    out.check(
        "heartbeat loss detected",
        detected <= timeout + rig.heartbeat + 1.5,
        f"closed {detected:.1f}s after SIGSTOP (HEARTBEAT_TIMEOUT_SECS={timeout:g})",
    )
    await rig.wait_workers([1, 2], timeout=20)
    await finish(streams + held)
    lost = sum(1 for c in streams if c.verdict == "stream-error:worker_lost")
    retried = await requeued_tags(rig)
    out.check(
        "cut streams + requeued = on the silent worker",
        lost >= 1 and lost + len(retried) == on_victim,
        f"{on_victim} requests on the stopped worker: {lost} streams ended with the error "
        f"event, {len(retried)} requests requeued",
    )
    after = [
        Call(f"ha{i}", flavor(i), stream=i % 2 == 0, tokens=10, group="after SIGCONT")
        for i in range(size)
    ]
    start_calls(rig, out, after)
    await finish(after)
    served = {w["name"]: w["requests_served"] for w in await rig.admin_workers()}
    out.check(
        "the resumed worker serves again",
        served.get(rig.worker_name(1), 0) > 0,
        f"requests served since reconnecting: {served}",
    )
    out.figures["detection secs"] = round(detected, 2)


async def worker_drain(rig: Rig, out: Outcome, size: int) -> None:
    """SIGTERM a worker (its own drain, SPEC §7): what it runs finishes, it exits 0, and
    no client sees the drain.

    First with requests already in its socket, unread, when the drain starts (the
    worker is stopped while the server sends them, and the SIGTERM is pending when it
    resumes): they are served. Then ``size`` times under steady load, the queue never
    empty: the requests the server sends it between its SIGTERM and the server hearing
    of it (``models_update`` with no models) must reach another worker.
    """
    running = [
        Call(f"dr{i}", flavor(i), stream=True, tokens=30, gap=0.03, group="running")
        for i in range(2)
    ]
    start_calls(rig, out, running)
    await streaming(running, 2)
    rig.signal_worker(1, signal.SIGSTOP)
    try:
        sent = [
            Call(f"ds{i}", flavor(i), stream=i % 2 == 0, group="unread at the SIGTERM")
            for i in range(min(size, rig.worker_concurrency - len(running)))
        ]
        start_calls(rig, out, sent)

        async def assigned() -> bool:
            worker = await rig.worker_named(1)
            return worker is not None and worker["in_flight"] == len(running) + len(sent)

        await until("the requests assigned to the stopped worker", assigned, 10)
        rig.signal_worker(1, signal.SIGTERM)
        proc = rig.workers[1]
    finally:
        rig.signal_worker(1, signal.SIGCONT)
    codes = [await wait_exit(proc, 20)]
    await finish(running + sent)
    rig.start_worker(1)
    rig.start_worker(2)
    await rig.wait_workers([1, 2])

    stop = False

    async def client(k: int) -> None:
        n = 0
        while not stop:
            call = Call(
                f"dl{k}-{n}",
                flavor(n),
                stream=n % 2 == 1,
                tokens=6,
                gap=0.01 if n % 2 else 0.0,
                delay=0.0 if n % 2 else 0.02,
                group="under load",
            )
            start_calls(rig, out, [call])
            await call.finish()
            n += 1

    async with asyncio.TaskGroup() as group:
        for k in range(4 * rig.worker_concurrency):
            group.create_task(client(k))
        try:
            for _ in range(size):
                await asyncio.sleep(0.3)
                proc = rig.workers[1]
                rig.signal_worker(1, signal.SIGTERM)
                codes.append(await wait_exit(proc, 20))
                rig.start_worker(1)
                await rig.wait_workers([1, 2])
        finally:
            stop = True
    out.check(
        "the drained worker exits 0",
        all(code == 0 for code in codes),
        f"{len(codes)} drains, exit codes {codes}",
    )
