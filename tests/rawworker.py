"""A raw WebSocket worker for live-server tests: connect, register, expect frames, see the close.

Speaks the wire protocol with the ``websockets`` client directly (no ``worker.py``),
so a test controls every frame; answers pings while waiting for something else.
"""

from __future__ import annotations

import asyncio

import websockets
from websockets.exceptions import ConnectionClosed

from relay.wire import protocol
from tests.live import LiveServer


async def connect(server: LiveServer, *, secret: str | None = None, **kwargs):
    return await websockets.connect(
        server.ws_url + "?provider=local",
        additional_headers={"X-Worker-Secret": secret or server.secret},
        max_size=None,
        **kwargs,
    )


async def register(ws, models=("m",), max_concurrent=1) -> protocol.RegisterAck:
    await ws.send(
        protocol.encode(
            protocol.Register(
                worker_name="raw",
                models=list(models),
                max_concurrent=max_concurrent,
                protocol_version="1",
            )
        )
    )
    return await expect(ws, protocol.RegisterAck)


async def expect(ws, kind, timeout: float = 5.0):
    async with asyncio.timeout(timeout):
        while True:
            message = protocol.decode_server_message(await ws.recv())
            if isinstance(message, kind):
                return message
            if isinstance(message, protocol.Ping):
                await ws.send(protocol.encode(protocol.Pong(current_load=0)))
                continue
            raise AssertionError(f"expected {kind.__name__}, got {message!r}")


async def closed(ws, timeout: float = 5.0) -> tuple[int | None, str]:
    async with asyncio.timeout(timeout):
        try:
            while True:
                await ws.recv()
        except ConnectionClosed as exc:
            assert exc.rcvd is not None, "the server closed without a close frame"
            return exc.rcvd.code, exc.rcvd.reason
