"""Where the batches' database work runs: never on the event loop.

The engine has one thread of its own that keeps its connection between calls (it
writes often; reconnecting each time would cost more than the writes). The routes
use :func:`in_thread`, a pool thread whose connection is closed afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ORM work in a pool thread and release that thread's connection afterwards."""

    def call() -> T:
        from django.db import connections

        try:
            return fn(*args)
        finally:
            connections.close_all()

    return await sync_to_async(call, thread_sensitive=False)()


class DatabaseThread:
    """One long-lived thread for the engine's ORM work, in call order."""

    def __init__(self, name: str = "relay-batches") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    @staticmethod
    def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        from django.db import connections

        try:
            return fn(*args)
        except Exception:
            connections.close_all()  # the next call starts from a fresh connection
            raise

    async def aclose(self) -> None:
        """Close the thread's connection after the work already queued; never blocks
        the event loop on it."""
        from django.db import connections

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, connections.close_all)
        finally:
            self._executor.shutdown(wait=False)
