"""Helpers for tests of several server processes sharing Redis (SPEC §11).

``cluster()`` starts live processes sharing one Redis prefix, pepper and database;
``private_redis()`` a redis-server of the test's own, which the test may flush, kill or
restart without touching anyone else's; ``nginx_round_robin()`` a load balancer in front.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.wire import protocol
from tests.conftest import REDIS_URL, require_redis
from tests.live import LiveServer
from tests.test_deploy_proxies import (
    nginx_binary,
    nginx_command,
    nginx_main_config,
    render_loopback,
    running,
)

TOKEN = "cluster-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def cluster(factory: Any, count: int, **env: str) -> Iterator[list[LiveServer]]:
    """``count`` server processes sharing one Redis prefix, pepper and database."""
    if "REDIS_URL" not in env:
        require_redis()
    common = {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}",
        "MODELRELAY_ADMIN_TOKEN": TOKEN,
        "MODELRELAY_SECRET_PEPPER": secrets.token_urlsafe(32),
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "HEARTBEAT_INTERVAL_SECS": "1",
        **env,
    }
    with ExitStack() as stack:
        first = stack.enter_context(factory(**common))
        servers = [first]
        for _ in range(count - 1):
            shared = {**common, "DATABASE_URL": first.env["DATABASE_URL"]}
            servers.append(stack.enter_context(factory(**shared)))
        yield servers


async def until(check: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    async with asyncio.timeout(timeout):
        while True:
            result = await check()
            if result:
                return result
            await asyncio.sleep(0.02)


async def knows(server: LiveServer, model: str) -> None:
    """Wait until ``server`` may route ``model`` (it learns other processes' models)."""

    async def listed() -> bool:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            return any(m["id"] == model for m in (await client.get("/v1/models")).json()["data"])

    await until(listed, what=f"{model} routable at {server.url}")


async def waiting(server: LiveServer) -> int:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        return int((await client.get("/health")).json()["queue_depth"])


CHAT = "/v1/chat/completions"


def chunk(request_id: str, text: str) -> str:
    return protocol.encode(protocol.ResponseChunk(request_id, text))


def answer(request_id: str, body: str = "ok") -> str:
    return protocol.encode(
        protocol.ResponseComplete(
            request_id=request_id,
            status_code=200,
            headers={"content-type": "application/json"},
            body=body,
        )
    )


@contextmanager
def nginx_round_robin(servers: list[LiveServer], workdir: Path) -> Iterator[str]:
    """deploy/nginx.conf (loopback, plain HTTP) with every process in its upstream."""
    binary = nginx_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    site = render_loopback(servers[0].port, port)
    lines = "\n".join(f"    server 127.0.0.1:{s.port};" for s in servers)
    site = re.sub(rf"(?m)^\s*server 127\.0\.0\.1:{servers[0].port};.*$", lines, site, count=1)
    conf = nginx_main_config(workdir, site)
    with running(nginx_command(binary, workdir, conf), port, workdir / "nginx.log", {}) as addr:
        yield f"http://{addr}"


@contextmanager
def private_redis(workdir: Path) -> Iterator[tuple[str, Any]]:
    """A redis-server of the test's own on a free port, which the test may stop and start."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    state: dict[str, subprocess.Popen[bytes] | None] = {"process": None}

    def start() -> None:
        state["process"] = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        require_ready(port)

    def stop() -> None:
        process = state["process"]
        if process is not None:
            process.send_signal(signal.SIGKILL)
            process.wait(5)
            state["process"] = None

    start()
    try:
        yield f"redis://127.0.0.1:{port}/0", (start, stop)
    finally:
        stop()


def require_ready(port: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
