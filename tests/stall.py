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

A stall is what the measured process does to itself — work on its loop, a thread that
holds the GIL, a blocking call — not the time the operating system gave its core to
other processes: on a shared two-core machine (another test run, a build) a loop thread
that is ready to run may wait its turn for several milliseconds. The kernel counts that
wait per thread (``/proc/<pid>/task/<tid>/schedstat``: time runnable but not running),
so both meters take it out of each gap they measure; ``longest_wall_ms`` keeps the raw
figure. Where the kernel does not say, the raw figure is all there is.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType

import httpx

#: The longest an input may keep the loop busy (DEVELOPERS: "under 20 ms").
STALL_BUDGET_MS = 20.0


def run_queue_clock(pid: int, tid: int) -> Callable[[], float] | None:
    """Seconds thread ``tid`` of process ``pid`` has spent runnable but not running
    (waiting for a core other processes held), as a function to call for the current
    total; None where the kernel does not tell."""
    try:
        fd = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
    except OSError:
        return None

    def waited() -> float:
        try:
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    return waited


class LoopStalls:
    """``async with LoopStalls() as stalls: ...`` then ``stalls.longest_ms``."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.longest_ms = 0.0
        #: The same without taking out the time other processes held the core.
        self.longest_wall_ms = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None
        self._waited: Callable[[], float] | None = None

    async def __aenter__(self) -> LoopStalls:
        # (Read in the loop's own thread: the ticker below runs there.)
        self._waited = run_queue_clock(os.getpid(), threading.get_native_id())
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
        waited = self._waited or (lambda: 0.0)
        last, last_waited = loop.time(), waited()
        while True:
            await asyncio.sleep(self.interval)
            now, now_waited = loop.time(), waited()
            late = (now - last - self.interval) * 1000
            self.longest_wall_ms = max(self.longest_wall_ms, late)
            self.longest_ms = max(self.longest_ms, late - (now_waited - last_waited) * 1000)
            self.ticks += 1
            last, last_waited = now, now_waited


class HealthProbe:
    """``with HealthProbe(server.url) as probe: ...`` then ``probe.longest_ms``: the
    slowest ``GET /health`` while the block ran (at least ``min_samples`` asked)."""

    def __init__(self, base_url: str, *, pid: int | None = None, min_samples: int = 20) -> None:
        """``pid``: the server's process (its loop runs in its main thread), so that the
        time other processes held the server's core is not counted as its stall."""
        self.url = base_url.rstrip("/") + "/health"
        self.pid = pid
        self.min_samples = min_samples
        self.samples: list[float] = []
        self.wall_samples: list[float] = []
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
        clocks = [run_queue_clock(os.getpid(), threading.get_native_id())]
        if self.pid is not None:
            clocks.append(run_queue_clock(self.pid, self.pid))

        def waited() -> float:
            return sum(clock() for clock in clocks if clock is not None)

        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started, before = time.perf_counter(), waited()
                try:
                    client.get(self.url)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                wall = (time.perf_counter() - started) * 1000
                self.wall_samples.append(wall)
                self.samples.append(max(0.0, wall - (waited() - before) * 1000))
                if len(self.samples) >= self.min_samples:
                    self._enough.set()
