"""The loop-stall meter the input-limit tests rely on (tests/stall.py) sees a stall."""

from __future__ import annotations

import asyncio
import time

from tests.stall import LoopStalls


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
