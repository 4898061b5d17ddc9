"""``worker.py`` when its backend cannot be reached (``backend_health``, SPEC §6/§7).

A request the backend never received is handed back (``error{code:
backend_unreachable}``) for the relay to requeue; a backend that refuses connections
makes the worker withdraw its models, naming the error, until a probe (shrunk here
to milliseconds) finds it answering again. Against the scripted relay of
test_worker.py; waits on frames, never on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relay.wire.protocol import (
    BACKEND_UNREACHABLE,
    Error,
    ModelsRefresh,
    ModelsUpdate,
    ResponseComplete,
)
from tests.upstream import FakeUpstream, unused_port
from tests.worker.test_worker import CHAT, MESSAGES, FakeRelay, config, running


def handed_back(rid: str) -> Callable[[Error], bool]:
    return lambda error: error.request_id == rid


PROBE = ["--backend-probe-min-secs", "0.01", "--backend-probe-max-secs", "0.05"]


async def test_a_refused_request_is_handed_back_after_the_models_are_withdrawn() -> None:
    port = unused_port()
    backend = f"http://127.0.0.1:{port}"
    async with FakeRelay() as relay:
        cfg = config(relay.url, backend, "--models", "m", "--max-concurrent", "2", *PROBE)
        async with running(cfg):
            side = await relay.registered()
            assert side.register is not None and side.register.models == ["m"]
            await side.request("r-1", CHAT, stream=True)
            await side.request("r-2", MESSAGES)
            for rid in ("r-1", "r-2"):
                error = await side.wait_for(Error, handed_back(rid))
                assert error.code == BACKEND_UNREACHABLE
                assert "ConnectError" in error.message
            assert not [m for m in side.received if isinstance(m, ResponseComplete)]
            # The withdrawal came first, so the relay never sends the request back here.
            withdrawn = await side.wait_for(ModelsUpdate)
            assert withdrawn.models == [] and withdrawn.backend_error is not None
            assert "ConnectError" in withdrawn.backend_error
            frames = [m for m in side.received if isinstance(m, ModelsUpdate | Error)]
            assert isinstance(frames[0], ModelsUpdate)
            assert (await side.ping(1)).current_load == 0

            upstream = await FakeUpstream().start(port)  # the backend is back
            try:
                back = await side.wait_for(ModelsUpdate, lambda u: u.models == ["m"])
                assert back.backend_error is None
                await side.request("r-3", CHAT)
                assert (await side.complete("r-3")).status_code == 200
            finally:
                await upstream.close()
            assert len(relay.sides) == 1  # one connection all along


async def test_discovered_models_are_withdrawn_when_the_backend_goes_and_return_with_it() -> None:
    upstream = await FakeUpstream(models=["a", "b"]).start()
    port = int(upstream.url.rsplit(":", 1)[1])
    try:
        async with FakeRelay() as relay:
            cfg = config(relay.url, upstream.url, "--max-concurrent", "1", *PROBE)
            async with running(cfg):
                side = await relay.registered()
                assert side.register is not None and side.register.models == ["a", "b"]
                await upstream.close()
                await side.send(ModelsRefresh(reason="test"))
                gone = await side.wait_for(ModelsUpdate)
                assert gone.models == [] and gone.backend_error
                upstream = await FakeUpstream(models=["a", "c"]).start(port)
                back = await side.wait_for(ModelsUpdate, lambda u: bool(u.models))
                assert back.models == ["a", "c"] and back.backend_error is None
    finally:
        await upstream.close()


async def test_a_backend_that_resets_before_answering_hands_the_request_back_and_stays() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()  # an RST: nothing of a response was sent

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with FakeRelay() as relay:
            cfg = config(relay.url, url, "--models", "m", "--max-concurrent", "1", *PROBE)
            async with running(cfg):
                side = await relay.registered()
                await side.request("r-1", CHAT)
                error = await side.wait_for(Error, lambda e: e.request_id == "r-1")
                assert error.code == BACKEND_UNREACHABLE
                # The backend accepts connections: the models stay advertised.
                assert (await side.ping(2)).current_load == 0
                assert not [m for m in side.received if isinstance(m, ModelsUpdate)]
    finally:
        server.close()


async def test_a_worker_reconnecting_while_its_backend_is_down_registers_without_models() -> None:
    backend = f"http://127.0.0.1:{unused_port()}"
    async with FakeRelay() as relay:
        cfg = config(relay.url, backend, "--models", "m", "--max-concurrent", "1", *PROBE)
        async with running(cfg):
            side = await relay.registered()
            await side.request("r-1", CHAT)
            await side.wait_for(ModelsUpdate, lambda u: u.models == [])
            await side.ws.close(1012, "server restarting")
            again = await relay.registered(1)
            assert again.register is not None and again.register.models == []
            assert again.register.backend_error is not None
