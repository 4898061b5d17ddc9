"""The worker's frames to the relay: in order, batched per event-loop turn, bounded.

A :class:`relay.worker.session.Session` writes everything it sends through one
:class:`Outbox`. Streamed chunks are *posted* from the backend connections' read
callbacks (:mod:`relay.worker.connection`): each is queued and all queued frames go
out together at the end of the current event-loop turn, in one socket write. Nothing
waits for more data: a turn lasts microseconds, and only frames that are already
waiting share a write. Other frames are *sent* by tasks, after everything posted.

When the relay reads slower than the worker writes (the connection's write buffer
passes its high-water mark), every backend response being streamed is held
(:meth:`relay.worker.connection.BackendConnection.hold`) until the buffer drains, as
``await ws.send()`` held each request before. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.frames import apply_mask
from websockets.protocol import State

from relay.wire.protocol import ServerMessage, WorkerMessage
from relay.worker.connection import BackendConnection

_encode = msgspec.json.Encoder().encode


def encode(message: WorkerMessage | ServerMessage) -> bytes:
    """A message as the UTF-8 text of one frame (``relay.wire.protocol.encode``, as bytes)."""
    return _encode(message)


def chunk_prefix(request_id: str) -> bytes:
    """The fixed start of every ``response_chunk`` frame of one request."""
    return b'{"type":"response_chunk","request_id":' + _encode(request_id) + b',"chunk":'


def chunk_frame(prefix: bytes, text: str) -> bytes:
    """Exactly ``encode(ResponseChunk(request_id=..., chunk=text))``, from its prefix."""
    return prefix + _encode(text) + b"}"


Spawn = Callable[[Coroutine[Any, Any, Any], str], Any]

#: RFC 6455 §5.2: FIN + text opcode, then MASK + the payload length in 7, 16 or 64 bits.
_SHORT = struct.Struct("!BB")
_MEDIUM = struct.Struct("!BBH")
_LONG = struct.Struct("!BBQ")
_FIN_TEXT, _MASK = 0x81, 0x80


def masked_text_frames(payloads: list[bytes]) -> bytes:
    """Each payload as one masked, unfragmented text frame, as a client must send it.

    What ``websockets`` writes for ``send_text`` without extensions (the worker
    negotiates none), built at a tenth of the cost: one random draw for every
    frame's masking key, no frame object.
    """
    keys = os.urandom(4 * len(payloads))
    out: list[bytes] = []
    for i, data in enumerate(payloads):
        key = keys[4 * i : 4 * i + 4]
        size = len(data)
        if size < 126:
            head = _SHORT.pack(_FIN_TEXT, _MASK | size)
        elif size < 65536:
            head = _MEDIUM.pack(_FIN_TEXT, _MASK | 126, size)
        else:
            head = _LONG.pack(_FIN_TEXT, _MASK | 127, size)
        out += (head, key, apply_mask(data, key))
    return b"".join(out)


class Outbox:
    """Frames for one relay connection; see the module docstring."""

    def __init__(self, ws: ClientConnection, spawn: Spawn) -> None:
        self.ws = ws
        self._spawn = spawn
        self._loop = asyncio.get_running_loop()
        self._pending: list[bytes] = []
        self._scheduled = False
        self._streams: set[BackendConnection] = set()
        self._congested = False

    def post(self, frame: bytes) -> None:
        """Queue ``frame``; it is written at the end of this event-loop turn."""
        self._pending.append(frame)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write every queued frame now, in one socket write."""
        self._scheduled = False
        frames = self._pending
        if not frames:
            return
        self._pending = []
        ws = self.ws
        if ws.protocol.state is not State.OPEN:
            return  # the connection is ending: so is the session, with its requests
        # Complete frames, written between websockets' own (it writes whole frames too,
        # and the worker never sends a fragmented message).
        transport = ws.transport
        transport.write(masked_text_frames(frames))
        if not self._congested and (
            transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]
        ):
            self._congest()

    async def send(self, frame: bytes) -> None:
        """Write ``frame`` after everything posted; waits while the relay reads slowly.

        Raises ``ConnectionClosed`` once the connection is closed.
        """
        self.flush()
        await self.ws.send(frame, text=True)

    # -- holding streams while the relay connection is full ------------------------------

    def watch(self, stream: BackendConnection) -> None:
        """``stream`` posts chunks: hold it whenever the relay connection is full."""
        self._streams.add(stream)
        if self._congested:
            stream.hold()

    def unwatch(self, stream: BackendConnection) -> None:
        self._streams.discard(stream)
        if self._congested:
            stream.release()

    def _congest(self) -> None:
        self._congested = True
        for stream in self._streams:
            stream.hold()
        self._spawn(self._until_drained(), "relay connection drain")

    async def _until_drained(self) -> None:
        try:
            await self.ws.drain()
        finally:
            self._congested = False
            for stream in list(self._streams):
                stream.release()
