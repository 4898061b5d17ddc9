"""Many idle workers on one process: connect, register, answer pings, nothing else.

Each connection speaks the real protocol (``register`` → ``register_ack``, ``ping`` →
``pong``) with the same WebSocket settings as ``worker.py`` (its own keepalive pings
every 20 s, no compression), so the server pays what an idle GPU box costs it. A
request sent to one of these workers is never answered (they advertise
``--models``; the queue scenario relies on that).

Prints ``registered <n>`` when all are registered, then runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from websockets.asyncio.client import ClientConnection, connect


async def _worker(
    url: str, secret: str, name: str, models: list[str], max_concurrent: int, ready: asyncio.Event
) -> None:
    async with connect(
        url,
        additional_headers={"X-Worker-Secret": secret},
        compression=None,
        ping_interval=20,
        ping_timeout=20,
        max_size=64 * 1024 * 1024,
        open_timeout=60,
    ) as ws:
        register = {
            "type": "register",
            "worker_name": name,
            "models": models,
            "max_concurrent": max_concurrent,
            "protocol_version": "1",
            "current_load": 0,
        }
        await ws.send(json.dumps(register))
        await _serve(ws, ready)


async def _serve(ws: ClientConnection, ready: asyncio.Event) -> None:
    load = 0
    async for raw in ws:
        message = json.loads(raw)
        kind = message.get("type")
        if kind == "register_ack":
            ready.set()
        elif kind == "ping":
            await ws.send(json.dumps({"type": "pong", "current_load": load}))
        elif kind == "request":
            load += 1  # held: never answered
        elif kind == "cancel":
            load = max(0, load - 1)


async def main_async(a: argparse.Namespace) -> None:
    url = a.url.rstrip("/") + "/v1/worker/connect?provider=" + a.provider
    models = [m for m in a.models.split(",") if m]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    readies = [asyncio.Event() for _ in range(a.count)]
    tasks: list[asyncio.Task[None]] = []
    gate = asyncio.Semaphore(a.parallel)

    async def one(i: int) -> None:
        async with gate:
            task = asyncio.ensure_future(
                _worker(url, a.secret, f"{a.prefix}{i}", models, a.max_concurrent, readies[i])
            )
            tasks.append(task)
            waiter = asyncio.ensure_future(readies[i].wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    try:
        await asyncio.gather(*(one(i) for i in range(a.count)))
        registered = sum(1 for r in readies if r.is_set())
        print(f"registered {registered}", flush=True)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            print(f"failed {len(failed)}: {failed[0].exception()!r}", flush=True)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="relay base URL, ws://host:port")
    p.add_argument("--secret", required=True)
    p.add_argument("--provider", default="local")
    p.add_argument("--count", type=int, default=500)
    p.add_argument("--prefix", default="idle-")
    p.add_argument("--models", default="bench-idle-model")
    p.add_argument("--max-concurrent", type=int, default=1)
    p.add_argument("--parallel", type=int, default=50, help="connections opened at once")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
