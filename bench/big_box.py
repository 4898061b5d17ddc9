"""(f) One big box: a vLLM-sized stream load through one worker.py.

A big GPU box running vLLM streams thousands of tokens a second over a few hundred
concurrent requests, all through the one worker.py on that box. Here one worker sits
in front of a fake upstream that streams ``streams`` concurrent requests at ``rate``
tokens/s each (200 x 50 = 10,000 chunks/s), through a ModelRelay server (daphne, then
uvicorn). Measured: every stream intact, chunk delay and gap over the whole run, and
the CPU of the worker and of the server over the *steady state* (from the moment every
stream is running until the first one ends): as a share of one core, and per chunk
delivered in that window. A separate, unmeasured pass replays the load while py-spy
samples the worker and the server (``profile``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench import loadgen
from bench.procs import Processes
from bench.profiler import Profiler
from bench.scenarios import HOST, Window
from bench.targets import ROOT, Target, project_python

#: Seconds after the last stream started before the window opens, and before the
#: first stream ends that it closes.
SETTLE = 0.5


def steady_window(tokens: int, rate: float, ramp: float) -> tuple[float, float]:
    """Seconds after the load starts when every stream is running: (open, close)."""
    return ramp + SETTLE, tokens / rate - SETTLE


async def _run(
    target: Target, upstream_pid: int, streams: int, tokens: int, rate: float, ramp: float
) -> tuple[loadgen.StreamResult, Window, tuple[int, int]]:
    opens, closes = steady_window(tokens, rate, ramp)
    load = asyncio.ensure_future(
        loadgen.streams(
            HOST,
            target.port,
            count=streams,
            tokens=tokens,
            ramp=ramp,
            limit=tokens / rate + ramp + 60,
        )
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = Window(target, upstream_pid)
    try:
        await asyncio.sleep(opens)
        with window:
            first_us = loadgen.now_us()
            await asyncio.sleep(max(0.5, start + closes - loop.time()))
            last_us = loadgen.now_us()
        return await load, window, (first_us, last_us)
    finally:
        if not load.done():
            load.cancel()
            await asyncio.wait([load])


def measure(
    target: Target, upstream_pid: int, streams: int, tokens: int, rate: float, ramp: float
) -> dict[str, Any]:
    """The scenario against one ModelRelay deployment with one worker.py."""
    result, window, (first, last) = asyncio.run(
        _run(target, upstream_pid, streams, tokens, rate, ramp)
    )
    in_window = sum(1 for t in result.arrivals_us if first <= t <= last)
    delays, gaps = result.delays_us, result.gaps_us
    return {
        "streams": streams,
        "tokens": tokens,
        "rate": rate,
        "intact": result.intact,
        "chunks": result.chunks,
        "problems": result.problems,
        "delay_p50_ms": loadgen.percentile(delays, 50) / 1000,
        "delay_p99_ms": loadgen.percentile(delays, 99) / 1000,
        "delay_max_ms": max(delays) / 1000 if delays else float("nan"),
        "gap_p50_ms": loadgen.percentile(gaps, 50) / 1000,
        "gap_p99_ms": loadgen.percentile(gaps, 99) / 1000,
        "elapsed": round(result.elapsed, 2),
        # The steady-state window: CPU of every process, and the chunks delivered in it.
        "window": {"cpu": window.cpu(), "wall": round(window.wall, 3), "chunks": in_window},
    }


def profile(
    profiler: Profiler,
    tag: str,
    target: Target,
    upstream_pid: int,
    streams: int,
    tokens: int,
    rate: float,
    ramp: float,
) -> dict[str, Any]:
    """py-spy on the server and the worker over the steady state of a replayed load."""
    opens, closes = steady_window(tokens, rate, ramp)
    pids = {"server": target.cpu_pids["server"][0], "worker": target.cpu_pids["workers"][0]}

    async def replay() -> None:
        load = asyncio.ensure_future(
            loadgen.streams(
                HOST,
                target.port,
                count=streams,
                tokens=tokens,
                ramp=ramp,
                limit=tokens / rate + ramp + 60,
            )
        )
        await asyncio.sleep(opens)
        spies, outs = profiler.spy(f"{tag}-f", pids, max(1.0, closes - opens))
        await load
        found.update(profiler.collect(spies, outs))

    found: dict[str, Any] = {}
    asyncio.run(replay())
    return found


def start_upstream(procs: Processes, rate: float) -> tuple[str, int]:
    """A fake upstream streaming at ``rate`` tokens/s: its URL and pid."""
    proc = procs.start(
        f"upstream-{rate:g}",
        [project_python(), "-m", "bench.upstream", "--token-rate", str(rate)],
        cwd=ROOT,
    )
    match = proc.wait_for_line(r"upstream listening on (http://\S+)", timeout=30)
    return match.group(1), proc.pid
