"""The cluster link's client alone: its CPU per request and per relayed chunk.

Scenario (g) measures a cross-process request end to end, where both servers' HTTP
paths dominate the CPU; this isolates the part between them, the client of
``relay/server/cluster/peerhttp.py``. It sends the fake upstream (``bench/upstream.py``,
its own process, answering as the owning process's fast path does: a Content-Length
body, or a chunked event stream) requests over a :class:`PeerClient` from this
process, and divides this process's CPU time by what it received::

    python bench/peer_link.py                      # both loads below
    python bench/peer_link.py --only unary --requests 5000 --concurrency 32
    python bench/peer_link.py --compare ../main --repeat 8   # this tree against another

- *unary*: ``--requests`` non-streaming requests, ``--concurrency`` in flight, each
  read whole (``PeerResponse.read``): µs per request;
- *streams*: ``--streams`` concurrent streams of ``--tokens`` tokens at ``--rate``
  tokens/s, started over one second, each read as it arrives
  (``PeerResponse.chunks``); CPU over the window where all run, divided by the
  events (one per chunk the owning process writes) received in it: µs per chunk.
  Every stream is checked to end with ``data: [DONE]`` and to hold each token once,
  in order.

``--compare DIR`` loads ``DIR``'s ``peerhttp.py`` beside this tree's and alternates the
two, round after round, in this one process, then prints each one's median: on a
shared machine, runs of two separate processes minutes apart differ by more than two
versions of the client do.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import Processes  # noqa: E402
from bench.targets import project_python  # noqa: E402
from relay.server.cluster.peerhttp import PeerClient  # noqa: E402

PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}
BODY = '{{"model":"bench-model","messages":[{{"role":"user","content":"hi"}}]{extra}}}'


def _body(stream: bool, tokens: int = 0) -> bytes:
    extra = f',"stream":true,"max_tokens":{tokens}' if stream else ""
    return BODY.format(extra=extra).encode()


async def unary(client: PeerClient, url: str, count: int, concurrency: int) -> dict[str, Any]:
    body = _body(False)

    async def worker(first: int) -> None:
        for _ in range(first, count, concurrency):
            response = await client.post(url, PATH, HEADERS, body)
            try:
                assert response.status == 200 and (await response.read()).startswith(b"{")
            finally:
                response.release()

    await asyncio.gather(*(worker(i) for i in range(min(concurrency, 50))))  # warm-up
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    return {
        "load": f"{count} non-streaming requests, {concurrency} in flight",
        "requests_per_s": round(count / wall),
        "us_per_request": round(1e6 * cpu / count, 1),
    }


async def streams(
    client: PeerClient, url: str, count: int, tokens: int, rate: float
) -> dict[str, Any]:
    ramp, intact = 1.0, 0
    arrivals: list[tuple[float, int]] = []
    body = _body(True, tokens)

    async def one(i: int) -> None:
        nonlocal intact
        await asyncio.sleep(ramp * i / count)
        response = await client.post(url, PATH, HEADERS, body)
        pieces = []
        try:
            async for data in response.chunks():
                arrivals.append((time.monotonic(), data.count(b"\n\n")))
                pieces.append(data)
        finally:
            response.release()
        text = b"".join(pieces).decode()
        found = [e for e in text.split("\n\n") if '" t' in e]
        if len(found) == tokens and all(f'" t{n}@' in e for n, e in enumerate(found)):
            intact += text.rstrip().endswith("data: [DONE]")

    tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
    await asyncio.sleep(ramp + 0.5)
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(max(0.5, tokens / rate - 1.0))
    cpu, t1 = time.process_time() - cpu0, time.monotonic()
    await asyncio.gather(*tasks)
    in_window = sum(events for t, events in arrivals if t0 <= t <= t1)
    return {
        "load": f"{count} streams x {rate:g} tokens/s",
        "intact": f"{intact}/{count}",
        "chunks_per_s": round(in_window / (t1 - t0)),
        "us_per_chunk": round(1e6 * cpu / in_window, 1) if in_window else None,
    }


def _other_module(tree: Path) -> ModuleType:
    """``tree``'s ``relay/server/cluster/peerhttp.py``, loaded under another name."""
    path = tree / "relay" / "server" / "cluster" / "peerhttp.py"
    spec = importlib.util.spec_from_file_location("compared_peerhttp", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def run(args: argparse.Namespace, procs: Processes) -> list[dict[str, Any]]:
    up = procs.start(
        "upstream",
        [project_python(), "-m", "bench.upstream", "--token-rate", str(args.rate)],
        cwd=ROOT,
    )
    url = up.wait_for_line(r"upstream listening on (http://\S+)", timeout=30).group(1)
    clients: dict[str, Any] = {"this tree": PeerClient()}
    if args.compare is not None:
        clients[str(args.compare)] = _other_module(args.compare).PeerClient()
    out = []
    try:
        for round_ in range(args.repeat):
            names = list(clients) if round_ % 2 == 0 else list(reversed(clients))
            for name in names:
                client, tag = clients[name], {"round": round_ + 1, "client": name}
                if args.only in ("all", "streams"):
                    result = await streams(client, url, args.streams, args.tokens, args.rate)
                    out.append({**tag, **result})
                if args.only in ("all", "unary"):
                    result = await unary(client, url, args.requests, args.concurrency)
                    out.append({**tag, **result})
    finally:
        for client in clients.values():
            await client.aclose()
    return out


def medians(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each client's median µs per chunk and per request over the rounds."""
    out = []
    for name in dict.fromkeys(r["client"] for r in results):
        row: dict[str, Any] = {"client": name, "rounds": 0}
        for key in ("us_per_chunk", "us_per_request"):
            values = [r[key] for r in results if r["client"] == name and r.get(key)]
            if values:
                row[f"median_{key}"] = round(statistics.median(values), 1)
                row["rounds"] = len(values)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--only", choices=("all", "streams", "unary"), default="all")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--compare", type=Path, metavar="DIR", help="another checkout's client, alternated"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="peer-link-") as tmp, Processes(Path(tmp)) as procs:
        results = asyncio.run(run(args, procs))
    for result in results:
        print(json.dumps(result))
    if args.repeat > 1 or args.compare is not None:
        for row in medians(results):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
