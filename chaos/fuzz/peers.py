"""Hostile worker peers: many short-lived WebSocket connections sending mutated frames.

Each connection runs one script, picked at random:

- **before register** (40 %): the first frame is a damaged one (any type, any damage):
  the server must close with 1002/1007/1009 (or ack it, if the damage left a valid
  ``register``);
- **session** (45 %): a valid ``register`` (models never include the real one), then
  5-60 frames, most well-formed but hostile (unknown request ids and other workers'
  request ids, stray completions and errors, odd loads and model lists), one in seven
  damaged, until the server closes the connection; the server must drop what is not
  for this worker and close only this connection;
- **answerer** (8 %): registers for ``fuzz-model`` (which the hostile client lane
  requests), waits for requests and answers each with a hostile sequence (odd statuses
  and headers, chunks after the completion, two completions, errors, damaged frames
  carrying its id, a vanishing peer);
- **bad credentials** (4 %): wrong secret, unknown provider, no secret: close 1008;
- **raw framing** (3 %): a hand-made handshake, then bytes that break WebSocket
  framing itself (unmasked frames, reserved opcodes and bits, oversized control
  frames, bad close codes): the server must drop or close that connection.

Close codes the server sends are tallied; 1011 (the server's own error) never may.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from chaos.fuzz.frames import HOSTILE_MODEL, Frame, FrameMaker
from chaos.rig import WORKER_SECRET

#: Close codes a server may answer hostile frames with (RFC 6455 §7.4.1; 1012 on restart).
EXPECTED_CLOSES = {1000, 1001, 1002, 1007, 1008, 1009, 1012}


@dataclass
class PeerTally:
    connections: int = 0
    damaged: int = 0
    well_formed: int = 0
    registers: int = 0
    raw_frames: int = 0
    answered: int = 0
    labels: Counter[str] = field(default_factory=Counter)
    scripts: Counter[str] = field(default_factory=Counter)
    closes: Counter[str] = field(default_factory=Counter)
    #: The last frame sent on connections the server dropped without a close frame.
    dropped_after: Counter[str] = field(default_factory=Counter)
    #: kind -> how often, and a few examples.
    problems: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return self.damaged + self.well_formed

    def problem(self, kind: str, text: str) -> None:
        self.problems[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(text)


class Peers:
    def __init__(self, port: int, maker: FrameMaker, rng: random.Random, tally: PeerTally) -> None:
        self.port = port
        self.url = f"ws://127.0.0.1:{port}/v1/worker/connect"
        self.maker = maker
        self.rng = rng
        self.tally = tally
        self.last: dict[int, str] = {}

    async def run(self, budget: int, concurrency: int) -> None:
        """Connections, ``concurrency`` at a time, until ``budget`` frames were sent."""

        async def lane() -> None:
            while self.tally.frames < budget:
                await self.one()

        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(lane())

    async def one(self) -> None:
        roll = self.rng.random()
        script = (
            "before register"
            if roll < 0.40
            else "session"
            if roll < 0.85
            else "answerer"
            if roll < 0.93
            else "bad credentials"
            if roll < 0.97
            else "raw framing"
        )
        self.tally.scripts[script] += 1
        self.tally.connections += 1
        try:
            async with asyncio.timeout(15):
                if script == "raw framing":
                    await self.raw_framing()
                    return
                if script == "bad credentials":
                    await self.bad_credentials()
                    return
                ws = await self.connect()
                try:
                    if script == "before register":
                        await self.send(ws, self.maker.damaged())
                        await self.closed(ws)
                    elif script == "session":
                        await self.session(ws)
                        await self.closed(ws)
                    elif await self.answerer(ws):
                        await self.closed(ws)
                finally:
                    self.last.pop(id(ws), None)
                    await ws.close()
        except (ConnectionClosed, OSError, InvalidHandshake, TimeoutError) as exc:
            if isinstance(exc, InvalidStatus | TimeoutError):
                kind = f"{script}: {type(exc).__name__}"
                self.tally.problem(kind, f"{kind}: {exc}")

    async def connect(
        self, secret: str = WORKER_SECRET, provider: str = "local"
    ) -> ClientConnection:
        return await connect(
            f"{self.url}?provider={provider}",
            additional_headers={"X-Worker-Secret": secret} if secret else None,
            max_size=None,
            compression=None,
            proxy=None,
            ping_interval=None,
            open_timeout=10,
            close_timeout=2,
        )

    async def send(self, ws: ClientConnection, frame: Frame) -> None:
        if frame.kind == "binary":
            await ws.send(
                frame.payload if isinstance(frame.payload, bytes) else frame.payload.encode()
            )
        else:
            await ws.send(frame.payload, text=True)
        tally = self.tally
        self.last[id(ws)] = frame.label
        if frame.valid:
            tally.well_formed += 1
        else:
            tally.damaged += 1
        tally.labels[frame.label] += 1

    async def register(self, ws: ClientConnection, models: list[str]) -> None:
        document = self.maker.document("register")
        document["models"] = models
        await ws.send(json.dumps(document))
        self.tally.registers += 1

    async def session(self, ws: ClientConnection) -> None:
        """Register, then well-formed hostile frames with damaged ones among them until the
        server closes the connection (most damage does) or 60 frames went."""
        await self.register(ws, self.maker.models())
        for _ in range(self.rng.randint(5, 60)):
            if self.rng.random() < 0.85:
                await self.send(ws, self.maker.valid())
                continue
            await self.send(ws, self.maker.damaged())
            try:
                # Most damage closes the connection within milliseconds; frames sent
                # after that would only be counted, never read.
                await asyncio.wait_for(ws.wait_closed(), 0.03)
                return
            except TimeoutError:
                pass
        await self.send(ws, self.maker.damaged())

    async def answerer(self, ws: ClientConnection) -> bool:
        """Serve up to three requests with hostile frames; True when the server should close."""
        await self.register(ws, [HOSTILE_MODEL])
        for _ in range(3):
            request = await self.next_request(ws, 1.0)
            if request is None:
                return False
            self.tally.answered += 1
            ending = await self.answer(ws, str(request["request_id"]))
            if ending is not None:
                return ending
        return False

    async def answer(self, ws: ClientConnection, rid: str) -> bool | None:
        """One hostile answer; None when the connection is still usable afterwards."""
        maker, rng = self.maker, self.rng
        chunk = {"type": "response_chunk", "request_id": rid, "chunk": "data: {}\n\n"}
        done = maker.document("response_complete", rid)
        done["request_id"] = rid
        plan = rng.randint(0, 7)
        if plan == 0:  # a normal answer: chunks, then the completion
            for _ in range(rng.randint(0, 5)):
                await ws.send(json.dumps(chunk))
            await ws.send(json.dumps(done))
        elif plan == 1:  # hostile status and headers
            done["status_code"] = rng.choice([0, 100, 101, 199, 204, 304, 599, 600, 999])
            done["headers"] = maker.hostile_headers()
            await ws.send(json.dumps(done))
        elif plan == 2:  # chunks after the completion, then a second completion
            await ws.send(json.dumps(done))
            await ws.send(json.dumps(chunk))
            await ws.send(json.dumps(done))
        elif plan == 3:  # an error report for it
            error = {"type": "error", "request_id": rid, "message": "boom", "code": "x"}
            await ws.send(json.dumps(error))
        elif plan == 4:  # "I am shutting down": the server requeues it
            error = {
                "type": "error",
                "request_id": rid,
                "message": "bye",
                "code": "worker_draining",
            }
            await ws.send(json.dumps(error))
        elif plan == 5:  # a damaged frame carrying its id
            await self.send(ws, maker.damaged(own=rid))
            return True
        elif plan == 6:  # more than one message may hold, streamed to a non-streaming client
            big = dict(chunk, chunk="z" * (maker.max_message // 2))
            for _ in range(3):
                await ws.send(json.dumps(big))
            await ws.send(json.dumps(done))
        else:  # vanish mid-answer
            await ws.send(json.dumps(chunk))
            ws.transport.abort()
            return False
        return None

    async def next_request(self, ws: ClientConnection, timeout: float) -> dict[str, Any] | None:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = json.loads(await ws.recv())
                    if isinstance(message, dict) and message.get("type") == "request":
                        return message
        except TimeoutError:
            return None

    async def closed(self, ws: ClientConnection, timeout: float = 0.3) -> None:
        """Record how the server closed (or, after ``timeout``, that it did not)."""
        try:
            async with asyncio.timeout(timeout):
                async for _ in ws:
                    pass
        except TimeoutError:
            self.tally.closes["open (we closed)"] += 1
            return
        except ConnectionClosed:
            pass
        self._record_close(ws)

    def _record_close(self, ws: ClientConnection) -> None:
        rcvd = ws.close_code if ws.protocol.close_rcvd is not None else None
        if rcvd is None:
            self.tally.closes["dropped (no close frame)"] += 1
            self.tally.dropped_after[self.last.get(id(ws), "register")] += 1
            return
        self.tally.closes[str(rcvd)] += 1
        if rcvd not in EXPECTED_CLOSES:
            self.tally.problem(
                f"server closed with {rcvd}", f"server closed with {rcvd}: {ws.close_reason!r}"
            )

    async def bad_credentials(self) -> None:
        secret, provider = self.rng.choice(
            [("mrw_wrong", "local"), (WORKER_SECRET, "no-such-provider"), ("", "local")]
        )
        try:
            ws = await self.connect(secret, provider)
        except InvalidStatus as exc:
            self.tally.closes[f"handshake {exc.response.status_code}"] += 1
            return
        try:
            await self.closed(ws, 5)
            if ws.close_code != 1008:
                kind = f"bad credentials closed with {ws.close_code}"
                self.tally.problem(kind, f"{kind}, not 1008")
        finally:
            await ws.close()

    async def raw_framing(self) -> None:
        """A valid handshake, then bytes that break WebSocket framing."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        label = "handshake"
        try:
            key = base64.b64encode(os.urandom(16)).decode()
            writer.write(
                (
                    "GET /v1/worker/connect?provider=local HTTP/1.1\r\n"
                    f"Host: 127.0.0.1:{self.port}\r\nUpgrade: websocket\r\n"
                    f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                    f"Sec-WebSocket-Version: 13\r\nX-Worker-Secret: {WORKER_SECRET}\r\n\r\n"
                ).encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            if b" 101 " not in head.split(b"\r\n", 1)[0]:
                self.tally.problem("raw handshake refused", f"raw handshake refused: {head[:60]!r}")
                return
            label, data = self.bad_frame()
            writer.write(data)
            self.tally.raw_frames += 1
            self.tally.labels[f"raw: {label}"] += 1
            await writer.drain()
            async with asyncio.timeout(5):
                while await reader.read(65536):
                    pass
            self.tally.closes["raw: connection ended"] += 1
        except TimeoutError:
            if label == "noise":
                # Random bytes may be the start of a valid frame whose payload is still
                # to come: waiting for it is allowed.
                self.tally.closes["raw: noise, still open"] += 1
                return
            self.tally.problem(
                f"kept open after: {label}",
                f"after a raw {label} the server kept the connection open for 5 s",
            )
        finally:
            writer.transport.abort()

    def bad_frame(self) -> tuple[str, bytes]:
        """Bytes that break WebSocket framing (RFC 6455 §5), and what they break."""
        rng = self.rng
        mask = rng.randbytes(4)

        def frame(first: int, payload: bytes, masked: bool = True) -> bytes:
            size = len(payload)
            bit = 0x80 if masked else 0
            if size < 126:
                length = bytes([bit | size])
            elif size < 65536:
                length = bytes([bit | 126]) + struct.pack("!H", size)
            else:
                length = bytes([bit | 127]) + struct.pack("!Q", size)
            if masked:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                return bytes([first]) + length + mask + payload
            return bytes([first]) + length + payload

        text = b'{"type":"pong"}'
        return rng.choice(
            [
                ("unmasked frame", frame(0x81, text, masked=False)),
                ("reserved opcode", frame(0x83, text)),
                ("RSV1 without an extension", frame(0xC1, text)),
                ("control frame over 125 bytes", frame(0x89, b"p" * 200)),
                ("fragmented control frame", frame(0x09, b"p")),
                ("continuation with nothing to continue", frame(0x80, text)),
                ("close code 1005 on the wire", frame(0x88, struct.pack("!H", 1005))),
                ("one-byte close payload", frame(0x88, b"\x03")),
                ("new message inside a fragmented one", frame(0x01, text) + frame(0x81, text)),
                ("64-bit length with the top bit set", bytes([0x81, 0xFF]) + b"\xff" * 8 + mask),
                ("noise", rng.randbytes(rng.randint(1, 64))),
            ]
        )
