"""A lean Redis client for the scripts a cluster runs on every request.

Placing a request, releasing its slot and admitting its key are one Lua script each
(:mod:`relay.server.cluster.state`, :mod:`relay.server.cluster.limits`). Through redis-py's
asyncio client each call cost this process 110 to 170 µs of CPU (a connection taken from
the pool and given back, a timeout wrapped around every read, the reply parsed in
Python; with hiredis parsing the replies, barely less): more than the rest of the
request (``bench/redis_clients.py``, docs/CLUSTER.md). This client keeps one connection, writes
each command as soon as it is called and matches replies to callers in order
(pipelining for free when many requests are placed at once), and parses RESP2 replies
with a few slices.

It speaks what those scripts need: ``EVALSHA`` with a ``SCRIPT LOAD`` when the server
does not know the script (after a restart or ``SCRIPT FLUSH``). Errors are redis-py's
exception types, so callers handle both clients alike: a lost or stalled connection
raises :class:`redis.exceptions.ConnectionError` in every caller waiting on it (one
watchdog per connection instead of a timer per call), and the next call reconnects.
A ``-READONLY`` reply (the server was a master and is a replica now, after a failover)
counts as a lost connection too. Behind Sentinel the client is given a ``locate``
coroutine (:class:`relay.server.cluster.redissource.RedisSource`) and asks it where the
master is at each connect.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

#: A reply not complete within this long means the server or the link is stuck.
REPLY_SECS = 5.0
CONNECT_SECS = 2.0

Reply = Any
#: Where the master is now (Sentinel): asked at every connect.
Locate = Callable[[], Awaitable[tuple[str, int]]]


def _encode(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, bool):
            raise TypeError("booleans are ambiguous in Redis commands")
        elif isinstance(arg, int | float):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Incomplete(Exception):
    pass


_INTEGER = re.compile(rb"-?[0-9]{1,20}")


def _integer(line: bytes) -> int:
    """A RESP integer: ASCII digits with an optional minus, nothing else (``int()`` alone
    would take ``+``, ``_``, spaces and non-ASCII digits)."""
    if _INTEGER.fullmatch(line) is None:
        raise RedisConnectionError(f"malformed number in a reply from Redis: {line[:30]!r}")
    return int(line)


def _parse(buf: bytes, pos: int) -> tuple[Reply, int]:
    """One RESP2 reply from ``buf`` at ``pos``: (value, position after it)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos : pos + 1], buf[pos + 1 : end]
    pos = end + 2
    if kind == b"$":
        size = _integer(line)
        if size == -1:
            return None, pos
        if size < 0:
            raise RedisConnectionError(f"negative length in a reply from Redis: {size}")
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return buf[pos : pos + size], pos + size + 2
    if kind == b":":
        return _integer(line), pos
    if kind == b"+":
        return line, pos
    if kind == b"-":
        message = line.decode(errors="replace")
        if message.startswith("NOSCRIPT"):
            return NoScriptError(message), pos
        return ResponseError(message), pos
    if kind == b"*":
        count = _integer(line)
        if count == -1:
            return None, pos
        if count < 0:
            raise RedisConnectionError(f"negative count in a reply from Redis: {count}")
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    raise RedisConnectionError(f"unexpected reply from Redis: {buf[pos - 2 : pos + 30]!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, client: LeanRedis) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        #: Callers waiting for a reply, oldest first, with the loop time it was asked.
        self.waiting: deque[tuple[asyncio.Future[Reply], float]] = deque()
        self.buf = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports implement asyncio.Transport without subclassing it.)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = _parse(buf, pos)
                if not self.waiting:
                    raise RedisConnectionError("Redis replied to nothing")
                if isinstance(value, ResponseError) and str(value).startswith("READONLY"):
                    # A demoted master: every call on this connection would fail the same
                    # way. Reconnecting finds the new master.
                    self.fail(RedisConnectionError(f"Redis is a replica now: {value}"))
                    return
                future, _ = self.waiting.popleft()
                if not future.done():
                    future.set_result(value)
        except _Incomplete:
            pass
        except (RedisConnectionError, ValueError) as exc:
            self.fail(RedisConnectionError(f"bad reply from Redis: {exc}"))
            return
        self.buf = buf[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def fail(self, exc: Exception) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        if self.client._proto is self:
            self.client._proto = None


class LeanRedis:
    """``await client.evalsha(script, *args)``: one connection, replies in order."""

    def __init__(
        self,
        url: str,
        reply_secs: float = REPLY_SECS,
        name: str | None = None,
        *,
        locate: Locate | None = None,
        password: str | None = None,
    ) -> None:
        """``name``: what ``CLIENT LIST`` calls the connection (``CLIENT SETNAME``);
        ``locate``: asked for the address at each connect (instead of the URL's host and
        port), with ``password`` when the URL carries none."""
        parts = urlsplit(url)
        self.locate = locate
        self.reply_secs = reply_secs
        self.name = name
        if parts.scheme not in ("redis", ""):
            raise ValueError(f"the lean Redis client speaks redis:// only, not {parts.scheme}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.password = unquote(parts.password) if parts.password else password
        self.username = unquote(parts.username) if parts.username else None
        path = parts.path.lstrip("/")
        self.db = int(path) if path else 0
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            if self.locate is not None:
                async with asyncio.timeout(self.reply_secs):
                    self.host, self.port = await self.locate()
            async with asyncio.timeout(min(CONNECT_SECS, self.reply_secs)):
                _, proto = await loop.create_connection(
                    lambda: _Protocol(self), self.host, self.port
                )
                setup: list[tuple[Any, ...]] = []
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    setup.append(("AUTH", *auth))
                if self.db:
                    setup.append(("SELECT", self.db))
                if self.name:
                    setup.append(("CLIENT", "SETNAME", self.name))
                if self.locate is not None:
                    # A sentinel that has not heard of a failover yet names the old
                    # master, which may be back as a replica.
                    setup.append(("ROLE",))
                for command in setup:
                    reply = await self._send(proto, command)
                    if isinstance(reply, Exception):
                        proto.fail(RedisConnectionError(str(reply)))
                        raise RedisConnectionError(f"Redis refused {command[0]}: {reply}")
                    if command[0] == "ROLE" and reply[:1] != [b"master"]:
                        proto.fail(RedisConnectionError("not the master"))
                        raise RedisConnectionError(
                            f"{self.host}:{self.port} is not the master (yet)"
                        )
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot reach Redis at {self.host}:{self.port}: {exc}")
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch())
        return proto

    async def _protocol(self) -> _Protocol:
        if self._proto is not None and not self._proto.lost:
            return self._proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            proto = await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None
        self._proto = proto
        return proto

    def _send(self, proto: _Protocol, command: tuple[Any, ...]) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        if proto.lost or proto.transport is None:
            future.set_exception(RedisConnectionError("connection to Redis lost"))
            return future
        proto.transport.write(_encode(command))
        proto.waiting.append((future, loop.time()))
        return future

    async def execute(self, *command: Any) -> Reply:
        reply = await self._send(await self._protocol(), command)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def evalsha(self, sha: str, script: bytes, keys: Any, args: Any) -> Reply:
        """Run a script by its digest, loading it first if the server lost it."""
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        try:
            return await self.execute(*command)
        except NoScriptError:
            await self.execute("SCRIPT", "LOAD", script)
            return await self.execute(*command)

    async def _watch(self) -> None:
        """Fail a connection whose oldest reply is overdue (one timer, not one per call)."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(self.reply_secs / 10)
            proto = self._proto
            overdue = (
                proto is not None
                and proto.waiting
                and proto.waiting[0][1] < loop.time() - self.reply_secs
            )
            if overdue:
                assert proto is not None
                proto.fail(RedisConnectionError(f"Redis did not reply within {self.reply_secs} s"))

    def drop(self, reason: str) -> None:
        """Fail the connection now (its callers get ``ConnectionError``); the next call
        connects again (to where ``locate`` says the master is)."""
        if self._proto is not None:
            self._proto.fail(RedisConnectionError(reason))

    async def aclose(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._proto is not None:
            self._proto.fail(RedisConnectionError("client closed"))


class Script:
    """A Lua script run through :class:`LeanRedis`, called like redis-py's
    (``await script(keys=[...], args=[...])``)."""

    def __init__(self, client: LeanRedis, source: str) -> None:
        self.client = client
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest()

    async def __call__(self, keys: Any = (), args: Any = ()) -> Reply:
        return await self.client.evalsha(self.sha, self.source, keys, args)


def lean_client(
    url: str, reply_secs: float = REPLY_SECS, name: str | None = None
) -> LeanRedis | None:
    """The lean client for ``url``, or None where it does not apply (TLS, a Unix
    socket, or options it does not read): callers then keep using redis-py."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.query:
        return None
    return LeanRedis(url, reply_secs, name)
