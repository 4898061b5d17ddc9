"""Scenarios at the relay's edges: the server restarting, clients leaving, deadlines
passing, the backend behind the workers going down (SPEC §5 errors, §6 cancellation,
drain and shutdown)."""

from __future__ import annotations

import asyncio

from chaos.calls import Call
from chaos.outcome import Outcome, finish, start_calls
from chaos.rig import ChaosError, Rig, until
from chaos.worker_faults import flavor, streaming

SHUTTING_DOWN = "error:503:shutting_down"


async def server_restart(rig: Rig, out: Outcome, size: int) -> None:
    """SIGTERM the server with requests in flight and queued: in-flight ones finish within
    SHUTDOWN_GRACE_SECS, new ones get 503, the server exits 0; a new server on the same
    port gets the workers back and serves."""
    grace = float(rig.env["SHUTDOWN_GRACE_SECS"])
    short = [
        Call(f"rs{i}", flavor(i), stream=True, tokens=20, gap=0.05, group="in flight")
        for i in range(2)
    ]
    long = [
        Call(f"rl{i}", flavor(i), stream=True, tokens=400, gap=0.05, group="outlasts the grace")
        for i in range(2)
    ]
    for call in long:
        call.expect = frozenset({"stream-error:worker_lost", "stream-error:shutting_down"})
    queued = [Call(f"rq{i}", flavor(i), stream=i % 2 == 0, group="queued") for i in range(size)]
    for call in queued:
        call.expect = frozenset({"ok", SHUTTING_DOWN})
    start_calls(rig, out, short + long)
    await streaming(short + long, 2)
    start_calls(rig, out, queued)

    async def waiting() -> bool:
        return int((await rig.health())["queue_depth"]) == len(queued)

    await until(f"{len(queued)} requests queued", waiting, 10)
    stopping = asyncio.ensure_future(rig.stop_server(grace + 20))

    async def draining() -> bool:
        try:
            return (await rig.health())["status"] == "draining"
        except ChaosError:
            return False

    await until("/health to say draining", draining, 5, step=0.02)
    new = [
        Call(
            f"rn{i}",
            flavor(i),
            stream=i % 2 == 0,
            group="new during shutdown",
            expect=frozenset({SHUTTING_DOWN}),
        )
        for i in range(size)
    ]
    start_calls(rig, out, new)
    code, took = await stopping
    out.check(
        "server exits cleanly",
        code == 0 and took <= grace + 8,
        f"exit code {code} after {took:.1f}s (SHUTDOWN_GRACE_SECS={grace:g})",
    )
    await finish(short + long + queued + new)
    out.check(
        "in flight finished within the grace",
        all(c.verdict == "ok" for c in short),
        ", ".join(f"{c.tag} {c.verdict}" for c in short),
    )
    await rig.start_server()
    await rig.wait_workers([1, 2], timeout=20)
    after = [
        Call(f"ra{i}", flavor(i), stream=i % 2 == 0, tokens=10, group="after restart")
        for i in range(2 * size)
    ]
    start_calls(rig, out, after)
    await finish(after)
    out.figures["shutdown secs"] = round(took, 2)


async def client_hangups(rig: Rig, out: Outcome, size: int) -> None:
    """Clients leave while queued (removed, no worker hears of it), while assigned and
    mid-stream (one cancel each; the backend request is aborted; the slot is free)."""
    blockers = [Call(f"cb{i}", hold=True, group="blocker") for i in range(rig.worker_concurrency)]
    start_calls(rig, out, blockers)
    await rig.wait_active(len(blockers))
    queued = [Call(f"cq{i}", flavor(i), stream=i % 2 == 0, group="queued") for i in range(2 * size)]
    start_calls(rig, out, queued)

    async def depth(n: int) -> bool:
        return int((await rig.health())["queue_depth"]) == n

    await until(f"{len(queued)} queued", lambda: depth(len(queued)), 10)
    leavers = queued[::2]
    for call in leavers:
        call.expect = frozenset({"hung-up"})
        call.hangup()
    await until("the queue to shrink", lambda: depth(len(queued) - len(leavers)), 3, step=0.02)
    out.check("queued hang-ups leave the queue", True, f"{len(leavers)} removed at once")
    await rig.release()
    await finish(blockers + queued)
    await rig.hold()

    assigned = [
        Call(f"ca{i}", flavor(i), stream=i % 2 == 0, hold=True, group="assigned")
        for i in range(size)
    ]
    midstream = [
        Call(f"cm{i}", flavor(i), stream=True, tokens=400, gap=0.03, group="mid-stream")
        for i in range(size)
    ]
    for call in assigned + midstream:
        call.expect = frozenset({"hung-up"})
    start_calls(rig, out, assigned + midstream)
    await rig.wait_active(len(assigned) + len(midstream))
    await streaming(midstream, 3)
    for call in assigned + midstream:
        call.hangup()
    gone = {c.tag for c in assigned + midstream}

    async def aborted() -> bool:
        stats = await rig.upstream_stats()
        return gone <= set(stats["aborted"]) and not gone & set(stats["active_tags"])

    await until("the backend requests of the leavers aborted", aborted, 5)
    out.check("cancel reaches the backend", True, f"{len(gone)} backend requests aborted")
    await finish(assigned + midstream)
    attempts = (await rig.upstream_stats())["attempts"]
    reached = [c.tag for c in leavers if c.tag in attempts]
    out.check(
        "queued leavers never reached a worker",
        not reached,
        "none did" if not reached else f"{reached} reached the backend",
    )
    stats = await rig.stats()
    cancels = stats["cancels"].get("client_disconnect", 0)
    out.check(
        "one cancel per in-flight leaver",
        cancels == len(gone),
        f"/admin/stats cancels.client_disconnect {cancels}, expected {len(gone)}",
    )


async def timeouts(rig: Rig, out: Outcome, size: int) -> None:
    """REQUEST_TIMEOUT_SECS in flight (504, or the error event mid-stream; cancel(timeout)
    reaches the backend) and QUEUE_TIMEOUT_SECS in the queue, with and without workers."""
    request_timeout = rig.request_timeout
    queue_timeout = float(rig.env["QUEUE_TIMEOUT_SECS"])
    held = Call("th", hold=True, group="held", expect=frozenset({"error:504:request_timeout"}))
    slow = Call(
        "ts",
        stream=True,
        tokens=400,
        gap=0.05,
        group="slow stream",
        expect=frozenset({"stream-error:request_timeout"}),
    )
    start_calls(rig, out, [held, slow])
    await rig.wait_active(2)
    queued = [
        Call(
            f"tq{i}",
            flavor(i),
            stream=i % 2 == 0,
            group="queued",
            expect=frozenset({"error:504:queue_timeout"}),
        )
        for i in range(size)
    ]
    start_calls(rig, out, queued)
    await finish([held, slow, *queued])
    assert held.reply is not None
    out.check(
        "504 at REQUEST_TIMEOUT_SECS",
        request_timeout - 0.2 <= held.reply.elapsed <= request_timeout + 1.5,
        f"after {held.reply.elapsed:.2f}s (REQUEST_TIMEOUT_SECS={request_timeout:g})",
    )
    waits = [c.reply.elapsed for c in queued if c.reply is not None]
    out.check(
        "504 at QUEUE_TIMEOUT_SECS",
        all(queue_timeout - 0.2 <= w <= queue_timeout + 1.5 for w in waits),
        f"after {min(waits):.2f}-{max(waits):.2f}s (QUEUE_TIMEOUT_SECS={queue_timeout:g})",
    )

    async def aborted() -> bool:
        stats = await rig.upstream_stats()
        return {"th", "ts"} <= set(stats["aborted"])

    await until("the timed-out backend requests aborted", aborted, 5)
    stats = await rig.stats()
    out.check(
        "cancel(timeout) sent",
        stats["cancels"].get("timeout", 0) == 2,
        f"/admin/stats cancels {stats['cancels']}",
    )
    await rig.kill_worker(1)
    await rig.wait_gone(1, 10)
    orphans = [
        Call(
            f"tn{i}",
            flavor(i),
            stream=i % 2 == 0,
            group="no worker",
            expect=frozenset({"error:504:queue_timeout"}),
        )
        for i in range(size)
    ]
    start_calls(rig, out, orphans)
    await finish(orphans)
    rig.start_worker(1)


async def backend_down(rig: Rig, out: Outcome, size: int) -> None:
    """The backend crashes under load, stays down, comes back. Streams that had started
    end with the error event; requests the backend never answered go back to the queue
    (the workers hand them back and withdraw their models, staying registered) and are
    served once the backend answers again, with those that arrived meanwhile."""
    streams = [
        Call(f"bs{i}", flavor(i), stream=True, tokens=400, gap=0.03, group="streaming at the crash")
        for i in range(2)
    ]
    for call in streams:
        call.expect = frozenset({"stream-error:worker_error"})
    held = [Call(f"bh{i}", flavor(i), hold=True, group="held at the crash") for i in range(2)]
    start_calls(rig, out, streams + held)
    await rig.wait_active(4)
    await streaming(streams, 2)
    rig.kill_upstream()
    await finish(streams)
    down = [
        Call(f"bd{i}", flavor(i), stream=i % 2 == 0, group="arriving while the backend is down")
        for i in range(2 * size)
    ]
    start_calls(rig, out, down)

    async def withdrawn() -> bool:
        workers = await rig.admin_workers()
        return len(workers) == 2 and all(w["backend"] == "unreachable" for w in workers)

    await until("both workers to withdraw their models", withdrawn, 20)
    health = await rig.health()
    names = sorted(w["name"] for w in await rig.admin_workers())
    out.check(
        "workers stay registered",
        health["workers_connected"] == 2 and names == [rig.worker_name(1), rig.worker_name(2)],
        f"/health workers_connected {health['workers_connected']}, /admin/workers {names}",
    )
    await rig.start_upstream()
    await rig.release()  # the held ones, sent again, are held by the new backend too
    back = [
        Call(f"bb{i}", flavor(i), stream=i % 2 == 0, tokens=10, group="backend back")
        for i in range(2 * size)
    ]
    start_calls(rig, out, back)
    await finish(held + down + back)
