"""The loop-stall meter the input-limit tests rely on (tests/stall.py) sees a stall."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from tests.stall import LoopStalls, run_queue_clock


async def test_it_reports_a_call_that_blocks_the_loop() -> None:
    async with LoopStalls() as stalls:
        await asyncio.sleep(0.005)
        time.sleep(0.05)  # noqa: ASYNC251 (the stall being measured)
        await asyncio.sleep(0.005)
    assert stalls.longest_ms >= 40


async def test_it_reports_no_stall_when_the_loop_only_waits() -> None:
    async with LoopStalls() as stalls:
        await asyncio.sleep(0.03)
    assert stalls.ticks > 5 and stalls.longest_ms < 15


@pytest.mark.skipif(
    run_queue_clock(os.getpid(), os.getpid()) is None, reason="the kernel gives no schedstat"
)
async def test_the_time_another_process_held_the_core_is_not_a_stall() -> None:
    # A busy process and this one on the same core: this loop waits for its turns.
    core = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    spin = "import time\nend = time.monotonic() + 5\nwhile time.monotonic() < end: pass\n"
    busy = await asyncio.create_subprocess_exec(sys.executable, "-c", spin)
    try:
        os.sched_setaffinity(busy.pid, {core})
        os.sched_setaffinity(0, {core})
        async with LoopStalls() as stalls:
            await asyncio.sleep(0.3)
    finally:
        os.sched_setaffinity(0, mine)
        busy.kill()
        await busy.wait()
    assert stalls.longest_wall_ms > stalls.longest_ms  # the waits were there, and taken out
    assert stalls.longest_ms < 15
