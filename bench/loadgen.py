"""The asyncio load generator's scenarios, on :class:`bench.connection.Connection`.

One connection per simulated client, one request at a time on it. Timing uses
``time.monotonic_ns`` (``CLOCK_MONOTONIC``, the clock ``bench/upstream.py`` stamps its
tokens with).

- :func:`closed_loop`: ``connections`` clients each sending back to back for a duration;
- :func:`sequential`: one client, one request in flight;
- :func:`streams`: ``count`` concurrent streaming requests whose token chunks are timed
  and checked (every token, in order, then ``data: [DONE]``);
- :class:`Holder`: open many requests and keep them waiting (the queue scenario).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

from bench.connection import Connection, HttpError, Response, chat_request

_TOKEN = re.compile(rb" t(\d+)@(\d+)")


@dataclass
class UnaryResult:
    latencies_us: list[float]
    errors: int
    elapsed: float
    statuses: dict[int, int] = field(default_factory=dict)
    sample_body: bytes = b""

    @property
    def rate(self) -> float:
        return len(self.latencies_us) / self.elapsed if self.elapsed else 0.0


async def closed_loop(
    host: str, port: int, raw: bytes, *, connections: int, duration: float, count: int = 0
) -> UnaryResult:
    """``connections`` clients back to back for ``duration`` s (or ``count`` requests each)."""
    conns = [await Connection.open(host, port) for _ in range(connections)]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0
    sample = b""
    start = time.monotonic()
    deadline = start + duration

    async def client(conn: Connection) -> None:
        nonlocal errors, sample
        done = 0
        while (time.monotonic() < deadline) if not count else done < count:
            t0 = time.monotonic_ns()
            try:
                resp = await conn.request(raw)
            except HttpError:
                errors += 1
                return
            latencies.append((time.monotonic_ns() - t0) / 1000)
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status != 200:
                errors += 1
            elif not sample:
                sample = bytes(resp.body)
            done += 1

    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        for conn in conns:
            conn.close()
    return UnaryResult(latencies, errors, time.monotonic() - start, statuses, sample)


async def sequential(host: str, port: int, raw: bytes, count: int) -> UnaryResult:
    """One client, one request in flight, ``count`` requests."""
    return await closed_loop(host, port, raw, connections=1, duration=0, count=count)


@dataclass
class StreamResult:
    streams: int
    intact: int
    delays_us: list[float]  # upstream write -> client read, per token chunk
    gaps_us: list[float]  # between consecutive token chunks at the client
    chunks: int  # SSE events received, all streams
    problems: dict[str, int]
    elapsed: float
    #: When each token chunk arrived (``CLOCK_MONOTONIC`` µs), all streams.
    arrivals_us: list[int] = field(default_factory=list)


class _StreamCheck:
    """Splits one stream's body into SSE events and checks and times its tokens."""

    __slots__ = (
        "arrivals",
        "buf",
        "delays",
        "done",
        "events",
        "expected",
        "gaps",
        "last",
        "ok",
        "problem",
    )

    def __init__(self, delays: list[float], gaps: list[float], arrivals: list[int]) -> None:
        self.buf = b""
        self.expected = 0
        self.last = 0
        self.events = 0
        self.done = False
        self.ok = True
        self.problem = ""
        self.delays = delays
        self.gaps = gaps
        self.arrivals = arrivals

    def feed(self, data: bytes, now_ns: int) -> None:
        buf = self.buf + data if self.buf else data
        now_us = now_ns // 1000
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[:end], buf[end + 2 :]
            self.events += 1
            if self.done:
                self._fail("data after [DONE]")
            if event == b"data: [DONE]":
                self.done = True
                continue
            match = _TOKEN.search(event)
            if match is None:
                continue
            index, stamp = int(match.group(1)), int(match.group(2))
            if index != self.expected:
                self._fail("token out of order or missing")
            self.expected = index + 1
            self.delays.append(now_us - stamp)
            self.arrivals.append(now_us)
            if self.last:
                self.gaps.append(now_us - self.last)
            self.last = now_us
        self.buf = buf

    def _fail(self, problem: str) -> None:
        if self.ok:
            self.ok, self.problem = False, problem


async def streams(
    host: str, port: int, *, count: int, tokens: int, ramp: float, limit: float
) -> StreamResult:
    """``count`` concurrent streams of ``tokens`` tokens, started evenly over ``ramp`` s.

    Streams still running after ``limit`` seconds are cancelled and counted as broken.
    """
    raw = chat_request(host, port, stream=True, max_tokens=tokens)
    delays: list[float] = []
    gaps: list[float] = []
    arrivals: list[int] = []
    problems: dict[str, int] = {}
    intact = 0
    chunks = 0

    async def one(i: int) -> None:
        nonlocal intact, chunks
        await asyncio.sleep(ramp * i / count)
        check = _StreamCheck(delays, gaps, arrivals)
        try:
            conn = await Connection.open(host, port)
        except OSError as exc:
            problems[f"connect: {exc.__class__.__name__}"] = (
                problems.get(f"connect: {exc.__class__.__name__}", 0) + 1
            )
            return
        try:
            resp = await conn.request(raw, on_body=check.feed)
        except HttpError as exc:
            check._fail(str(exc))
            resp = None
        finally:
            conn.close()
        chunks += check.events
        if resp is not None and resp.status != 200:
            check._fail(f"HTTP {resp.status}")
        elif check.expected != tokens:
            check._fail("stream ended early")
        elif not check.done:
            check._fail("no [DONE]")
        if check.ok:
            intact += 1
        else:
            problems[check.problem] = problems.get(check.problem, 0) + 1

    start = time.monotonic()
    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=limit)
        if pending:
            problems["timed out"] = len(pending)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    elapsed = time.monotonic() - start
    return StreamResult(count, intact, delays, gaps, chunks, problems, elapsed, arrivals)


class Holder:
    """Many requests sent and left waiting (nothing is read until :meth:`close`)."""

    def __init__(self) -> None:
        self.conns: list[Connection] = []
        self.waits: list[asyncio.Future[Response]] = []

    async def open(self, host: str, port: int, raw: bytes, count: int, batch: int = 100) -> None:
        for first in range(0, count, batch):
            opened = await asyncio.gather(
                *(Connection.open(host, port) for _ in range(min(batch, count - first)))
            )
            for conn in opened:
                self.conns.append(conn)
                self.waits.append(asyncio.ensure_future(conn.request(raw)))
            await asyncio.sleep(0)

    def answered(self) -> int:
        return sum(1 for w in self.waits if w.done())

    async def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for wait in self.waits:
            wait.cancel()
        if self.waits:
            await asyncio.wait(self.waits)
        self.conns.clear()
        self.waits.clear()


def now_us() -> int:
    """``CLOCK_MONOTONIC`` in µs, the clock of the stream checks' arrival times."""
    return time.monotonic_ns() // 1000


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(pct / 100 * len(ordered)) - 1))
    return ordered[rank]
