"""The request-log writer runs off the event loop, including when it stops."""

from __future__ import annotations

import asyncio
import threading

from relay.core.keycache import KeyCache
from relay.server.bookkeeper import Bookkeeper


async def test_stopping_the_bookkeeper_never_blocks_the_event_loop():
    bookkeeper = Bookkeeper(KeyCache("pepper"), flush_interval=3600)
    task = asyncio.get_running_loop().create_task(bookkeeper.run())
    release = threading.Event()
    busy = asyncio.ensure_future(bookkeeper._db.run(release.wait, 10))  # a slow write
    await asyncio.sleep(0.01)
    task.cancel()
    ticks = 0
    while not task.done() and ticks < 20:  # the loop keeps running meanwhile
        await asyncio.sleep(0.005)
        ticks += 1
    assert ticks == 20 and not task.done()  # still waiting for the write, not blocking
    release.set()
    await asyncio.wait_for(asyncio.gather(task, busy, return_exceptions=True), 5)
    assert task.cancelled()
