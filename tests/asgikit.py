"""Drive the real ASGI application in-process: fake workers and HTTP clients.

``FakeWorker`` speaks the wire protocol through Channels' ``WebsocketCommunicator``;
``HttpCall`` is a client request through asgiref's ``ApplicationCommunicator`` that
can read a response chunk by chunk and hang up (``http.disconnect``) at any point.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
from asgiref.testing import ApplicationCommunicator
from channels.testing import WebsocketCommunicator

from relay.wire import protocol

SECRET = "mrw_asgi-test-secret"


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded: the bound is only ever
    reached when something is wrong, or on a machine much slower than expected)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def app() -> Any:
    from modelrelay_site.asgi import application

    return application


async def make_provider(name: str = "local", secret: str = SECRET, **fields: Any) -> Any:
    from workers_app.models import Provider

    provider = Provider(name=name, **fields)
    provider.set_secret(secret)
    await provider.asave()
    return provider


class FakeWorker:
    def __init__(
        self,
        *,
        provider: str | None = "local",
        secret: str | None = SECRET,
        via_query: bool = False,
        client: tuple[str, int] = ("192.0.2.10", 40000),
        headers: list[tuple[bytes, bytes]] | None = None,
        application: Any = None,
    ) -> None:
        query = []
        if provider is not None:
            query.append(f"provider={provider}")
        hdrs = list(headers or [])
        if secret is not None:
            if via_query:
                query.append(f"worker_secret={secret}")
            else:
                hdrs.append((b"x-worker-secret", secret.encode()))
        path = "/v1/worker/connect" + ("?" + "&".join(query) if query else "")
        self.comm = WebsocketCommunicator(application or app(), path, headers=hdrs)
        self.comm.scope["client"] = client
        self.closed: tuple[int, str] | None = None
        self.ack: protocol.RegisterAck | None = None

    async def __aenter__(self) -> FakeWorker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

    async def connect(self) -> bool:
        connected, _ = await self.comm.connect(timeout=5)
        return bool(connected)

    async def register(
        self,
        models: list[str] | None = None,
        *,
        max_concurrent: int = 1,
        name: str = "gpu-1",
        **extra: Any,
    ) -> protocol.RegisterAck:
        assert await self.connect(), "handshake refused"
        await self.send(
            protocol.Register(
                worker_name=name,
                models=["m"] if models is None else models,
                max_concurrent=max_concurrent,
                protocol_version=extra.pop("protocol_version", "1"),
                **extra,
            )
        )
        ack = await self.expect(protocol.RegisterAck)
        self.ack = ack
        return ack

    async def send(self, message: Any) -> None:
        if isinstance(message, str):
            text = message
        elif isinstance(message, dict):
            text = json.dumps(message)
        else:
            text = protocol.encode(message)
        await self.comm.send_input({"type": "websocket.receive", "text": text})

    async def send_bytes(self, data: bytes) -> None:
        await self.comm.send_input({"type": "websocket.receive", "bytes": data})

    async def recv(self, timeout: float = 3.0) -> protocol.ServerMessage:
        """The next frame; raises AssertionError if the server closed instead."""
        output = await self.comm.receive_output(timeout)
        if output["type"] == "websocket.close":
            self.closed = (output.get("code", 1000), output.get("reason", ""))
            raise AssertionError(f"socket closed: {self.closed}")
        return protocol.decode_server_message(output["text"])

    async def expect(self, kind: type, timeout: float = 3.0) -> Any:
        """The next frame of ``kind``, skipping pings."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.recv(timeout)
                if isinstance(message, kind):
                    return message
                if not isinstance(message, protocol.Ping):
                    raise AssertionError(f"expected {kind.__name__}, got {message!r}")

    async def wait_closed(self, timeout: float = 3.0) -> tuple[int, str]:
        """Read until the server closes the socket; returns (code, reason)."""
        async with asyncio.timeout(timeout):
            while self.closed is None:
                output = await self.comm.receive_output(timeout)
                if output["type"] == "websocket.close":
                    self.closed = (output.get("code", 1000), output.get("reason", ""))
        return self.closed

    async def disconnect(self, code: int = 1000) -> None:
        try:
            await self.comm.send_input({"type": "websocket.disconnect", "code": code})
            await self.comm.wait(timeout=5)
        except Exception:
            await self.comm.future  # surface the consumer's own error, if any

    # -- answering requests ------------------------------------------------------

    async def answer(
        self,
        request_id: str,
        body: str = '{"ok":true}',
        status: int = 200,
        headers: dict[str, str] | None = None,
        **counts: int,
    ) -> None:
        await self.send(
            protocol.ResponseComplete(
                request_id=request_id,
                status_code=status,
                headers={"content-type": "application/json"} if headers is None else headers,
                body=body,
                token_counts=msgspec.convert(counts, protocol.TokenCounts) if counts else None,
            )
        )

    async def chunk(self, request_id: str, text: str) -> None:
        await self.send(protocol.ResponseChunk(request_id=request_id, chunk=text))


class HttpCall:
    """One HTTP request to the ASGI app, readable chunk by chunk."""

    def __init__(
        self,
        method: str,
        path: str,
        body: bytes | str | dict[str, Any] = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        *,
        content_type: bytes | None = b"application/json",
        application: Any = None,
    ) -> None:
        if isinstance(body, dict):
            body = json.dumps(body)
        self.body = body.encode() if isinstance(body, str) else body
        hdrs = list(headers or [])
        if content_type is not None and (self.body or method == "POST"):
            hdrs.append((b"content-type", content_type))
        path_only, _, query = path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path_only,
            "raw_path": path_only.encode(),
            "query_string": query.encode(),
            "headers": hdrs,
            "client": ("198.51.100.7", 51000),
            "server": ("testserver", 80),
        }
        self.comm = ApplicationCommunicator(application or app(), scope)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.raw_headers: list[tuple[str, str]] = []

    async def send(self, *, split: int | None = None) -> HttpCall:
        if split:
            parts = [self.body[i : i + split] for i in range(0, len(self.body), split)] or [b""]
            for index, part in enumerate(parts):
                await self.comm.send_input(
                    {"type": "http.request", "body": part, "more_body": index < len(parts) - 1}
                )
        else:
            await self.comm.send_input({"type": "http.request", "body": self.body})
        return self

    async def start(self, timeout: float = 3.0) -> int:
        message = await self.comm.receive_output(timeout)
        assert message["type"] == "http.response.start", message
        self.status = message["status"]
        self.raw_headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
        self.headers = dict(self.raw_headers)
        return self.status

    async def chunk(self, timeout: float = 3.0) -> tuple[bytes, bool]:
        message = await self.comm.receive_output(timeout)
        assert message["type"] == "http.response.body", message
        return message.get("body", b""), message.get("more_body", False)

    async def read_rest(self, timeout: float = 3.0) -> bytes:
        parts = []
        while True:
            data, more = await self.chunk(timeout)
            parts.append(data)
            if not more:
                # Let the app finish as a server would (Django closes its database
                # connection only after the last body message was sent).
                await self.comm.wait(timeout)
                return b"".join(parts)

    async def response(self, timeout: float = 3.0) -> tuple[int, dict[str, str], bytes]:
        status = await self.start(timeout)
        return status, self.headers, await self.read_rest(timeout)

    async def json(self, timeout: float = 3.0) -> tuple[int, Any]:
        status, _, body = await self.response(timeout)
        return status, json.loads(body)

    async def disconnect(self) -> None:
        await self.comm.send_input({"type": "http.disconnect"})
        await self.comm.wait(timeout=5)

    async def finished(self) -> None:
        await self.comm.wait(timeout=5)


def chat(model: str = "m", stream: bool | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream is not None:
        body["stream"] = stream
    body.update(extra)
    return body
