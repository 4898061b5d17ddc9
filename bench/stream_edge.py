"""The streamed chunk path of one server process, in process: CPU per chunk.

Usage::

    python bench/stream_edge.py                 # prints the figures
    python bench/stream_edge.py --streams 200 --chunks 100 --rounds 7

``--streams`` concurrent streams, each a chat/completions stream of ``--chunks`` token
events (the fake upstream's shape, about 190 bytes each) and ``data: [DONE]``, go through
the code a worker's chunk takes in the server: ``Relay.on_chunk`` (the frame handler),
the request's mailbox, and the HTTP edge's response loop
(:func:`relay.server.http.respond.respond`) writing to an ASGI ``send`` that returns at
once. Chunks are fed in rounds, one per stream, each round after the edges wrote the
previous one, as a worker streaming at its pace would. The figure is this process's
CPU time over the chunks delivered (the worker's completion and the request's end
included, spread over its chunks): what the relay's own Python costs per chunk, without
the ASGI server's or the socket's share. Medians of ``--rounds`` rounds; the load average
is printed with them, since other work on the box inflates every figure. ``make test``
never runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relay.core.config import ProviderPolicy, RelayConfig  # noqa: E402
from relay.core.relay import Relay  # noqa: E402
from relay.server.http.respond import respond  # noqa: E402
from relay.wire import protocol  # noqa: E402

COUNTS = protocol.TokenCounts(prompt_tokens=10, completion_tokens=20)
_CHUNK = (
    'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1700000000,'
    '"model":"bench-model","choices":[{"index":0,"delta":{"content":" t%d\u20ac"},'
    '"finish_reason":null}]}\n\n'
)
_DONE = "data: [DONE]\n\n"


class _Link:
    def send(self, message: object) -> None:
        pass

    def close(self, code: int, reason: str) -> None:
        pass


async def _send(message: Any) -> None:
    pass


async def _never() -> Any:
    await asyncio.Future()  # the client never leaves


async def stream_path(streams: int, chunks: int) -> float:
    """CPU µs per chunk of this process through the core and the edge."""
    config = RelayConfig()
    relay = Relay(config, instance="bench")
    relay.set_provider(ProviderPolicy.from_overrides(config, "local"))
    worker, _ = relay.attach_worker(
        provider="local",
        name="w",
        models=["m"],
        max_concurrent=streams,
        current_load=0,
        link=_Link(),
    )
    requests = [
        relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=True,
            body='{"model":"m","stream":true}',
            headers={},
        )
        for _ in range(streams)
    ]
    edges = [asyncio.ensure_future(respond(relay, r, _never, _send, [])) for r in requests]
    texts = [_CHUNK % i for i in range(chunks)] + [_DONE]
    await asyncio.sleep(0)
    start = time.process_time()
    for text in texts:
        for request in requests:
            relay.on_chunk(worker, request.id, text)
        await asyncio.sleep(0)  # each edge writes what it got
        await asyncio.sleep(0)
    for request in requests:
        relay.on_complete(
            worker,
            protocol.ResponseComplete(request_id=request.id, status_code=200, token_counts=COUNTS),
        )
    await asyncio.wait(edges)
    elapsed = time.process_time() - start
    assert all(r.status == 200 for r in requests)
    await relay.aclose()
    return elapsed / (streams * len(texts)) * 1e6


async def measure(streams: int, chunks: int, rounds: int) -> dict[str, float]:
    await stream_path(streams, min(chunks, 20))  # warm up
    figures = [await stream_path(streams, chunks) for _ in range(rounds)]
    return {
        "streams": streams,
        "chunks_per_stream": chunks + 1,
        "us_per_chunk": statistics.median(figures),
        "us_per_chunk_best": min(figures),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=100, help="token events per stream")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.streams, args.chunks, args.rounds))
    for key, value in figures.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
