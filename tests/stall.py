"""How long an input keeps the event loop from serving anyone else, measured two ways.

Every input path (a route, a frame, a file, a batch line) is tested with the largest
input it accepts, and the longest stall it causes is asserted to stay under
:data:`STALL_BUDGET_MS`:

- :class:`LoopStalls`, in the test's own event loop (the ASGI app or the core run
  in-process): a ticker wakes every millisecond and records how late it woke. Work the
  loop runs in one go, or a thread that holds the GIL, shows up as lateness.
- :class:`HealthProbe`, against a live server: a thread asks ``GET /health`` over and
  over on one keep-alive connection and records the slowest answer. The server's loop
  answers ``/health`` itself, so a slow answer is a loop that was busy elsewhere.

Both report the longest stall in milliseconds. Neither sleeps to wait for anything.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType

import httpx

#: The longest an input may keep the loop busy (DEVELOPERS: "under 20 ms").
STALL_BUDGET_MS = 20.0


class LoopStalls:
    """``async with LoopStalls() as stalls: ...`` then ``stalls.longest_ms``."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.longest_ms = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopStalls:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker runs before the measured work starts
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self.interval)
            now = loop.time()
            late = (now - last - self.interval) * 1000
            self.longest_ms = max(self.longest_ms, late)
            self.ticks += 1
            last = now


class HealthProbe:
    """``with HealthProbe(server.url) as probe: ...`` then ``probe.longest_ms``: the
    slowest ``GET /health`` while the block ran (at least ``min_samples`` asked)."""

    def __init__(self, base_url: str, *, min_samples: int = 20) -> None:
        self.url = base_url.rstrip("/") + "/health"
        self.min_samples = min_samples
        self.samples: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._enough = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health probe", daemon=True)

    @property
    def longest_ms(self) -> float:
        return max(self.samples, default=0.0)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # At least a few answers, so that "no stall" is a measure and not an absence.
        self._enough.wait(timeout=30)
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    client.get(self.url)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.samples.append((time.perf_counter() - started) * 1000)
                if len(self.samples) >= self.min_samples:
                    self._enough.set()
