"""Attacks replayed against a live server (daphne, or uvicorn on the second pass) on raw
sockets, where a client library would refuse to send them (SPEC §4, §5)."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket

import httpx
import pytest

from relay.core.routes import DEFAULT_ROUTES
from relay.server.cluster.proxy import cluster_token
from relay.wire import protocol
from tests.conftest import REDIS_URL, require_redis
from tests.live import LiveServer
from tests.rawworker import connect, expect, register

pytestmark = pytest.mark.live


async def exchange(server: LiveServer, raw: bytes, *, until: bytes | None = None) -> bytes:
    """Send ``raw`` on a fresh connection; read until ``until`` is seen or the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(raw)
    await writer.drain()
    data = b""
    async with asyncio.timeout(10):
        while until is None or until not in data:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    writer.close()
    return data


def post_head(path: str = "/v1/chat/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


async def test_refused_requests_are_answered_before_their_body_is_read(relay_server_factory):
    with relay_server_factory(
        MODELRELAY_REQUIRE_API_KEYS="true", MAX_REQUEST_BYTES=str(64 * 1024)
    ) as server:
        async with await connect(server) as ws:
            await register(ws)
            # Once one request was answered, the server has loaded its keys.
            ready = await exchange(server, post_head(Content_Length="0"), until=b"}}")
            assert status_of(ready) == 401
            # A 10 GB body is announced and never sent: every answer must come anyway.
            huge = {"Content_Length": str(10 * 1024**3)}
            for headers, status in (
                ({}, 401),
                ({"Authorization": "Bearer mrk_not-a-key"}, 401),
                ({"Authorization": "Bearer mrk_not-a-key", "Content_Type": "text/plain"}, 401),
            ):
                response = await exchange(server, post_head(**huge, **headers), until=b"}}")
                assert status_of(response) == status, response[:200]
            # Chunked, no key: refused on the headers, long before the body ends.
            response = await exchange(
                server,
                post_head(Transfer_Encoding="chunked") + b"10000\r\n" + b"a" * 65536 + b"\r\n",
                until=b"}}",
            )
            assert status_of(response) == 401


PEPPER = "live-security-pepper-0123456789abcdef"
ADMIN_TOKEN = "live-security-admin"
HUGE = str(10 * 1024**3)  # announced, never sent
#: The internal header of cluster mode: absent, a made-up value, and the value the
#: server's own pepper gives, which is no credential while it is not in a cluster.
INTERNAL = [
    {},
    {"X_Modelrelay_Cluster": "not-the-token"},
    {"X_Modelrelay_Cluster": cluster_token(PEPPER)},
]


async def refused(server: LiveServer, head: bytes) -> tuple[int, bytes, bytes]:
    """Send only ``head`` (its body announced, never sent) and read the answer to the
    end: the server must answer and close the connection without waiting for the body."""
    response = await exchange(server, head)
    assert b"\r\n\r\n" in response, response
    head_part, _, body = response.partition(b"\r\n\r\n")
    return status_of(response), head_part.lower(), body


async def test_every_route_is_refused_before_its_body_when_it_will_be_refused_anyway(
    relay_server_factory,
):
    env = {
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "MAX_REQUEST_BYTES": str(64 * 1024),
        "BATCH_FILE_MAX_BYTES": str(256 * 1024),
        "MODELRELAY_ADMIN_TOKEN": ADMIN_TOKEN,
        "MODELRELAY_SECRET_PEPPER": PEPPER,
    }
    with relay_server_factory(**env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            made = await client.post("/admin/keys", json={"name": "edge"}, headers=admin)
            key = {"Authorization": f"Bearer {made.json()['secret']}"}
            async with asyncio.timeout(10):  # the new key is loaded within a sync
                while (await client.get("/v1/models", headers=key)).status_code != 200:
                    await asyncio.sleep(0.05)
        table: list[tuple[str, dict[str, str], int]] = []
        for path in DEFAULT_ROUTES:
            for internal in INTERNAL:
                table += [
                    (path, {**internal, "Content_Length": HUGE}, 401),
                    (path, {**internal, "Transfer_Encoding": "chunked"}, 401),
                    (path, {**internal, **key, "Content_Length": HUGE}, 413),
                    (
                        path,
                        {**internal, **key, "Content_Length": HUGE, "Content_Type": "text/plain"},
                        415,
                    ),
                ]
        for internal in INTERNAL:
            table += [
                ("/api/chat", {**internal, "Content_Length": HUGE}, 401),
                ("/api/chat", {**internal, "Transfer_Encoding": "chunked"}, 401),
                ("/api/chat", {**internal, **key, "Content_Length": HUGE}, 413),
            ]
        table += [
            ("/v1/files", {"Content_Length": HUGE}, 401),
            ("/v1/files", {"Transfer_Encoding": "chunked"}, 401),
            ("/v1/files", {**key, "Content_Length": HUGE}, 413),
            ("/v1/files", {**key, "Transfer_Encoding": "chunked"}, 415),  # not multipart
            ("/v1/batches", {"Transfer_Encoding": "chunked"}, 401),
            ("/v1/messages/batches", {"Content_Length": HUGE}, 401),
            ("/v1/models", {**key, "Content_Length": HUGE}, 405),
            ("/v1/no-such-route", {**key, "Content_Length": HUGE}, 404),
            ("/tokenize", {**key, "Content_Length": HUGE}, 404),
            # A page Django serves: over DATA_UPLOAD_MAX_MEMORY_SIZE, Django would
            # refuse it too, but only after reading all of it.
            ("/django-admin/login/", {"Content_Length": HUGE}, 413),
        ]
        for path, headers, status in table:
            got, head, body = await refused(server, post_head(path, **headers))
            assert got == status, (path, headers, head, body)
            assert b"connection: close" in head, (path, headers, head)
            if path == "/api/chat":
                assert head.count(b"content-type: text/event-stream") == 1
                assert body.startswith(b'{"err":'), body
            elif path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches"):
                assert json.loads(body)["type"] == "error", body
            else:
                assert "error" in json.loads(body), body
            if status == 401:
                assert b"www-authenticate: bearer" in head, head
        # The old API's other methods are refused without reading either.
        got, head, body = await refused(
            server, post_head("/api/chat", Content_Length=HUGE).replace(b"POST", b"PUT", 1)
        )
        assert (got, body) == (405, b'{"err":"invalid request"}\n')
        # A chunked body with a valid key is cut off at the limit (all routes alike).
        chunk = b"8000\r\n" + b" " * 0x8000 + b"\r\n"
        for path in ("/api/chat", "/v1/chat/completions"):
            response = await exchange(
                server, post_head(path, Transfer_Encoding="chunked", **key) + chunk * 3
            )
            assert status_of(response) == 413, (path, response[:300])


@pytest.mark.redis
async def test_only_the_cluster_token_lets_a_request_past_the_early_checks(relay_server_factory):
    require_redis()
    env = {
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": f"mrtest-{secrets.token_hex(4)}",
        "MODELRELAY_SECRET_PEPPER": PEPPER,
        "MODELRELAY_REQUIRE_API_KEYS": "true",
        "MAX_REQUEST_BYTES": str(64 * 1024),
    }
    with relay_server_factory(**env) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            async with asyncio.timeout(10):  # keys loaded: a key check answers 401
                while (await client.get("/v1/models")).status_code != 401:
                    await asyncio.sleep(0.05)
        for wrong in ("not-the-token", cluster_token("another pepper")):
            got, _, _ = await refused(
                server, post_head(Content_Length=HUGE, X_Modelrelay_Cluster=wrong)
            )
            assert got == 401
        # The token: no key asked for, but the size limit still holds (past 64 KiB of
        # the announced body, 413 and not 401: the key check was rightly skipped).
        body = b" " * (65 * 1024)
        head = post_head(Content_Length=HUGE, X_Modelrelay_Cluster=cluster_token(PEPPER))
        response = await exchange(server, head + body)
        assert status_of(response) == 413, response[:400]
        assert b"larger than 65536 bytes" in response
        # Nothing to finish: no graceful stop (its own test is elsewhere; the Redis
        # state has a prefix of its own and expires).
        server.kill()


async def test_the_401_has_the_same_headers_whatever_the_method_and_body(relay_server_factory):
    with relay_server_factory(MODELRELAY_REQUIRE_API_KEYS="true") as server:

        def names(response: bytes) -> list[bytes]:
            head = response.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]
            skip = (b"date", b"server", b"connection", b"content-length")
            return sorted(
                n for n in (line.split(b":", 1)[0] for line in head) if n.lower() not in skip
            )

        get = await exchange(
            server, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", until=b"}}"
        )
        small = await exchange(server, post_head(Content_Length="2") + b"{}", until=b"}}")
        large = await exchange(server, post_head(Content_Length=HUGE))
        assert status_of(get) == status_of(small) == status_of(large) == 401
        assert names(get) == names(small) == names(large), (get, small, large)
        assert b"www-authenticate: bearer" in get.lower()


async def test_a_chunked_body_is_cut_off_at_the_limit(relay_server_factory):
    with relay_server_factory(MAX_REQUEST_BYTES=str(64 * 1024)) as server:
        chunk = b"8000\r\n" + b" " * 0x8000 + b"\r\n"
        response = await exchange(
            server,
            post_head(Transfer_Encoding="chunked") + b"1\r\n{\r\n" + chunk * 2 + chunk,
            until=b"}}",
        )
        assert status_of(response) == 413
        big = {"Content_Length": str(10 * 1024**3)}
        response = await exchange(server, post_head(**big), until=b"}}")
        assert status_of(response) == 413


async def test_a_worker_cannot_answer_two_responses_on_a_client_connection(relay_server_factory):
    smuggled = "HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\npoisoned"
    with relay_server_factory() as server:
        async with await connect(server) as ws:
            await register(ws, max_concurrent=2)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = json.dumps({"model": "m"}).encode()
            request = post_head(Content_Length=str(len(body))) + body
            writer.write(request)
            await writer.drain()
            first = await expect(ws, protocol.Request)
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(
                        request_id=first.request_id, status_code=100, body=smuggled
                    )
                )
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert status_of(head) == 502
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(request)  # the next request on the same keep-alive connection
            await writer.drain()
            second = await expect(ws, protocol.Request)
            await ws.send(
                protocol.encode(
                    protocol.ResponseComplete(
                        request_id=second.request_id, status_code=200, body="genuine"
                    )
                )
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert status_of(head) == 200
            assert await reader.readexactly(len("genuine")) == b"genuine"
            writer.close()


async def test_names_from_outside_cannot_forge_log_lines(relay_server_factory):
    forged = "2026-01-01 00:00:00,000 ERROR   relay: FORGED"
    with relay_server_factory() as server:
        async with await connect(server) as ws:
            await ws.send(
                protocol.encode(
                    protocol.Register(
                        worker_name=f"box\n{forged}", models=["m"], protocol_version="1"
                    )
                )
            )
            await expect(ws, protocol.RegisterAck)
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"GET /v1/worker/connect?provider=evil%0A"
            + forged.replace(" ", "%20").encode()
            + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            b"X-Worker-Secret: wrong\r\n\r\n"
        )
        sock.recv(4096)
        sock.close()
        server.wait_for_log("worker auth failed")
        server.wait_for_log("worker disconnected")
    lines = server.log().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    assert any("box\\n2026-01-01" in line for line in lines)


async def test_a_post_asking_to_upgrade_to_a_websocket_still_gets_an_answer(relay_server_factory):
    with relay_server_factory() as server:
        body = b'{"model":"m"}'
        head = post_head(Content_Length=str(len(body)), Upgrade="websocket", Connection="Upgrade")
        response = await exchange(server, head + body, until=b"\r\n\r\n")
        # Refused (daphne will not upgrade a POST; uvicorn no longer hands it to its
        # WebSocket protocol, which never answered), but answered at once.
        assert status_of(response) in (400, 404, 405)


async def test_invalid_utf8_from_a_worker_is_one_warning_not_a_traceback(relay_server_factory):
    with relay_server_factory() as server:
        async with await connect(server) as ws:
            await register(ws)
            await ws.send(b'{"type":"pong","x":"\xff"}', text=True)
            code = None
            async with asyncio.timeout(5):
                try:
                    while True:
                        await ws.recv()
                except Exception as exc:
                    code = getattr(getattr(exc, "rcvd", None), "code", None)
            assert code == 1007
        server.wait_for_log("worker disconnected")
    assert "Traceback" not in server.log()
