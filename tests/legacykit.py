"""Helpers for the live tests of the legacy bridge (SPEC §12).

A module-scoped server per test file (:data:`SHARED_ENV`: a short heartbeat timeout
and an admin token), fake legacy nodes that beat ten times a second, the real
``worker.py`` in front of the fake upstream, and small waits on what the server
reports through its admin API.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from tests.legacynode import LegacyNode
from tests.live import ROOT, LiveServer
from tests.test_e2e import FAST as WORKER_FAST
from tests.upstream import FakeUpstream

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
ADMIN = {"authorization": "Bearer admin-token"}
#: Every fake node beats ten times a second: far inside HEARTBEAT_TIMEOUT_SECS below.
BEAT = 0.1
SHARED_ENV = {
    "HEARTBEAT_INTERVAL_SECS": "0.3",
    "HEARTBEAT_TIMEOUT_SECS": "2",
    "QUEUE_TIMEOUT_SECS": "10",
    "REQUEST_TIMEOUT_SECS": "30",
    "MODELRELAY_ADMIN_TOKEN": "admin-token",
}


def node(server: LiveServer, model: str, **options: Any) -> LegacyNode:
    """A fake legacy node for ``server`` serving ``model`` (not connected yet)."""
    options.setdefault("heartbeat", BEAT)
    options.setdefault("token", server.secret)
    return LegacyNode(server.url, model=model, **options)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def stream_chat(client: httpx.AsyncClient, model: str, text: str = "go") -> Any:
    """A streaming chat request; entering it waits for the first byte (the headers come
    with it), so a stepped node must be released first."""
    body = {"model": model, "stream": True, "messages": user(text)}
    return client.stream("POST", CHAT, json=body, timeout=15)


def read_all(client: httpx.AsyncClient, model: str, text: str) -> asyncio.Task[bytes]:
    """A streaming chat request read to its end in the background."""

    async def run() -> bytes:
        async with await stream_chat(client, model, text) as response:
            return b"".join([part async for part in response.aiter_raw()])

    return asyncio.create_task(run())


def streamed_text(received: bytes) -> str:
    return "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in received.decode().splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    )


async def poll(check: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Await ``check()`` every 20 ms until it is true; fail after ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def workers(server: LiveServer) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        return (await client.get("/admin/workers", headers=ADMIN)).json()


async def workers_for(server: LiveServer, model: str) -> list[dict[str, Any]]:
    return [w for w in await workers(server) if model in w["models"]]


async def serving(server: LiveServer, model: str, count: int = 1) -> None:
    """Wait until ``count`` connected workers serve ``model``."""

    async def ready() -> bool:
        return len(await workers_for(server, model)) == count

    await poll(ready, what=f"{count} worker(s) for {model}")


async def dropped_frames(server: LiveServer) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        stats = (await client.get("/admin/stats", headers=ADMIN)).json()
    return int(stats["dropped_worker_frames"])


@asynccontextmanager
async def modern_worker(
    server: LiveServer, backend: FakeUpstream | str, model: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The real ``worker.py`` serving ``model`` from ``backend`` (the fake upstream or a
    URL), one slot."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "worker.py",
        "--proxy-url",
        server.url,
        "--worker-secret",
        server.secret,
        "--backend-url",
        backend if isinstance(backend, str) else backend.url,
        "--worker-name",
        "modern-box",
        "--models",
        model,
        "--max-concurrent",
        "1",
        *WORKER_FAST,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
