"""Models on demand against the real llama-server in router mode (``--models-dir``).

The binary and its tiny model are what ``make llama-server`` builds into
``.bench-cache/llama-server/`` at the repository's root; without them every test here is
skipped and says so. Three copies of the model under different names, ``--models-max``
1; a preset makes the router force-kill a model's server one second after asking it to
stop (its default is ten), so a stream it cuts ends quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from relay.wire.protocol import ResponseChunk
from tests.live import LiveServer
from tests.test_e2e import JSON, poll, routable, running_worker
from tests.upstream import unused_port
from tests.worker.test_model_states import load, result, serving, states, states_where, unload
from tests.worker.test_worker import CHAT, ROOT

LLAMA = ROOT / ".bench-cache" / "llama-server"
BINARY = LLAMA / "bin" / "llama-server"
MODEL = LLAMA / "tiny.gguf"
MODELS = ("alpha", "beta", "gamma")
SLOTS = 2
#: Loads of the tiny model take about a second; a busy machine may take longer.
SLOW = ["--model-op-timeout-secs", "60"]

pytestmark = pytest.mark.skipif(
    not (BINARY.is_file() and MODEL.is_file()),
    reason=f"no llama-server at {BINARY} (or no {MODEL.name}): `make llama-server` builds both",
)


class Router:
    def __init__(self, process: asyncio.subprocess.Process, url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    async def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(self.url + path, json=body)

    async def statuses(self) -> dict[str, str]:
        async with httpx.AsyncClient(timeout=30) as client:
            listing = (await client.get(self.url + "/models")).json()
        return {m["id"]: m["status"]["value"] for m in listing["data"]}


def router_argv(tmp_path: Path, port: int, *flags: str, broken: str | None = None) -> list[str]:
    """The command of a router over copies of the tiny model (and ``broken``, a file that
    is no model), with its models' servers killed one second after they were asked to
    stop."""
    models = tmp_path / "models"
    models.mkdir()
    for name in MODELS:
        shutil.copyfile(MODEL, models / f"{name}.gguf")
    if broken is not None:
        (models / f"{broken}.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    preset = tmp_path / "preset.ini"
    preset.write_text("[*]\nstop-timeout = 1\n")
    return [
        str(BINARY),
        "--models-dir", str(models), "--models-preset", str(preset), "--models-max", "1",
        "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
        "--parallel", str(SLOTS), "--ctx-size", "4096", "--no-webui", *flags,
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def llama_router(
    tmp_path: Path, *flags: str, broken: str | None = None
) -> AsyncIterator[Router]:
    """A router started in this loop; stopped (its models' servers with it) at the end."""
    port = unused_port()
    log = tmp_path / "router.log"
    argv = router_argv(tmp_path, port, *flags, broken=broken)
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its model servers are in its group, ended with it
        )
    router = Router(process, f"http://127.0.0.1:{port}", log)
    try:
        async with asyncio.timeout(30), httpx.AsyncClient(timeout=5) as client:
            while True:
                if process.returncode is not None:
                    raise AssertionError(f"llama-server exited:\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(router.url + "/models")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield router
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)  # it stops its model servers first
            try:
                async with asyncio.timeout(15):
                    await process.wait()
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


@contextlib.contextmanager
def router_process(tmp_path: Path, *flags: str) -> Iterator[str]:
    """:func:`llama_router` for synchronous tests: its URL."""
    port = unused_port()
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            router_argv(tmp_path, port, *flags),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, f"llama-server exited:\n{log.read_text()[-3000:]}"
        try:
            return httpx.get(url + "/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        poll(ready, timeout=30, what="llama-server to answer")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def test_the_real_router_reports_its_models_and_loads_and_unloads_them(
    tmp_path: Path,
) -> None:
    async with llama_router(tmp_path) as router, serving(router.url, *SLOW) as (instance, side):
        register = side.register
        assert register is not None
        assert states(register) == dict.fromkeys(MODELS, "loadable")
        assert register.models == list(MODELS)
        assert register.model_capacity == 1  # the router's --models-max, from its /props
        assert register.max_concurrent == 1  # no model in memory

        await load(side, "alpha", "op-1")
        loaded = await result(side, "op-1", timeout=60)
        assert (loaded.ok, loaded.state) == (True, "loaded"), loaded.error
        frame = await states_where(side, lambda s: s["alpha"] == "loaded")
        assert [s.slots for s in frame.states if s.model == "alpha"] == [SLOTS]
        assert instance.max_concurrent == SLOTS

        # Another client loads beta: the full router unloads alpha by itself.
        assert (await router.post("/models/load", {"model": "beta"})).status_code == 200
        await states_where(
            side, lambda s: s == {"alpha": "loadable", "beta": "loaded", "gamma": "loadable"}, 60
        )

        await unload(side, "beta", "op-2")
        unloaded = await result(side, "op-2", timeout=60)
        assert (unloaded.ok, unloaded.state) == (True, "loadable"), unloaded.error
        await states_where(side, lambda s: set(s.values()) == {"loadable"}, 60)
        # Reading the states and the slots never loaded a model.
        assert await router.statuses() == dict.fromkeys(MODELS, "unloaded")


async def test_without_autoload_the_model_the_relay_loads_serves_and_its_unload_holds(
    tmp_path: Path,
) -> None:
    router = llama_router(tmp_path, "--no-models-autoload")
    async with router as backend, serving(backend.url, *SLOW) as (_, side):
        chat = {"model": "gamma", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        await side.request("r-1", CHAT, extra=chat)
        refused = await side.complete("r-1", timeout=30)
        assert refused.status_code == 400 and "not loaded" in (refused.body or "")

        await load(side, "gamma", "op-1")
        assert (await result(side, "op-1", timeout=60)).ok
        await side.request("r-2", CHAT, extra=chat)
        assert (await side.complete("r-2", timeout=30)).status_code == 200

        await unload(side, "gamma", "op-2")
        assert (await result(side, "op-2", timeout=60)).state == "loadable"
        assert await backend.statuses() == dict.fromkeys(MODELS, "unloaded")


async def test_a_stream_the_real_router_cuts_ends_with_the_error_event(tmp_path: Path) -> None:
    async with llama_router(tmp_path) as router, serving(router.url, *SLOW) as (_, side):
        await load(side, "alpha", "op-1")
        assert (await result(side, "op-1", timeout=60)).ok
        long = {
            "model": "alpha",
            "max_tokens": 100_000,
            "ignore_eos": True,  # llama-server: generate until the context is full
            "messages": [{"role": "user", "content": "hi"}],
        }
        await side.request("r-1", CHAT, stream=True, extra=long)
        await side.wait_for(ResponseChunk, lambda c: c.request_id == "r-1", timeout=30)
        # An operator unloads the model mid-stream.
        assert (await router.post("/models/unload", {"model": "alpha"})).status_code == 200
        complete = await side.complete("r-1", timeout=30)
        assert complete.status_code == 502
        text = "".join(side.chunks("r-1"))
        assert "[DONE]" not in text
        *_, error, rest = text.split("\n\n")
        assert rest == "" and error.startswith('data: {"error":'), text[-500:]
        assert "ended the stream before its last event" in error
        await states_where(side, lambda s: s["alpha"] == "loadable", 30)


async def test_a_model_the_real_router_put_to_sleep_is_woken_by_a_load(tmp_path: Path) -> None:
    router = llama_router(tmp_path, "--sleep-idle-seconds", "1")
    async with router as backend, serving(backend.url, *SLOW) as (_, side):
        await load(side, "beta", "op-1")
        assert (await result(side, "op-1", timeout=60)).ok
        await states_where(side, lambda s: s["beta"] == "sleeping", 30)  # idle for 1 s
        await load(side, "beta", "op-2")
        woke = await result(side, "op-2", timeout=60)
        assert (woke.ok, woke.state) == (True, "loaded"), woke.error
        await unload(side, "beta", "op-3")
        assert (await result(side, "op-3", timeout=60)).state == "loadable"


async def test_a_model_the_real_router_cannot_load_is_answered_with_the_exit_code(
    tmp_path: Path,
) -> None:
    router = llama_router(tmp_path, broken="broken")
    async with router as backend, serving(backend.url, *SLOW) as (_, side):
        assert states(side.register)["broken"] == "loadable"
        await load(side, "broken", "op-1")
        answer = await result(side, "op-1", timeout=60)
        assert not answer.ok and answer.state == "loadable"
        assert "exited with code" in (answer.error or ""), answer.error


def requests_by_outcome(server: LiveServer, model: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    counts = {}
    for labels, value in re.findall(r"^modelrelay_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        parsed = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if parsed.get("model") == model:
            counts[parsed["outcome"]] = float(value)
    return counts


@pytest.mark.live
def test_a_client_whose_model_an_operator_unloads_mid_stream_gets_the_error_event(
    tmp_path: Path, relay_server: LiveServer
) -> None:
    with (
        router_process(tmp_path) as url,
        running_worker(relay_server, url, "--model-poll-secs", "0.05"),
        httpx.Client(base_url=relay_server.url, timeout=30, headers=JSON) as client,
    ):
        poll(lambda: routable(relay_server, "alpha"), what="the worker to register")
        long = {
            "model": "alpha",
            "stream": True,
            "max_tokens": 100_000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with client.stream("POST", CHAT, json=long) as streamed:
            assert streamed.status_code == 200
            reads = streamed.iter_raw()
            received = next(reads)  # the router loaded alpha for it
            assert httpx.post(url + "/models/unload", json={"model": "alpha"}).status_code == 200
            received += b"".join(reads)
        text = received.decode(errors="replace")
        assert "[DONE]" not in text
        *_, error, rest = text.split("\n\n")
        assert rest == "" and error.startswith('data: {"error":'), text[-500:]
        assert "ended the stream before its last event" in error
        # Recorded as failed, not as a whole answer.
        poll(
            lambda: requests_by_outcome(relay_server, "alpha") == {"upstream_error": 1.0},
            what="the failed request in /metrics",
        )
