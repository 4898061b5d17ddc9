"""What per-key limits and fair queueing cost per request (SPEC §13): a micro-benchmark.

Usage::

    python bench/limits.py                      # in-process figures
    python bench/limits.py --redis redis://127.0.0.1:6379/0   # plus the Redis round trip

Measures, in this process, on the relay core the server runs:

- *admission*: ``Limiter.admit`` and ``Ticket.close`` for a key with every counted
  limit set (in-memory store), reserving :data:`RESERVE` tokens against its budgets and
  settling them — what the HTTP edge adds before ``submit``;
- *dispatcher*: ``submit`` + completion of one request through the real dispatcher and
  a worker that answers at once, without a key, and with admission, ticket and the
  per-key observer (the difference is what the limits add to a request);
- *fair queue*: ``push`` + ``pop_for`` per request with 100 keys backlogged (10,000
  waiting);
- with ``--redis``: the admission round trip to Redis (p50, p99).

Each figure is the median of ``--rounds`` rounds; the machine's load average is
printed with them, since other work on the box inflates every figure. ``make test``
never runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relay.core.config import ProviderPolicy, RelayConfig  # noqa: E402
from relay.core.fairqueue import FairQueue  # noqa: E402
from relay.core.keystats import KeyStats  # noqa: E402
from relay.core.limits import KeyLimits, Limiter, Ticket  # noqa: E402
from relay.core.limitstore import MemoryLimitStore  # noqa: E402
from relay.core.relay import Relay  # noqa: E402
from relay.core.state import RelayRequest  # noqa: E402
from relay.wire import protocol  # noqa: E402

LIMITS = KeyLimits(
    max_concurrent=1_000_000,
    requests_per_minute=1_000_000_000,
    tokens_per_day=10**15,
    tokens_per_month=10**15,
    allowed_models=frozenset({"m", "n"}),
    expires_at=time.time() + 86_400,
    weight=2,
)
COUNTS = protocol.TokenCounts(prompt_tokens=10, completion_tokens=20)
#: What each request may cost (its max_tokens and prompt), reserved while it runs.
RESERVE = 256


class _Link:
    def send(self, message: object) -> None:
        pass

    def close(self, code: int, reason: str) -> None:
        pass


def _per_request(seconds: float, n: int) -> float:
    return seconds / n * 1e6


async def admission(n: int) -> float:
    limiter = Limiter(MemoryLimitStore())
    keys = 100
    start = time.perf_counter()
    for i in range(n):
        ticket = await limiter.admit(i % keys, LIMITS, "m", RESERVE)
        ticket.close(COUNTS)
    return _per_request(time.perf_counter() - start, n)


async def dispatcher(n: int, *, with_ticket: bool) -> float:
    config = RelayConfig()
    relay = Relay(config, instance="bench")
    relay.set_provider(ProviderPolicy.from_overrides(config, "local"))
    worker, _ = relay.attach_worker(
        provider="local",
        name="w",
        models=["m"],
        max_concurrent=1,
        current_load=0,
        link=_Link(),
    )
    limiter = Limiter(MemoryLimitStore())
    if with_ticket:  # the per-key figures the runtime keeps, as it does
        relay.observers.append(KeyStats().observe)
    start = time.perf_counter()
    for i in range(n):
        ticket = await limiter.admit(i % 100, LIMITS, "m", RESERVE) if with_ticket else None
        request = relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=False,
            body='{"model":"m"}',
            headers={},
            key_id=i % 100 if with_ticket else None,
            ticket=ticket,
        )
        relay.on_complete(
            worker,
            protocol.ResponseComplete(
                request_id=request.id, status_code=200, headers={}, body="{}", token_counts=COUNTS
            ),
        )
    elapsed = time.perf_counter() - start
    await relay.aclose()
    return _per_request(elapsed, n)


class _Tickets:
    def finished(self, ticket: Ticket, tokens: int) -> None:
        pass


def fair_queue(n: int, keys: int = 100, backlog: int = 10_000) -> float:
    def make(seq: int) -> RelayRequest:
        request = RelayRequest(
            id=str(seq),
            seq=seq,
            provider="local",
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=False,
            body="",
            headers={},
            key_id=seq % keys,
            created_wall=0.0,
            now=0.0,
            deadline=1.0,
        )
        request.ticket = Ticket(_Tickets(), seq % keys, 1 + seq % 3, held=False)  # type: ignore[arg-type]
        return request

    queue = FairQueue()
    seq = 0
    for seq in range(backlog):
        queue.push(make(seq))
    fresh = [make(backlog + i) for i in range(n)]
    models = frozenset({"m", "other"})
    start = time.perf_counter()
    for request in fresh:
        queue.push(request)
        queue.pop_for(models)
    return _per_request(time.perf_counter() - start, n)


async def redis_round_trip(url: str, n: int) -> tuple[float, float, float]:
    """Admission against Redis: p50 and p99 in µs, and Redis commands sent per
    admission (counted at the client, ticket closes excluded: they are batched off
    the request path)."""
    from relay.server.cluster.limits import RedisLimitStore

    prefix = f"bench-{secrets.token_hex(4)}"
    store = RedisLimitStore(url, prefix, "bench")
    limiter = Limiter(store)
    task = asyncio.get_running_loop().create_task(store.run())
    samples = []
    commands = 0
    # Both clients: redis-py, and the lean one the admission script runs on.
    clients: list[tuple[Any, str]] = [(store.redis, "execute_command")]
    if store.lean is not None:
        clients.append((store.lean, "execute"))
    originals = [getattr(client, name) for client, name in clients]

    def counting(send: Any) -> Any:
        async def counted(*args: object, **kwargs: object) -> object:
            nonlocal commands
            commands += 1
            return await send(*args, **kwargs)

        return counted

    try:
        # One admission first, uncounted: the scripts are loaded into Redis once per
        # connection (NOSCRIPT, then SCRIPT LOAD), not per request.
        tickets = [await limiter.admit(0, LIMITS, "m", RESERVE)]
        for (client, name), send in zip(clients, originals, strict=True):
            setattr(client, name, counting(send))
        for i in range(n):
            start = time.perf_counter()
            tickets.append(await limiter.admit(i % 100, LIMITS, "m", RESERVE))
            samples.append((time.perf_counter() - start) * 1e6)
        for (client, name), send in zip(clients, originals, strict=True):
            setattr(client, name, send)
        for ticket in tickets:
            ticket.close(COUNTS)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cleaner = RedisLimitStore(url, prefix, "cleaner")
        keys = [k async for k in cleaner.redis.scan_iter(match=f"{prefix}:*")]
        if keys:
            await cleaner.redis.delete(*keys)
        await cleaner.redis.aclose()
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)], commands / n


async def measure(n: int, rounds: int, redis_url: str | None) -> dict[str, float]:
    """Every figure above, each the median of ``rounds`` rounds (µs per request)."""
    admit = [await admission(n) for _ in range(rounds)]
    bare, keyed = [], []
    for _ in range(rounds * 2):  # interleaved, so drifting load hits both alike
        bare.append(await dispatcher(n, with_ticket=False))
        keyed.append(await dispatcher(n, with_ticket=True))
    queue = [fair_queue(n) for _ in range(rounds)]
    out = {
        "admission_us": statistics.median(admit),
        "dispatch_bare_us": statistics.median(bare),
        "dispatch_keyed_us": statistics.median(keyed),
        "added_us": statistics.median(k - b for k, b in zip(keyed, bare, strict=True)),
        "fair_queue_us": statistics.median(queue),
        "load_average": os.getloadavg()[0],
    }
    if redis_url:
        p50, p99, per_request = await redis_round_trip(redis_url, min(n, 5_000))
        out.update(redis_p50_us=p50, redis_p99_us=p99, redis_commands_per_request=per_request)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis", help="also measure the admission round trip to this Redis")
    args = parser.parse_args()

    figures = await measure(args.n, args.rounds, args.redis)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load}")
    print(f"admission (admit + close, every limit set)      {figures['admission_us']:6.2f} µs")
    print(f"dispatcher, submit + completion, no key         {figures['dispatch_bare_us']:6.2f} µs")
    print(f"dispatcher, submit + completion, with admission {figures['dispatch_keyed_us']:6.2f} µs")
    print(f"  added by the limits                           {figures['added_us']:6.2f} µs")
    print(f"fair queue push + pop_for, 100 keys, 10k queued {figures['fair_queue_us']:6.2f} µs")
    if args.redis:
        print(
            f"Redis admission round trip                      {figures['redis_p50_us']:6.1f} µs "
            f"p50, {figures['redis_p99_us']:.1f} µs p99, "
            f"{figures['redis_commands_per_request']:.3f} commands per request"
        )


if __name__ == "__main__":
    asyncio.run(main())
