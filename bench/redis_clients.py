"""CPU per per-request Redis script call: the lean client against redis-py (with and
without hiredis), on 127.0.0.1. Prints one JSON line per client.

    .venv/bin/python bench/redis_clients.py                 # the clients installed here
    python bench/redis_clients.py --clients redis-py        # e.g. from a venv with hiredis

The script is the cluster's placing script (relay/server/cluster/scripts.py) on a worker
with free slots, so each call does what a request does; calls run one at a time
(``sequential``) and 32 at once (``concurrent``, how a busy process issues them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

URL = "redis://127.0.0.1:6379/0"


def _args(prefix: str, n: int) -> list[Any]:
    return [
        prefix,
        "p",
        "m",
        int(time.time() * 1000),
        f"i|r-{n}",
        15000,
        "i",
        0,
        0,
        -1,
        "1",
        "anon",
        1,
        60000,
    ]


async def _setup(prefix: str) -> None:
    import redis.asyncio as aioredis

    async with aioredis.from_url(URL) as r:
        await r.set(f"{prefix}:proc:i", "http://x", px=600_000)
        await r.sadd(f"{prefix}:pw:i", "w1")
        await r.hset(
            f"{prefix}:w:w1",
            mapping={"proc": "i", "provider": "p", "max": 10**9, "draining": "0", "picky": "0"},
        )
        await r.sadd(f"{prefix}:wm:w1", "m")
        await r.sadd(f"{prefix}:m:p:m", "w1")


async def _cleanup(prefix: str) -> None:
    import redis.asyncio as aioredis

    async with aioredis.from_url(URL) as r:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*")]
        if keys:
            await r.delete(*keys)


async def _measure(call: Any, prefix: str, count: int, concurrency: int) -> float:
    """Process CPU seconds per call."""
    for n in range(200):  # warm up: connection, script loaded
        await call(args=_args(prefix, -n - 1))
    started = time.process_time()
    done = 0
    while done < count:
        batch = min(concurrency, count - done)
        await asyncio.gather(*(call(args=_args(prefix, done + k)) for k in range(batch)))
        done += batch
    return (time.process_time() - started) / count


async def run(client: str, count: int) -> dict[str, Any]:
    from relay.server.cluster import scripts

    prefix = f"bench-{secrets.token_hex(4)}"
    await _setup(prefix)
    try:
        if client == "lean":
            from relay.server.cluster.leanredis import LeanRedis, Script

            lean = LeanRedis(URL)
            call: Any = Script(lean, scripts.PLACE)
            closer: Any = lean.aclose
        else:
            import redis.asyncio as aioredis

            r = aioredis.from_url(URL, socket_timeout=5)
            call = r.register_script(scripts.PLACE)
            closer = r.aclose
        try:
            sequential = await _measure(call, prefix, count, 1)
            concurrent = await _measure(call, prefix, count, 32)
        finally:
            await closer()
    finally:
        await _cleanup(prefix)
    parser = "-"
    if client == "redis-py":
        from redis.utils import HIREDIS_AVAILABLE

        parser = "hiredis" if HIREDIS_AVAILABLE else "python"
    return {
        "client": client,
        "parser": parser,
        "calls": count,
        "sequential_us": round(sequential * 1e6, 1),
        "concurrent_us": round(concurrent * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="lean,redis-py")
    parser.add_argument("--count", type=int, default=5000)
    args = parser.parse_args()
    for client in args.clients.split(","):
        print(json.dumps(asyncio.run(run(client, args.count))), flush=True)


if __name__ == "__main__":
    main()
