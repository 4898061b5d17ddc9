"""One-shot reproductions of the product failures in :mod:`chaos.known`.

Usage::

    python chaos/repro.py status-body --server uvicorn --status 204
    python chaos/repro.py header --server uvicorn --value 'a\\x7fb'
    python chaos/repro.py upgrade --server uvicorn
    python chaos/repro.py utf8 --server uvicorn
    python chaos/repro.py v1-path --path /v1/foo
    python chaos/repro.py worker-drain

Each starts a fresh server on 127.0.0.1 (and, where needed, a raw WebSocket worker
that answers exactly as told, or the real worker.py), sends one request, prints the
raw bytes the client received and the server's ERROR lines, and stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from bench.procs import Processes  # noqa: E402
from chaos.rig import WORKER_SECRET, Rig  # noqa: E402


async def raw_worker(rig: Rig) -> ClientConnection:
    ws = await connect(
        f"ws://127.0.0.1:{rig.port}/v1/worker/connect?provider=local",
        additional_headers={"X-Worker-Secret": WORKER_SECRET},
        proxy=None,
    )
    register = {"type": "register", "worker_name": "raw", "models": ["m"], "protocol_version": "1"}
    await ws.send(json.dumps(register))
    await ws.recv()  # register_ack
    return ws


async def post(rig: Rig, extra: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
    body = b'{"model":"m"}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
        % (len(body), extra, body)
    )
    await writer.drain()
    return reader, writer


async def next_request(ws: ClientConnection) -> str:
    while True:
        message = json.loads(await ws.recv())
        if message.get("type") == "request":
            return str(message["request_id"])


async def answer(rig: Rig, status: int, headers: dict[str, str]) -> None:
    """A raw worker answers one request with ``status`` and ``headers`` and a short body."""
    ws = await raw_worker(rig)
    reader, writer = await post(rig)
    rid = await next_request(ws)
    complete = {
        "type": "response_complete",
        "request_id": rid,
        "status_code": status,
        "headers": headers,
        "body": '{"choices":[]}',
    }
    await ws.send(json.dumps(complete))
    try:
        data = await asyncio.wait_for(reader.read(65536), 5)
    except TimeoutError:
        data = b"(nothing within 5 s)"
    print(f"worker answered {status} {headers}; the client received:\n  {data!r}")
    writer.close()
    await ws.close()


async def upgrade(rig: Rig) -> None:
    reader, writer = await post(rig, b"Upgrade: websocket\r\nConnection: Upgrade\r\n")
    started = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(65536), 30)
        print(f"the client received after {time.monotonic() - started:.1f}s:\n  {data!r}")
    except TimeoutError:
        print("the client received nothing within 30 s; the connection is still open")
    writer.close()


async def utf8(rig: Rig) -> None:
    ws = await raw_worker(rig)
    await ws.send(b'{"type":"pong","x":"\xff"}', text=True)
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    except ConnectionClosed as exc:
        print(f"the server closed the worker: {exc.rcvd}")


async def v1_path(rig: Rig, path: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(400), 5)
    print(f"GET {path} ->\n  {data!r}")
    writer.close()


async def worker_drain(rig: Rig, workdir: Path) -> None:
    """The worker-drain scenario with ten drains under load, up to three times (a race)."""
    import dataclasses

    from chaos.matrix import QUICK, SCENARIOS_BY_NAME, run_scenario

    profile = dataclasses.replace(QUICK, size=10)
    for attempt in range(1, 4):
        where = workdir / f"attempt{attempt}"
        out = await run_scenario(SCENARIOS_BY_NAME["worker-drain"], profile, where, rig.server_kind)
        print(f"attempt {attempt}:")
        for check in out.checks:
            print(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail[:300]}")
        for log in sorted(where.glob("chaos-w1*.log")):
            for line in log.read_text().splitlines():
                if "refusing request" in line:
                    print(f"  {log.name}: {line}")
        if not out.passed:
            return


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "case", choices=["status-body", "header", "upgrade", "utf8", "v1-path", "worker-drain"]
    )
    p.add_argument("--server", default="daphne", choices=["daphne", "uvicorn"])
    p.add_argument("--status", type=int, default=204)
    p.add_argument("--value", default="a\\x7fb", help="header value (Python escapes allowed)")
    p.add_argument("--path", default="/v1/foo")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="modelrelay-repro-"))
    with Processes(workdir) as procs:
        rig = Rig(procs, workdir, server=args.server, env={}, worker_concurrency=1)
        if args.case == "worker-drain":
            await worker_drain(rig, workdir)
            return
        await rig.start_server()
        if args.case == "status-body":
            await answer(rig, args.status, {"content-type": "application/json"})
        elif args.case == "header":
            value = args.value.encode().decode("unicode_escape")
            await answer(rig, 200, {"content-type": "application/json", "x-odd": value})
        elif args.case == "upgrade":
            await upgrade(rig)
        elif args.case == "utf8":
            await utf8(rig)
        else:
            await v1_path(rig, args.path)
        await asyncio.sleep(0.3)
        assert rig.server is not None
        errors = [
            line
            for line in rig.server.log.read_text(errors="replace").splitlines()
            if " ERROR " in line or line.startswith(("Traceback", "RuntimeError", "Unicode"))
        ]
        print(f"server log ({args.server}): {len(errors)} ERROR/traceback lines")
        for line in errors[:6]:
            print(f"  {line}")


if __name__ == "__main__":
    asyncio.run(main())
