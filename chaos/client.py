"""A raw HTTP/1.1 client on asyncio streams: one request per connection, hang-up on demand.

No HTTP library stands between the harness and the server: the client sees exactly
what came over the socket (status line, headers, the de-chunked body, where it
ended) and can drop the connection at any moment, as a real client that gives up
does (:meth:`Exchange.hangup`). Body bytes can go to a callback as they arrive, so a
scenario can watch a stream's progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOST = "127.0.0.1"


def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bytes:
    """A well-formed request (``Connection: close``, ``Content-Length`` when there is a body)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Reply:
    """What came back. ``complete``: the body ended as its framing says (not by a drop)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    #: "" when a response was read to its end; else what went wrong: "timeout",
    #: "refused", "reset", "eof" (closed mid-response), "hung up" (we left).
    error: str = ""
    elapsed: float = 0.0
    #: Seconds from sending to the first body byte (None when none came).
    first_byte: float | None = None

    @property
    def answered(self) -> bool:
        return self.status > 0 and self.complete


class Exchange:
    """One request on its own connection. ``await run()``; ``hangup()`` from elsewhere."""

    def __init__(
        self,
        port: int,
        raw: bytes,
        *,
        timeout: float,
        on_body: Callable[[bytes], None] | None = None,
    ) -> None:
        self.port = port
        self.raw = raw
        self.timeout = timeout
        self.on_body = on_body
        self.reply = Reply()
        self.sent = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._hung_up = False
        self._started = 0.0
        self._parts: list[bytes] = []

    def hangup(self) -> None:
        """Drop the connection now (a client that gives up: TCP reset, no goodbye)."""
        self._hung_up = True
        if self._writer is not None:
            self._writer.transport.abort()

    async def run(self) -> Reply:
        reply = self.reply
        self._started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                await self._exchange()
        except TimeoutError:
            reply.error = "timeout"
        except ConnectionRefusedError:
            reply.error = "refused"
        except (ConnectionError, OSError):
            reply.error = "reset"
        except asyncio.IncompleteReadError:
            reply.error = "eof"
        except (ValueError, IndexError, asyncio.LimitOverrunError) as exc:
            reply.error = f"not HTTP: {exc}"[:120]
        finally:
            if self._writer is not None:
                self._writer.transport.abort()
            reply.body = b"".join(self._parts)
        if self._hung_up:
            reply.error = "hung up"
        reply.elapsed = time.monotonic() - self._started
        return reply

    async def _exchange(self) -> None:
        reader, writer = await asyncio.open_connection(HOST, self.port, limit=1 << 22)
        self._writer = writer
        if self._hung_up:
            writer.transport.abort()
        writer.write(self.raw)
        self.sent.set()
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        reply = self.reply
        reply.status = int(parts[1])
        for line in lines:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            value = value.strip()
            reply.headers[key] = f"{reply.headers[key]}, {value}" if key in reply.headers else value
        if reply.status in (204, 304) or 100 <= reply.status < 200:
            # No body may follow; whatever does (up to the close) is kept to be judged.
            reply.complete = True
            while data := await reader.read(1 << 16):
                self._parts.append(data)
            return
        if "chunked" in reply.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers from the relay
                    break
                data = await reader.readexactly(size + 2)
                self._body(data[:-2])
        elif "content-length" in reply.headers:
            length = int(reply.headers["content-length"])
            if length:
                self._body(await reader.readexactly(length))
        else:
            while data := await reader.read(1 << 16):
                self._body(data)
        reply.complete = True

    def _body(self, data: bytes) -> None:
        reply = self.reply
        if reply.first_byte is None:
            reply.first_byte = time.monotonic() - self._started
        self._parts.append(data)
        if self.on_body is not None:
            self.on_body(data)


async def fetch(
    port: int,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    """One plain request (health, admin API, the backend's own control routes)."""
    raw = http_request(port, method, path, body, headers)
    return await Exchange(port, raw, timeout=timeout).run()
