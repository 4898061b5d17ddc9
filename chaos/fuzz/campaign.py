"""The fuzz scenario: hostile peers and malformed requests beside real traffic.

One real ``worker.py`` serves a steady trickle of real client requests (ten a
second, streaming and not, both APIs), which must all succeed intact. Meanwhile:

- hostile WebSocket peers (:mod:`chaos.fuzz.peers`) send ``frames`` mutated worker
  frames over many short-lived connections, ``connections`` at a time, some of them
  carrying the request ids of the trickle's requests;
- a second client lane asks for ``fuzz-model``, which only hostile peers serve: every
  such request must still get a well-formed HTTP answer (any status 200-599, no body
  on 204/304) within REQUEST_TIMEOUT_SECS;
- ``http_requests`` malformed HTTP requests arrive on raw sockets
  (:mod:`chaos.fuzz.malformed`).

The server's VmRSS is sampled throughout; the baseline is taken after a warm-up
(a twentieth of each fuzzer), so that first-use allocations do not count as growth.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter

from chaos.calls import Call
from chaos.client import Exchange, http_request
from chaos.fuzz.frames import HOSTILE_MODEL, FrameMaker
from chaos.fuzz.malformed import PROBLEMS, CaseMaker, HttpTally, send_case
from chaos.fuzz.peers import Peers, PeerTally
from chaos.outcome import SLACK, Outcome, start_calls
from chaos.rig import Rig, until

MIB = 1024 * 1024
#: Allowed VmRSS growth from the warmed-up baseline to the end of the run.
RSS_MARGIN = 48 * MIB


async def fuzz(
    rig: Rig, out: Outcome, *, frames: int, http_requests: int, connections: int, seed: int
) -> None:
    rng = random.Random(seed)
    workers = await rig.admin_workers()
    instance = str(workers[0]["id"])[2:8]  # "w-<instance><n>"; request ids are "r-<instance>-<n>"
    live_ids: list[str] = []

    async def follow_ids() -> None:
        while True:
            total = int((await rig.stats())["requests"]["total"])
            live_ids[:] = [f"r-{instance}-{n:x}" for n in range(max(1, total - 10), total + 30)]
            await asyncio.sleep(0.5)

    max_message = int(rig.env["MAX_MESSAGE_BYTES"])
    maker = FrameMaker(random.Random(rng.random()), lambda: live_ids, max_message)
    peer_tally = PeerTally()
    peers = Peers(rig.port, maker, random.Random(rng.random()), peer_tally)
    cases = CaseMaker(random.Random(rng.random()), rig.port, int(rig.env["MAX_REQUEST_BYTES"]))
    http_tally = HttpTally()
    hostile: Counter[str] = Counter()
    hostile_problems: Counter[str] = Counter()
    hostile_examples: list[str] = []
    rss: list[int] = []
    stop = asyncio.Event()

    async def trickle() -> None:
        n = 0
        while not stop.is_set():
            call = Call(
                f"f{n}",
                "anthropic" if n % 3 == 2 else "openai",
                stream=n % 2 == 0,
                tokens=10,
                gap=0.01 if n % 2 == 0 else 0.0,
                group="trickle",
            )
            start_calls(rig, out, [call])
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    async def hostile_lane() -> None:
        pending: set[asyncio.Task[None]] = set()
        n = 0
        while not stop.is_set():
            if len(pending) < 8:
                task = asyncio.ensure_future(hostile_call(n))
                pending.add(task)
                task.add_done_callback(pending.discard)
                n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
        if pending:
            await asyncio.wait(pending)

    async def hostile_call(n: int) -> None:
        body = b'{"model":"%s","stream":%s,"n":%d}' % (
            HOSTILE_MODEL.encode(),
            b"true" if n % 2 else b"false",
            n,
        )
        raw = http_request(
            rig.port, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        reply = await Exchange(rig.port, raw, timeout=rig.request_timeout + SLACK).run()
        hostile[str(reply.status) if reply.answered else f"no answer ({reply.error})"] += 1
        kind = example = ""
        if not reply.answered:
            kind = f"no answer ({reply.error})"
            example = f"{kind} after {reply.elapsed:.1f}s"
        elif not 200 <= reply.status <= 599:
            kind = example = f"status {reply.status}"
        elif reply.status in (204, 304) and reply.body:
            kind = "body on 204/304"
            example = f"{reply.status} followed by {reply.body[:40]!r}"
        if kind:
            hostile_problems[kind] += 1
            if len(hostile_examples) < 6:
                hostile_examples.append(example)

    async def sample_rss() -> None:
        while True:
            with contextlib.suppress(OSError):
                rss.append(rig.server_rss())
            await asyncio.sleep(0.5)

    async def malformed(count: int, lanes: int) -> None:
        remaining = [count]

        async def lane() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                await send_case(rig.port, cases.case(), http_tally)

        async with asyncio.TaskGroup() as group:
            for _ in range(lanes):
                group.create_task(lane())

    started = time.monotonic()
    background = [
        asyncio.ensure_future(follow_ids()),
        asyncio.ensure_future(sample_rss()),
    ]
    lanes = [asyncio.ensure_future(trickle()), asyncio.ensure_future(hostile_lane())]
    try:
        warm_frames, warm_http = frames // 20, http_requests // 20
        async with asyncio.TaskGroup() as group:
            group.create_task(peers.run(warm_frames, connections))
            group.create_task(malformed(warm_http, 2 * connections))
        rss_start = rig.server_rss()
        bulk = time.monotonic()
        async with asyncio.TaskGroup() as group:
            group.create_task(peers.run(frames, connections))
            group.create_task(malformed(http_requests - http_tally.sent, 2 * connections))
        bulk_secs = time.monotonic() - bulk
    finally:
        stop.set()
        await asyncio.gather(*lanes, return_exceptions=True)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    for call in out.calls:
        await call.finish()

    async def only_the_real_worker() -> bool:
        health = await rig.health()
        return health["workers_connected"] == 1 and health["queue_depth"] == 0

    await until("the hostile peers gone from /health", only_the_real_worker, 15)
    rss_end = rig.server_rss()
    health = await rig.health()
    out.check(
        "health sane",
        health["status"] == "ok" and health["workers_connected"] == 1,
        f"/health {health}",
    )
    out.check(
        "frames sent",
        peer_tally.frames >= frames,
        f"{peer_tally.frames} mutated frames ({peer_tally.damaged} damaged, "
        f"{peer_tally.well_formed} well-formed with hostile content) on "
        f"{peer_tally.connections} connections",
    )
    out.check(
        "hostile peers",
        not peer_tally.problems,
        "closes: " + _counts(peer_tally.closes)
        if not peer_tally.problems
        else f"{_counts(peer_tally.problems)}; e.g. " + "; ".join(peer_tally.examples[:4]),
        {"kinds": dict(peer_tally.problems)},
    )
    hostile_total = sum(hostile.values())
    out.check(
        "hostile lane answered",
        not hostile_problems and hostile_total > 0,
        f"{hostile_total} requests served by hostile peers: {_counts(hostile)}"
        if not hostile_problems
        else f"{sum(hostile_problems.values())} of {hostile_total} ({_counts(hostile_problems)}), "
        f"e.g. " + "; ".join(hostile_examples),
        {"kinds": dict(hostile_problems)},
    )
    out.check(
        "malformed HTTP sent",
        http_tally.sent >= http_requests,
        f"{http_tally.sent} requests; reactions: {_counts(http_tally.reactions, 12)}",
    )
    for kind, title in PROBLEMS.items():
        labels = http_tally.problems.get(kind, Counter())
        out.check(
            f"HTTP: {title}",
            not labels,
            "every case"
            if not labels
            else f"{sum(labels.values())} cases ({_counts(labels, 6)}), e.g. "
            + " || ".join(http_tally.examples.get(kind, [])[:3]),
            {"labels": dict(labels)},
        )
    grown = rss_end - rss_start
    out.check(
        "RSS flat",
        grown <= RSS_MARGIN,
        f"VmRSS {rss_start / MIB:.0f} MiB after warm-up, {rss_end / MIB:.0f} MiB at the end "
        f"(peak {max(rss, default=0) / MIB:.0f} MiB; allowed growth {RSS_MARGIN // MIB} MiB)",
    )
    trickle_calls = [c for c in out.calls if c.group == "trickle"]
    out.figures.update(
        {
            "frames": peer_tally.frames,
            "damaged frames": peer_tally.damaged,
            "well-formed hostile frames": peer_tally.well_formed,
            "registers": peer_tally.registers,
            "ws connections": peer_tally.connections,
            "raw framing violations": peer_tally.raw_frames,
            "requests answered by hostile peers": peer_tally.answered,
            "malformed HTTP requests": http_tally.sent,
            "trickle requests": len(trickle_calls),
            "hostile-lane requests": hostile_total,
            "rss start MiB": round(rss_start / MIB, 1),
            "rss end MiB": round(rss_end / MIB, 1),
            "rss peak MiB": round(max(rss, default=0) / MIB, 1),
            "bulk secs": round(bulk_secs, 1),
            "fuzz secs": round(time.monotonic() - started, 1),
        }
    )
    out.figures["ws closes"] = dict(peer_tally.closes.most_common())
    if peer_tally.dropped_after:
        out.figures["dropped after"] = dict(peer_tally.dropped_after.most_common(8))
    out.figures["http reactions"] = dict(http_tally.reactions.most_common(15))


def _counts(counter: Counter[str], limit: int = 8) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common(limit))
