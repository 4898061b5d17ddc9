"""worker.py alone: its CPU per relayed chunk and per non-streaming request.

A focused measurement for optimising the worker, without a ModelRelay server (whose
cost dominates a full run's CPU): a scripted relay (``websockets.serve`` in this
process) assigns requests to one real ``worker.py`` process in front of the fake
upstream (``bench/upstream.py``), and the worker's utime+stime is read from
``/proc`` over the steady part of the load::

    python bench/worker_path.py                     # both loads below
    python bench/worker_path.py --streams 250 --rate 20 --tokens 100
    python bench/worker_path.py --only unary --requests 3000 --concurrency 32

- *streams*: ``--streams`` concurrent streaming requests of ``--tokens`` tokens at
  ``--rate`` tokens/s, started over one second; CPU over the window where all run,
  divided by the ``response_chunk`` frames received in it;
- *unary*: ``--requests`` non-streaming requests, ``--concurrency`` in flight.

Every stream's chunks are checked to form the upstream's exact SSE body (each token
once, in order, ``data: [DONE]`` last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from bench.procs import TICK, CpuMeter, Processes  # noqa: E402
from bench.targets import project_python  # noqa: E402
from relay.wire.protocol import (  # noqa: E402
    Register,
    RegisterAck,
    Request,
    ResponseChunk,
    ResponseComplete,
    decode_worker_message,
    encode,
)

BODY = '{{"model":"bench-model","messages":[{{"role":"user","content":"hi"}}]{extra}}}'


class Relay:
    """The relay's side of one worker connection, scripted."""

    def __init__(self) -> None:
        self.ws: ServerConnection | None = None
        self.ready = asyncio.Event()
        self.chunks: dict[str, list[str]] = {}
        self.done: dict[str, asyncio.Future[ResponseComplete]] = {}
        self.arrivals: list[float] = []

    async def handle(self, ws: ServerConnection) -> None:
        async for raw in ws:
            message = decode_worker_message(raw)
            if isinstance(message, ResponseChunk):
                self.chunks.setdefault(message.request_id, []).append(message.chunk)
                self.arrivals.append(time.monotonic())
            elif isinstance(message, ResponseComplete):
                self.done[message.request_id].set_result(message)
            elif isinstance(message, Register):
                await ws.send(encode(RegisterAck(worker_id="w", models=message.models)))
                self.ws = ws
                self.ready.set()

    async def ask(self, rid: str, *, stream: bool, tokens: int = 0) -> ResponseComplete:
        assert self.ws is not None
        extra = f',"stream":true,"max_tokens":{tokens}' if stream else ""
        self.done[rid] = asyncio.get_running_loop().create_future()
        await self.ws.send(
            encode(
                Request(
                    request_id=rid,
                    model="bench-model",
                    endpoint_path="/v1/chat/completions",
                    is_streaming=stream,
                    body=BODY.format(extra=extra),
                    headers={"content-type": "application/json"},
                )
            )
        )
        return await self.done[rid]


def _user_system(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def _intact(text: str, tokens: int) -> bool:
    events = [e for e in text.split("\n\n") if e]
    found = [e for e in events if '" t' in e]
    in_order = all(f'" t{i}@' in e for i, e in enumerate(found))
    return len(found) == tokens and in_order and events[-1] == "data: [DONE]"


async def streams(
    relay: Relay, worker_pid: int, count: int, tokens: int, rate: float
) -> dict[str, Any]:
    ramp = 1.0
    duration = tokens / rate

    async def one(i: int) -> ResponseComplete:
        await asyncio.sleep(ramp * i / count)
        return await relay.ask(f"s{i}", stream=True, tokens=tokens)

    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    await asyncio.sleep(ramp + 0.5)
    meter = CpuMeter({"worker": [worker_pid]}).start()
    u0, s0 = _user_system(worker_pid)
    t0 = time.monotonic()
    await asyncio.sleep(max(0.5, duration - 1.0))
    meter.stop()
    u1, s1 = _user_system(worker_pid)
    t1 = time.monotonic()
    completes = await asyncio.gather(*tasks)
    in_window = sum(1 for t in relay.arrivals if t0 <= t <= t1)
    intact = sum(
        1
        for i, c in enumerate(completes)
        if c.status_code == 200 and _intact("".join(relay.chunks.get(f"s{i}", [])), tokens)
    )
    used = meter.used["worker"]
    return {
        "load": f"{count} streams x {rate:g} tokens/s",
        "intact": f"{intact}/{count}",
        "chunks_per_s": round(in_window / meter.wall),
        "worker_cores": round(used / meter.wall, 3),
        "us_per_chunk": round(1e6 * used / in_window, 1) if in_window else None,
        "system_share": round((s1 - s0) / ((u1 - u0) + (s1 - s0) or 1), 2),
    }


async def unary(relay: Relay, worker_pid: int, count: int, concurrency: int) -> dict[str, Any]:
    async def client(first: int) -> None:
        for i in range(first, count, concurrency):
            complete = await relay.ask(f"u{i}", stream=False)
            assert complete.status_code == 200, complete

    await asyncio.gather(*(client(i) for i in range(min(concurrency, 50))))  # warm-up
    relay.done.clear()
    meter = CpuMeter({"worker": [worker_pid]}).start()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    meter.stop()
    used = meter.used["worker"]
    return {
        "load": f"{count} non-streaming requests, {concurrency} in flight",
        "requests_per_s": round(count / meter.wall),
        "worker_cores": round(used / meter.wall, 3),
        "us_per_request": round(1e6 * used / count, 1),
    }


async def run(args: argparse.Namespace, procs: Processes) -> list[dict[str, Any]]:
    up = procs.start(
        "upstream",
        [project_python(), "-m", "bench.upstream", "--token-rate", str(args.rate)],
        cwd=ROOT,
    )
    upstream = up.wait_for_line(r"upstream listening on (http://\S+)", timeout=30).group(1)
    relay = Relay()
    async with serve(relay.handle, "127.0.0.1", 0, compression=None, max_size=2**26) as server:
        port = server.sockets[0].getsockname()[1]
        worker = procs.start(
            "worker",
            [
                project_python(),
                "worker.py",
                "--proxy-url",
                f"http://127.0.0.1:{port}",
                "--worker-secret",
                "bench",
                "--backend-url",
                upstream,
                "--models",
                "bench-model",
                "--max-concurrent",
                "1024",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )
        async with asyncio.timeout(30):
            await relay.ready.wait()
        out = []
        for round_ in range(args.repeat):
            if args.only in ("all", "streams"):
                relay.chunks.clear()
                relay.arrivals.clear()
                result = await streams(relay, worker.pid, args.streams, args.tokens, args.rate)
                out.append({"round": round_ + 1, **result})
            if args.only in ("all", "unary"):
                result = await unary(relay, worker.pid, args.requests, args.concurrency)
                out.append({"round": round_ + 1, **result})
        procs.stop(worker)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("all", "streams", "unary"), default="all")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds (the lowest CPU is the least disturbed)"
    )
    args = p.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="worker-path-") as tmp, Processes(Path(tmp)) as procs:
        for result in asyncio.run(run(args, procs)):
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
