"""The request-log writer runs off the event loop, including when it stops."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import threading

import pytest

from relay.core.keycache import KeyCache
from relay.core.stats import RequestRecord
from relay.server.bookkeeper import Bookkeeper, write_request_log


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


@pytest.mark.django_db
def test_a_logged_request_keeps_its_exact_time_in_the_database():
    from workers_app.models import RequestLog

    stamps = [1_790_000_000.123456, 1_700_000_000.0, 1_800_000_000.999999]
    template = RequestRecord.rejected(
        status=200, outcome="ok", model="m", endpoint="chat", streamed=False, key_id=None
    )
    write_request_log(
        [
            dataclasses.replace(template, request_id=f"req-{n}", created_at=stamp)
            for n, stamp in enumerate(stamps)
        ]
    )
    for n, stamp in enumerate(stamps):
        row = RequestLog.objects.get(request_id=f"req-{n}")
        assert row.created_at == dt.datetime.fromtimestamp(stamp, dt.UTC)
