"""(o) Streams that survive a dropped connection (SPEC §18).

A live ``manage.py serve`` (daphne), one ``worker.py`` and the fake upstream of the tests
(``tests/upstream.py``, in this process's thread), which streams Responses events and
chat/completions chunks at a fixed pace. Measured:

- *background, one process*: a background stream of ``o_events`` events (the relay's
  ``response.queued`` and the backend's), its client dropped at event ``o_drop_at`` and
  reattached with ``starting_after``: the events, concatenated, against an uninterrupted
  run of the same request (type, sequence number and text of each), and the requests the
  backend received for it (target: exactly one);
- *background, another process* (two processes sharing Redis, the worker connected to
  the first): the same, reattached through the second process, ``o_reattaches`` times;
  the time from sending the reattach to its first byte (target: ≤ 100 ms);
- *llama.cpp's protocol*: a chat/completions stream with ``X-Conversation-Id`` dropped at
  a random byte and resumed from that offset (``GET /v1/stream/{id}?from=N``), in each
  layout: byte-identical to the backend's own answer;
- *memory*: ``o_retained`` conversation streams of ``o_retained_kib`` KiB each, their
  clients gone at once, with STREAM_RETAIN_TOTAL_BYTES = ``o_bound_mib`` MiB: the bytes
  the server says it holds (``/admin/stats``) and its RSS growth, against the bound;
- *cost for streams that ask for nothing*: the server's own CPU per streamed chunk, in
  process (:mod:`bench.stream_edge`: ``Relay.on_chunk``, the mailbox, the edge's response
  loop), and the same chunks through a resumable response's pump and log with one reader.

Redis: ``BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); without one reachable
the second layout is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench import stream_edge
from bench.procs import Processes, rss_bytes
from bench.targets import ROOT, WORKER_SECRET, project_python, start_server, wait_workers

MODEL = "mock-model"
RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
ADMIN = "bench-resume-admin"
JSON = {"content-type": "application/json"}
#: Events of a Responses stream besides its text deltas: the relay's response.queued and
#: the backend's created, output_item.added, content_part.added, output_text.done,
#: content_part.done, output_item.done and completed.
FRAME_EVENTS = 8


def redis_url() -> str:
    return os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_reachable() -> bool:
    parts = urlsplit(redis_url())
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), 1):
            return True
    except OSError:
        return False


def _start_worker(procs: Processes, server_url: str, backend_url: str, label: str) -> None:
    procs.start(
        f"worker-{label}",
        [
            project_python(),
            "worker.py",
            "--proxy-url",
            server_url,
            "--worker-secret",
            WORKER_SECRET,
            "--backend-url",
            backend_url,
            "--models",
            MODEL,
            "--max-concurrent",
            "32",
            "--worker-name",
            f"resume-{label}",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
    )


# ------------------------------------------------------------------- background mode


def _events(data: bytes) -> list[tuple[str, int, str]]:
    """(type, sequence number, delta) of each event of a Responses SSE body."""
    out = []
    for block in data.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                doc = json.loads(line[6:])
                out.append((doc["type"], doc["sequence_number"], doc.get("delta", "")))
    return out


def _body(tokens: int, delay: float) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": "hi",
        "background": True,
        "stream": True,
        "mock": {"tokens": tokens, "token_delay": delay},
    }


def _read_events(client: httpx.Client, url: str, body: dict[str, Any], stop: int) -> bytes:
    """POST ``body`` and read until ``stop`` events came (or the end); then drop."""
    got = b""
    with client.stream("POST", url + RESPONSES, json=body) as response:
        for chunk in response.iter_raw():
            got += chunk
            if got.count(b"\n\n") >= stop:
                break
    return got[: _nth_end(got, stop)]


def _nth_end(data: bytes, n: int) -> int:
    at = -2
    for _ in range(n):
        at = data.find(b"\n\n", at + 2)
        if at < 0:
            return len(data)
    return at + 2


def _reattach(client: httpx.Client, url: str, response_id: str, after: int) -> tuple[bytes, float]:
    """Every event after ``after``, and the seconds from the request to its first byte."""
    started = time.perf_counter()
    first = None
    got = b""
    params = {"stream": "true", "starting_after": str(after)}
    with client.stream("GET", f"{url}{RESPONSES}/{response_id}", params=params) as response:
        for chunk in response.iter_raw():
            if first is None:
                first = time.perf_counter() - started
            got += chunk
    return got, first if first is not None else float("nan")


def _background(
    client: httpx.Client, up: Any, create_url: str, reattach_url: str, s: dict[str, Any]
) -> dict[str, Any]:
    tokens = s["o_events"] - FRAME_EVENTS
    body = _body(tokens, s["o_token_delay"])
    whole = _events(_read_events(client, create_url, body, 1 << 30))
    before = len(up.requests_to(RESPONSES))
    head_bytes = _read_events(client, create_url, body, s["o_drop_at"])
    head = _events(head_bytes)
    response_id = json.loads(head_bytes.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    rest_bytes, first_byte = _reattach(client, reattach_url, response_id, head[-1][1])
    joined = head + _events(rest_bytes)
    # The uninterrupted run's own sequence numbers and text (its id aside).
    return {
        "events": len(joined),
        "dropped_at": len(head),
        "identical": joined == whole,
        "sequence_ok": [e[1] for e in joined] == list(range(len(joined))),
        "text_ok": "".join(e[2] for e in joined) == "".join(e[2] for e in whole),
        "backend_requests": len(up.requests_to(RESPONSES)) - before,
        "first_byte_ms": round(1000 * first_byte, 2),
    }


def _replay(
    client: httpx.Client, up: Any, post_url: str, get_url: str, seed: int
) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "mock": {"tokens": 2000, "token_delay": 0.001, "split_utf8": True},
        }
    ).encode()
    whole = httpx.post(up.url + CHAT, content=body, headers=JSON, timeout=60).content
    at = random.Random(seed).randrange(1, len(whole) - 1)
    conversation = f"bench-{secrets.token_hex(4)}"
    got = b""
    headers = {**JSON, "x-conversation-id": conversation}
    with client.stream("POST", post_url + CHAT, content=body, headers=headers) as response:
        for chunk in response.iter_raw():
            got += chunk
            if len(got) >= at:
                break
    rest = client.get(f"{get_url}/v1/stream/{conversation}", params={"from": len(got)})
    return {
        "bytes": len(whole),
        "dropped_at_byte": len(got),
        "identical": got + rest.content == whole,
    }


# ----------------------------------------------------------------------------- memory


def _memory(
    procs: Processes, workdir: Path, up: Any, s: dict[str, Any], log: Any
) -> dict[str, Any]:
    bound = s["o_bound_mib"] * 1024 * 1024
    server, url = start_server(
        procs,
        workdir,
        "resume-memory",
        None,
        "daphne",
        MODELRELAY_ADMIN_TOKEN=ADMIN,
        STREAM_RETAIN_TOTAL_BYTES=str(bound),
        STREAM_RETAIN_PER_KEY=str(s["o_retained"] + 10),
        MAX_QUEUE_LEN="5000",
    )
    _start_worker(procs, url, up.url, "memory")
    wait_workers(url, 1, server, timeout=60)
    # Warm the path (imports, first allocations) before the baseline.
    body = _memory_body(10)
    _fire(url, body, "warm", 1)
    _wait_idle(url, 1)
    baseline = rss_bytes(server.pid)
    count, size = s["o_retained"], s["o_retained_kib"]
    body = _memory_body(size)
    started = time.monotonic()
    _fire(url, body, "kept", count)
    _wait_idle(url, count + 1)
    stats = _stats(url)
    rss = rss_bytes(server.pid)
    procs.stop_all()
    log(
        f"  memory: {stats['retained']} retained, {stats['bytes'] / 2**20:.1f} MiB held "
        f"(bound {s['o_bound_mib']} MiB), RSS +{(rss - baseline) / 2**20:.1f} MiB"
    )
    return {
        "responses": count,
        "kib_each": size,
        "bound_mib": s["o_bound_mib"],
        "asked_mib": round(count * size / 1024, 1),
        "held_mib": round(stats["bytes"] / 2**20, 2),
        "retained": stats["retained"],
        "evicted": stats["evicted"],
        "within_bound": stats["bytes"] <= bound,
        "rss_growth_mib": round((rss - baseline) / 2**20, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def _memory_body(kib: int) -> bytes:
    # Ten token events, each after a comment: about ``kib`` KiB of stream.
    padding = max(0, (kib * 1024) // 11 - 200)
    return json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "mock": {"tokens": 10, "padding": padding},
        }
    ).encode()


def _fire(url: str, body: bytes, label: str, count: int) -> None:
    """``count`` streams whose clients send their request and leave at once."""
    parts = urlsplit(url)
    for n in range(count):
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
            sock.sendall(
                f"POST {CHAT} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                f"content-type: application/json\r\nx-conversation-id: {label}-{n}\r\n"
                f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            sock.recv(1)  # the stream started: its log is written


def _stats(url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.get(url + "/admin/stats", headers=headers, timeout=30).json()["streams"][
        "resumable"
    ]


def _wait_idle(url: str, started: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(url)
        if stats["started"] >= started and stats["running"] == 0 and stats["pumps"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("resume bench: the retained streams did not all end")


# ------------------------------------------------------------------------------- cost


async def _resumable_path(streams: int, chunks: int) -> float:
    """CPU µs per chunk through a resumable response's pump and memory log, one reader."""
    from relay.core.config import ProviderPolicy, RelayConfig
    from relay.core.keeper import StreamKeeper
    from relay.core.relay import Relay
    from relay.core.streamlog import Bounds, Entry
    from relay.core.streamstore import MemoryStreams
    from relay.wire import protocol

    config = RelayConfig()
    relay = Relay(config, instance="bench")
    relay.set_provider(ProviderPolicy.from_overrides(config, "local"))
    worker, _ = relay.attach_worker(
        provider="local",
        name="w",
        models=["m"],
        max_concurrent=streams,
        current_load=0,
        link=stream_edge._Link(),
    )
    store = MemoryStreams(Bounds(per_key=streams + 1))
    keeper = StreamKeeper(relay, store)
    requests = []
    readers = []

    async def read(stream_id: str) -> None:
        async for _ in store.follow(None, stream_id, 0):
            pass

    for n in range(streams):
        entry = Entry(owner=None, id=f"s{n}", kind="replay", flavor="openai", created=0.0, gen="g")
        await keeper.open(entry, replace=True)
        request = relay.submit(
            model="m",
            endpoint_path="/v1/chat/completions",
            flavor="openai",
            is_streaming=True,
            body='{"model":"m","stream":true}',
            headers={},
        )
        keeper.start(request, entry)
        requests.append(request)
        readers.append(asyncio.ensure_future(read(entry.id)))
    texts = [stream_edge._CHUNK % i for i in range(chunks)] + [stream_edge._DONE]
    await asyncio.sleep(0)
    start = time.process_time()
    for text in texts:
        for request in requests:
            relay.on_chunk(worker, request.id, text)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    for request in requests:
        relay.on_complete(
            worker,
            protocol.ResponseComplete(
                request_id=request.id, status_code=200, token_counts=stream_edge.COUNTS
            ),
        )
    await asyncio.wait(readers)
    elapsed = time.process_time() - start
    await keeper.aclose()
    await relay.aclose()
    return elapsed / (streams * len(texts)) * 1e6


async def _cost(s: dict[str, Any]) -> dict[str, Any]:
    streams, chunks, rounds = s["o_cost_streams"], s["o_cost_chunks"], s["o_cost_rounds"]
    plain = await stream_edge.measure(streams, chunks, rounds)
    await _resumable_path(streams, min(chunks, 20))  # warm up
    kept = [await _resumable_path(streams, chunks) for _ in range(rounds)]
    return {
        "streams": streams,
        "chunks_per_stream": chunks + 1,
        "plain_us_per_chunk": round(plain["us_per_chunk"], 2),
        "resumable_us_per_chunk": round(statistics.median(kept), 2),
        "load_average": round(os.getloadavg()[0], 2),
    }


# ------------------------------------------------------------------------------- run


def run(procs: Processes, workdir: Path, s: dict[str, Any], log: Any) -> dict[str, Any]:
    from tests.upstream import upstream_in_thread

    out: dict[str, Any] = {}
    log("  cost per chunk (in process)")
    out["cost"] = asyncio.run(_cost(s))
    with upstream_in_thread(total_slots=64) as up, httpx.Client(timeout=120) as client:
        log("  one process")
        server, url = start_server(procs, workdir, "resume-one", None, "daphne")
        _start_worker(procs, url, up.url, "one")
        wait_workers(url, 1, server, timeout=60)
        out["one_process"] = {
            "background": _background(client, up, url, url, s),
            "replay": _replay(client, up, url, url, 1),
        }
        procs.stop_all()
        if not redis_reachable():
            out["two_processes"] = {"skipped": f"Redis is not reachable at {redis_url()}"}
        else:
            log("  two processes (Redis)")
            env = {
                "REDIS_URL": redis_url(),
                "REDIS_PREFIX": f"bench-{secrets.token_hex(4)}",
                "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
                "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
            }
            a, a_url = start_server(procs, workdir, "resume-a", None, "daphne", **env)
            database = f"sqlite:///{workdir / 'data-resume-a' / 'db.sqlite3'}"
            _, b_url = start_server(
                procs, workdir, "resume-b", None, "daphne", **env, DATABASE_URL=database
            )
            _start_worker(procs, a_url, up.url, "a")
            wait_workers(a_url, 1, a, timeout=60)
            _wait_routable(b_url)
            runs = [_background(client, up, a_url, b_url, s) for _ in range(s["o_reattaches"])]
            firsts = [r["first_byte_ms"] for r in runs]
            out["two_processes"] = {
                "background": runs[0],
                "reattaches": len(runs),
                "all_identical": all(r["identical"] for r in runs),
                "backend_requests": [r["backend_requests"] for r in runs],
                "first_byte_ms_median": round(statistics.median(firsts), 2),
                "first_byte_ms_max": round(max(firsts), 2),
                "replay": _replay(client, up, a_url, b_url, 2),
            }
            procs.stop_all()
        log("  memory")
        out["memory"] = _memory(procs, workdir, up, s, log)
    return out


def _wait_routable(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = httpx.get(url + "/v1/models", timeout=5).json().get("data", [])
        if any(m.get("id") == MODEL for m in models):
            return
        time.sleep(0.1)
    raise RuntimeError("resume bench: the other process never listed the worker's model")
