"""The lean Redis client of the per-request scripts: real Redis, and raw sockets on
127.0.0.1 playing a Redis that stalls, breaks off, or answers garbage."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from relay.server.cluster.leanredis import LeanRedis, Script, lean_client
from tests.conftest import REDIS_HOST, REDIS_PORT, REDIS_URL, redis_url, require_redis

URL = REDIS_URL

ECHO = """
-- {tag}
if ARGV[1] == 'nil' then return false end
if ARGV[1] == 'list' then return {{KEYS[1], tonumber(ARGV[2]), {{ 'nested', false }}}} end
if ARGV[1] == 'error' then return redis.error_reply('refused here') end
return ARGV[1]
"""


@pytest.fixture
def redis_server() -> None:
    require_redis()


@asynccontextmanager
async def lean_at(url: str, reply_secs: float = 5.0) -> AsyncIterator[LeanRedis]:
    lean = LeanRedis(url, reply_secs)
    try:
        yield lean
    finally:
        await lean.aclose()


def echo_script(client: LeanRedis) -> Script:
    return Script(client, ECHO.format(tag=secrets.token_hex(8)))  # never loaded before


@pytest.mark.redis
async def test_scripts_run_with_keys_and_args_and_give_redis_py_shaped_replies(redis_server):
    reference = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    async with lean_at(URL) as lean:
        script = echo_script(lean)  # the first call meets NOSCRIPT and loads it
        same = reference.register_script(script.source.decode())
        cases: list[list[str | int]] = [["text"], ["nil"], ["list", 42], [""], ["é" * 3]]
        for args in cases:
            mine = await script(keys=["k1"], args=args)
            theirs = await same(keys=["k1"], args=args)
            assert mine == theirs, args
        assert await script(keys=["k"], args=["list", 7]) == [b"k", 7, [b"nested", None]]
        with pytest.raises(ResponseError, match="refused here"):
            await script(keys=["k"], args=["error"])
        assert await script(keys=["k"], args=["still fine"]) == b"still fine"
    await reference.aclose()


@pytest.mark.redis
async def test_many_callers_at_once_each_get_their_own_reply(redis_server):
    async with lean_at(URL) as lean:
        script = echo_script(lean)
        replies = await asyncio.gather(*(script(keys=["k"], args=[str(n)]) for n in range(2000)))
        assert replies == [str(n).encode() for n in range(2000)]


@pytest.mark.redis
async def test_the_database_in_the_url_is_selected(redis_server):
    key = f"lean-test-{secrets.token_hex(4)}"
    other = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=3)
    async with lean_at(redis_url(3)) as lean:
        setter = Script(lean, "return redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)")
        assert await setter(keys=[key], args=["here"]) == b"OK"
    try:
        assert await other.get(key) == b"here"
    finally:
        await other.delete(key)
        await other.aclose()


@pytest.mark.redis
async def test_its_connection_carries_its_name_in_client_list(redis_server):
    name = f"modelrelay:{secrets.token_hex(2)}:place"
    lean = LeanRedis(URL, name=name)
    reference = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    try:
        assert await echo_script(lean)(keys=["k"], args=["named"]) == b"named"
        names = [c["name"] for c in await reference.client_list()]
        assert names.count(name) == 1
    finally:
        await lean.aclose()
        await reference.aclose()


def test_only_plain_redis_urls_use_it():
    assert lean_client(REDIS_URL) is not None
    assert lean_client("redis://:secret@10.0.0.2:6380/2") is not None
    assert lean_client(REDIS_URL.replace("redis://", "rediss://", 1)) is None  # TLS: redis-py
    assert lean_client("unix:///run/redis.sock") is None
    assert lean_client(REDIS_URL + "?socket_timeout=3") is None


# -- a Redis that misbehaves, on a raw socket --------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def fake_redis(handler: Handler) -> AsyncIterator[str]:
    connections: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for writer in connections:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    count = int((await reader.readline())[1:])
    parts = []
    for _ in range(count):
        size = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(size + 2))[:-2])
    return parts


async def test_a_reply_split_into_single_bytes_is_put_back_together():
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            command = await read_command(reader)
            reply = b"*3\r\n$5\r\nhello\r\n:12\r\n*1\r\n$-1\r\n"
            assert command[0] == b"EVALSHA"
            for i in range(len(reply)):
                writer.write(reply[i : i + 1])
                await writer.drain()

    async with fake_redis(trickle) as url, lean_at(url) as lean:
        script = Script(lean, "return 1")
        assert await script(args=["a"]) == [b"hello", 12, [None]]
        assert await script(args=["b"]) == [b"hello", 12, [None]]


async def test_a_stalled_redis_fails_the_waiting_calls_and_the_next_call_reconnects():
    connected = []

    async def stall_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.append(writer)
        while True:
            await read_command(reader)
            if len(connected) > 1:  # the second connection answers
                writer.write(b"+OK\r\n")
                await writer.drain()

    async with fake_redis(stall_first) as url, lean_at(url, reply_secs=0.2) as lean:
        script = Script(lean, "return 1")
        async with asyncio.timeout(10):
            calls = [asyncio.ensure_future(script(args=[n])) for n in range(3)]
            for call in calls:
                with pytest.raises(RedisConnectionError, match="did not reply"):
                    await call
            assert await script(args=["again"]) == b"OK"
        assert len(connected) == 2


async def test_a_connection_cut_mid_reply_fails_every_waiting_call():
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_command(reader)
        await read_command(reader)
        writer.write(b"$10\r\nhalf")  # half a reply to the first, then gone
        await writer.drain()
        writer.transport.abort()

    async with fake_redis(cut) as url, lean_at(url) as lean:
        script = Script(lean, "return 1")
        async with asyncio.timeout(10):
            first = asyncio.ensure_future(script(args=[1]))
            second = asyncio.ensure_future(script(args=[2]))
            for call in (first, second):
                with pytest.raises(RedisConnectionError, match="lost"):
                    await call


async def test_garbage_from_redis_fails_the_call_instead_of_misreading_it():
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_command(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with fake_redis(garbage) as url, lean_at(url) as lean:
        async with asyncio.timeout(10):
            with pytest.raises(RedisConnectionError, match=r"bad reply|unexpected reply"):
                await Script(lean, "return 1")(args=[1])


async def test_nothing_listening_is_a_connection_error():
    async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with fake_redis(idle) as url:  # take a free port, then close it
        pass
    async with lean_at(url) as lean:
        async with asyncio.timeout(10):
            with pytest.raises(RedisConnectionError, match="cannot reach Redis"):
                await Script(lean, "return 1")(args=[1])


@pytest.mark.parametrize(
    "reply",
    [
        b":\xc2\xb2\r\n",  # a non-ASCII digit
        b":+5\r\n",
        b":1_000\r\n",
        b": 7\r\n",
        b"$-5\r\nxxxxx\r\n",  # a negative length other than "none"
        b"*-2\r\n",
        b"$\xd9\xa1\r\nx\r\n",  # Arabic-Indic one
        b"$99999999999999999999999\r\n",  # beyond any size
        b"*1\r\n:12a\r\n",
    ],
)
async def test_malformed_numbers_from_redis_fail_the_call_and_nothing_else(reply):
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_command(reader)
        writer.write(reply)
        await writer.drain()
        await reader.read()

    async with fake_redis(answer) as url, lean_at(url) as lean:
        async with asyncio.timeout(10):
            with pytest.raises(RedisConnectionError, match=r"malformed|negative"):
                await Script(lean, "return 1")(args=[1])


def _in_two_parts(reply: bytes, cut: int) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_command(reader)
        writer.write(reply[:cut])
        await writer.drain()
        await asyncio.sleep(0)
        writer.write(reply[cut:])
        await writer.drain()
        await reader.read()

    return handler


async def test_a_reply_truncated_anywhere_waits_for_the_rest():
    reply = b"*2\r\n$5\r\nhello\r\n:-12\r\n"
    for cut in range(1, len(reply)):
        async with fake_redis(_in_two_parts(reply, cut)) as url, lean_at(url) as lean:
            async with asyncio.timeout(10):
                assert await Script(lean, "return 1")(args=[1]) == [b"hello", -12]


@pytest.mark.redis
def test_it_runs_on_uvloop_as_under_uvicorn(redis_server):
    """``manage.py serve --server uvicorn`` runs the relay on uvloop, whose transports
    are not subclasses of asyncio's: the client must take them all the same."""
    uvloop = pytest.importorskip("uvloop")

    async def call() -> object:
        async with lean_at(URL) as lean:
            return await echo_script(lean)(keys=["k"], args=["text"])

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(call()) == b"text"
