"""(k) What cache-aware routing costs Redis in cluster mode, and what a shared index would.

Measured against a live Redis with redis-py (one connection, sequential calls, the
round trip included): the placement script (:data:`relay.server.cluster.scripts.PLACE`)
over four live workers without a conversation anchor (least-load) and with one (the
conversation's worker read and written back: what cluster mode does), and the least a
*shared block index* would add to it: for a 32 KB prompt (30 blocks of 1 KiB) read the
30 entries, write them back, and keep them in an LRU sorted set trimmed to a bound.

Usage: ``python -m bench.affinity_redis [--calls N]`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from typing import Any

import redis

from relay.server.cluster.scripts import PLACE

SHARED_INDEX = """
local idx, lru, worker, cap = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local held = redis.call('HMGET', idx, unpack(ARGV, 3))
local now = redis.call('INCR', lru .. ':clock')
for i = 3, #ARGV do
  redis.call('HSET', idx, ARGV[i], worker)
  redis.call('ZADD', lru, now, ARGV[i])
end
local over = redis.call('ZCARD', lru) - cap
if over > 0 then
  for _, old in ipairs(redis.call('ZRANGE', lru, 0, over - 1)) do
    redis.call('HDEL', idx, old)
  end
  redis.call('ZREMRANGEBYRANK', lru, 0, over - 1)
end
return #held
"""


def _setup(client: redis.Redis, prefix: str, workers: int) -> None:
    for i in range(workers):
        wid, proc = f"w{i}", f"p{i % 2}"
        client.set(f"{prefix}:proc:{proc}", "http://127.0.0.1:1")
        client.sadd(f"{prefix}:pw:{proc}", wid)
        client.hset(
            f"{prefix}:w:{wid}",
            mapping={"proc": proc, "max": 64, "draining": "0", "picky": "0", "provider": "p"},
        )
        client.sadd(f"{prefix}:wm:{wid}", "m")
        client.sadd(f"{prefix}:m:p:m", wid)


def _per_call(client: redis.Redis, fn: Any, calls: int) -> dict[str, float]:
    """Round trip seen by the client, and Redis's own CPU per script call
    (``INFO commandstats``: what other users of the machine disturb least)."""
    client.config_resetstat()
    started = time.perf_counter()
    for i in range(calls):
        fn(i)
    wall = (time.perf_counter() - started) / calls
    stats = client.info("commandstats")
    ran = stats.get("cmdstat_evalsha", {})
    return {
        "round_trip_us": round(wall * 1e6, 1),
        "redis_cpu_us": round(float(ran.get("usec_per_call", 0.0)), 1),
    }


def measure(url: str = "redis://127.0.0.1:6379/0", calls: int = 2000) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    prefix = f"bench-affinity-{secrets.token_hex(4)}"
    try:
        _setup(client, prefix, 4)
        place = client.register_script(PLACE)
        index = client.register_script(SHARED_INDEX)
        anchors = [secrets.token_hex(8) for _ in range(64)]
        blocks = [secrets.token_hex(8) for _ in range(30)]

        def placed(i: int, anchor: str) -> None:
            now = 10 * (i + 1) + int(time.time() * 1000)
            place(
                args=[
                    prefix, "p", "m", now, f"e{i}", 1, "p0", now + 1000, 0, 100, "1",
                    "default:anon", 1, 1, "default", anchor, 1.25, 60_000,
                ]
            )  # fmt: skip

        placed(0, "")  # loads the scripts
        index(keys=[f"{prefix}:idx", f"{prefix}:lru"], args=["w0", 100_000, *blocks])
        least = _per_call(client, lambda i: placed(i, ""), calls)
        anchored = _per_call(client, lambda i: placed(i, anchors[i % 64]), calls)
        shared = _per_call(
            client,
            lambda i: index(
                keys=[f"{prefix}:idx", f"{prefix}:lru"], args=[f"w{i % 4}", 100_000, *blocks]
            ),
            calls,
        )
        return {
            "calls": calls,
            "place_least_load_us": least,
            "place_anchor_us": anchored,
            "shared_index_extra_us": shared,
            "redis_version": client.info("server")["redis_version"],
        }
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(measure(calls=args.calls), indent=1))


if __name__ == "__main__":
    main()
