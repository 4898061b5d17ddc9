"""The shipped reverse-proxy configs, live: a real nginx rendered from ``deploy/nginx.conf``
(plain HTTP on a free loopback port, upstream = a live ``manage.py serve``) carries a
worker's WebSocket, streams SSE without buffering, propagates a client hang-up and passes
the client address on, and lets only the worker route switch protocols. The same runs
through Caddy with ``deploy/Caddyfile``. Both proxies are Debian packages that
``make test`` installs (``scripts/install-deb.sh``); without them these tests skip on a
developer machine and fail under CI=true.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
import websockets

from relay.wire import protocol
from tests.conftest import IN_CI
from tests.live import ROOT, LiveServer
from tests.rawworker import closed, expect

DEPLOY = ROOT / "deploy"
NGINX_CONF = DEPLOY / "nginx.conf"
SERVER_ENV = DEPLOY / "modelrelay.env.example"
WORKER_ENV = DEPLOY / "worker.env.example"
SECRETISH = re.compile(r"SECRET|PASSWORD|TOKEN|PEPPER")


# --------------------------------------------------------------------------- nginx


def nginx_binary() -> str:
    """nginx from PATH or Debian's /usr/sbin; skip locally, fail in CI when it is missing."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        missing("nginx")
    return found


def missing(package: str) -> NoReturn:
    """Skip on a developer machine, fail in CI, when a proxy package is not installed."""
    reason = f"{package} is not installed (bash scripts/install-deb.sh {package} installs Debian's)"
    if IN_CI:
        pytest.fail(reason + "; CI requires it", pytrace=False)
    pytest.skip(reason)


def _replace_directive(text: str, old: str, new: str) -> str:
    """Replace the one directive line starting with ``old`` (comments do not count)."""
    pattern = re.compile(rf"(?m)^(\s*){re.escape(old)}")
    text, found = pattern.subn(lambda m: m.group(1) + new, text)
    assert found == 1, f"deploy/nginx.conf must have exactly one {old!r} line"
    return text


def render_loopback(upstream_port: int, listen_port: int) -> str:
    """deploy/nginx.conf as plain HTTP on 127.0.0.1 (the rules are in the file's header)."""
    text = NGINX_CONF.read_text()
    text, found = re.subn(r"(?ms)^# >>> http-redirect\n.*?^# <<< http-redirect\n", "", text)
    assert found == 1, "deploy/nginx.conf lost its http-redirect markers"
    text = "\n".join(line for line in text.splitlines() if not line.rstrip().endswith("# tls"))
    text = _replace_directive(text, "server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream_port};")
    text = _replace_directive(text, "listen 443 ssl;", f"listen 127.0.0.1:{listen_port};")
    leftovers = [line for line in text.splitlines() if re.match(r"\s*(ssl_|listen)", line)]
    assert leftovers == [f"    listen 127.0.0.1:{listen_port};"], leftovers
    return text


def render_production(cert: Path, key: Path) -> str:
    """deploy/nginx.conf unchanged except for the certificate paths."""
    text = NGINX_CONF.read_text()
    text, n_cert = re.subn(r"(?m)^(\s*ssl_certificate)\s+\S+;", rf"\1 {cert};", text)
    text, n_key = re.subn(r"(?m)^(\s*ssl_certificate_key)\s+\S+;", rf"\1 {key};", text)
    assert (n_cert, n_key) == (1, 1)
    return text


def nginx_main_config(workdir: Path, site: str) -> Path:
    """A main config that keeps every path nginx writes inside ``workdir``."""
    (workdir / "modelrelay.conf").write_text(site)
    temp = {name: workdir / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(
        f"""
daemon off;
master_process off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log stderr notice;
events {{ worker_connections 256; }}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {temp["client_body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    include {workdir}/modelrelay.conf;
}}
"""
    )
    return conf


def nginx_command(binary: str, workdir: Path, conf: Path) -> list[str]:
    return [binary, "-p", f"{workdir}/", "-c", str(conf), "-e", "stderr"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def caddy_binary() -> str:
    """caddy from PATH; skip locally, fail in CI when it is missing."""
    found = shutil.which("caddy") or shutil.which("caddy", path="/usr/bin:/usr/local/bin")
    if found is None:
        missing("caddy")
    return found


def render_caddy_loopback(upstream_port: int, listen_port: int) -> str:
    """deploy/Caddyfile as plain HTTP on 127.0.0.1, without the admin endpoint or ACME."""
    text = (DEPLOY / "Caddyfile").read_text()
    site = f"{{\n\tadmin off\n\tauto_https off\n}}\n\nhttp://127.0.0.1:{listen_port} {{"
    text = _replace_directive(text, "relay.example.com {", site)
    return _replace_directive(
        text, "reverse_proxy 127.0.0.1:8080 ", f"reverse_proxy 127.0.0.1:{upstream_port} "
    )


@contextmanager
def running(command: list[str], port: int, log_path: Path, env: dict[str, str]) -> Iterator[str]:
    """Run a proxy in the foreground until it listens on ``port``; always stop it."""
    name = Path(command[0]).name
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 10
            while True:
                if process.poll() is not None:
                    pytest.fail(f"{name} exited:\n{log_path.read_text()}", pytrace=False)
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"{name} did not listen:\n{log_path.read_text()}")
                    time.sleep(0.02)
            yield f"127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@contextmanager
def running_proxy(kind: str, binary: str, workdir: Path, upstream_port: int) -> Iterator[str]:
    """nginx or Caddy, configured from deploy/, in front of ``upstream_port``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    if kind == "nginx":
        conf = nginx_main_config(workdir, render_loopback(upstream_port, port))
        command = nginx_command(binary, workdir, conf)
    else:
        conf = workdir / "Caddyfile"
        conf.write_text(render_caddy_loopback(upstream_port, port))
        command = [binary, "run", "--config", str(conf), "--adapter", "caddyfile"]
        # Caddy keeps state under $HOME / XDG dirs: keep it in the test's directory.
        env |= {
            "HOME": str(workdir),
            "XDG_DATA_HOME": str(workdir),
            "XDG_CONFIG_HOME": str(workdir),
        }
    with running(command, port, workdir / f"{kind}.log", env) as address:
        yield address


@pytest.fixture(params=["nginx", "caddy"])
def proxied(request, relay_server_factory, tmp_path) -> Iterator[tuple[LiveServer, str]]:
    """A live relay that trusts 127.0.0.1 as its proxy, and nginx/Caddy in front of it."""
    kind: str = request.param
    binary = nginx_binary() if kind == "nginx" else caddy_binary()
    with (
        relay_server_factory(TRUSTED_PROXIES="127.0.0.1", AUTH_MAX_FAILURES="1") as server,
        running_proxy(kind, binary, tmp_path / kind, server.port) as address,
    ):
        yield server, address


def connect_via(
    address: str, secret: str, *, source: str = "127.0.0.1", forwarded_for: str | None = None
) -> Any:
    """A raw worker socket through the proxy, from the loopback address ``source``."""
    headers = {"X-Worker-Secret": secret}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return websockets.connect(
        f"ws://{address}/v1/worker/connect?provider=local",
        additional_headers=headers,
        max_size=None,
        open_timeout=5,
        local_addr=(source, 0),
    )


async def register(ws: Any) -> protocol.RegisterAck:
    frame = {
        "type": "register",
        "worker_name": "w",
        "models": ["m"],
        "max_concurrent": 1,
        "protocol_version": "1",
    }
    await ws.send(json.dumps(frame))
    return await expect(ws, protocol.RegisterAck)


async def read_exactly(chunks: AsyncIterator[bytes], size: int, timeout: float = 5.0) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        while len(data) < size:
            data += await anext(chunks)
    return data


@pytest.mark.live
async def test_a_worker_registers_over_websocket_through_the_proxy(proxied):
    server, address = proxied
    async with connect_via(address, server.secret) as ws:
        ack = await register(ws)
        assert ack.models == ["m"]
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client:
            health = (await client.get("/health")).json()
            assert health["workers_connected"] == 1
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m"]


@pytest.mark.live
async def test_streams_cross_the_proxy_unbuffered_and_a_hangup_cancels_the_request(proxied):
    server, address = proxied
    async with connect_via(address, server.secret) as ws:
        await register(ws)
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=10) as client:
            body = {"model": "m", "stream": True}
            stream = client.stream("POST", "/v1/chat/completions", json=body)
            # The relay sends response headers with the first chunk, so open concurrently.
            opening = asyncio.ensure_future(stream.__aenter__())
            try:
                request = await expect(ws, protocol.Request)
                assert request.is_streaming
                chunks: AsyncIterator[bytes] | None = None
                for n in range(3):
                    # Chunk n+1 is produced only after the client read chunk n through
                    # the proxy: one that buffers would hold chunk n back and time out here.
                    text = f'data: {{"n":{n}}}\n\n'
                    chunk = protocol.ResponseChunk(request_id=request.request_id, chunk=text)
                    await ws.send(protocol.encode(chunk))
                    if chunks is None:
                        response = await asyncio.wait_for(opening, 5)
                        assert response.status_code == 200
                        assert response.headers["content-type"].startswith("text/event-stream")
                        chunks = response.aiter_raw()
                    assert await read_exactly(chunks, len(text.encode())) == text.encode()
                await stream.__aexit__(None, None, None)  # the client hangs up mid-stream
            finally:
                opening.cancel()
            cancel = await expect(ws, protocol.Cancel)
            assert cancel == protocol.Cancel(
                request_id=request.request_id, reason="client_disconnect"
            )


@pytest.mark.live
async def test_behind_the_proxy_failed_worker_logins_count_against_the_real_client(proxied):
    # The relay trusts the proxy (TRUSTED_PROXIES=127.0.0.1) and blocks an address after one
    # failure. The client at 127.0.0.2 fails and claims in X-Forwarded-For to be 127.0.0.3.
    server, address = proxied
    async with connect_via(
        address, "wrong-secret", source="127.0.0.2", forwarded_for="127.0.0.3"
    ) as ws:
        assert await closed(ws) == (1008, "invalid worker secret")
    # The failure was charged to the address the proxy saw, not to the forged hop...
    async with connect_via(address, server.secret, source="127.0.0.2") as ws:
        code, reason = await closed(ws)
        assert code == 1008
        assert "too many failed authentication attempts" in reason
    # ...nor to the proxy's own 127.0.0.1: every other client still gets in.
    async with connect_via(address, server.secret, source="127.0.0.3") as ws:
        await register(ws)
    server.wait_for_log("worker auth failed: peer=127.0.0.2 ")


# --------------------------------------------------------------------------- protocol switches

#: What a hostile backend sends after its ``101``: in a tunnel it would reach the client raw.
TUNNEL = b"TUNNEL-FROM-BEHIND-THE-PROXY"
SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    + TUNNEL
)


class SwitchingUpstream:
    """A raw upstream that records each request head and answers it with ``101`` + bytes."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> SwitchingUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head.decode("latin-1"))
            writer.write(SWITCH)
            await writer.drain()
            await reader.read()  # hold the connection until the proxy lets go
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def header_values(head: str, name: str) -> list[str]:
    """Every value of header ``name`` in a raw request or response head."""
    prefix = name.lower() + ":"
    return [
        line.split(":", 1)[1].strip().lower()
        for line in head.split("\r\n")[1:]
        if line.lower().startswith(prefix)
    ]


async def raw_exchange(address: str, request: bytes, timeout: float = 5.0) -> tuple[str, bytes]:
    """Send raw bytes to the proxy; return the response head and its Content-Length body.

    A raw socket, because HTTP clients refuse to send an Upgrade on a POST or to treat
    what follows a 101 as anything but a protocol they speak.
    """
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(timeout):
            writer.write(request)
            await writer.drain()
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            if head.startswith("HTTP/1.1 101"):
                # A switched connection: whatever comes next is tunnelled; read what is there.
                return head, await reader.read(len(TUNNEL))
            if "chunked" in header_values(head, "transfer-encoding"):
                return head, await read_chunked(reader)
            lengths = header_values(head, "content-length")
            body = await reader.readexactly(int(lengths[0])) if lengths else b""
            return head, body
    finally:
        writer.close()


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readuntil(b"\r\n")
    return body


def upgrade_request(method: str, path: str, port: int, upgrade: str = "websocket") -> bytes:
    body = b'{"model":"m"}' if method == "POST" else b""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Upgrade: {upgrade}\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.fixture(params=["nginx", "caddy"])
async def proxy_to_switching_upstream(request, tmp_path) -> AsyncIterator[tuple[str, Any]]:
    """nginx/Caddy from deploy/ in front of a backend that answers everything with 101."""
    kind: str = request.param
    binary = nginx_binary() if kind == "nginx" else caddy_binary()
    async with SwitchingUpstream() as upstream:
        with running_proxy(kind, binary, tmp_path / kind, upstream.port) as address:
            yield address, upstream


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/responses"),
        ("GET", "/health"),
        ("GET", "/v1/worker/connect/"),
        ("GET", "/v1/worker/connectx"),
    ],
)
async def test_no_route_but_the_worker_socket_can_switch_protocols_through_the_proxy(
    proxy_to_switching_upstream, method, path
):
    address, upstream = proxy_to_switching_upstream
    port = int(address.rsplit(":", 1)[1])
    head, body = await raw_exchange(address, upgrade_request(method, path, port))
    # The client asked for an upgrade and the backend said yes: a proxy that still tunnels
    # here has handed a raw socket to whatever answers on an API route.
    assert not head.startswith("HTTP/1.1 101"), head
    assert TUNNEL not in body
    # Whatever reached the relay carried no Upgrade and no `Connection: upgrade`.
    for seen in upstream.heads:
        assert header_values(seen, "upgrade") == [], seen
        assert not any("upgrade" in v for v in header_values(seen, "connection")), seen


async def test_the_worker_route_still_switches_protocols_through_the_proxy(
    proxy_to_switching_upstream,
):
    address, upstream = proxy_to_switching_upstream
    port = int(address.rsplit(":", 1)[1])
    request = upgrade_request("GET", "/v1/worker/connect?provider=local", port)
    head, tunnelled = await raw_exchange(address, request)
    assert head.startswith("HTTP/1.1 101"), head
    assert tunnelled == TUNNEL
    (seen,) = upstream.heads
    assert header_values(seen, "upgrade") == ["websocket"]
    assert header_values(seen, "connection") == ["upgrade"]


@pytest.mark.live
async def test_a_worker_answering_101_gets_no_tunnel_to_the_client_through_the_proxy(proxied):
    # The attack end to end: a client sends an inference POST that asks for an upgrade to a
    # protocol the server does not handle itself (so it stays an HTTP request), and the
    # worker it is routed to answers 101. Whatever the relay does with that status, the
    # proxy must not switch the client's connection to a raw tunnel.
    server, address = proxied
    port = int(address.rsplit(":", 1)[1])
    async with connect_via(address, server.secret) as ws:
        await register(ws)

        async def answer_with_a_switch() -> None:
            request = await expect(ws, protocol.Request)
            assert "upgrade" not in {name.lower() for name in request.headers}
            switch = protocol.ResponseComplete(
                request_id=request.request_id,
                status_code=101,
                headers={"upgrade": "tunnel", "connection": "upgrade"},
                body=TUNNEL.decode(),
            )
            await ws.send(protocol.encode(switch))

        worker = asyncio.ensure_future(answer_with_a_switch())
        try:
            head, body = await raw_exchange(
                address,
                upgrade_request("POST", "/v1/chat/completions", port, upgrade="tunnel"),
                timeout=10,
            )
        finally:
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
        assert not head.startswith("HTTP/1.1 101"), head
        assert TUNNEL not in body
