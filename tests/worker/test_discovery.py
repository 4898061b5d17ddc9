"""Backend discovery (SPEC §22): with no ``--backend-url``, the worker asks the ports of
``MODELRELAY_PROBE_PORTS`` (free ports here, never the usual fixed ones), names what
answers and says why, refuses to guess between several, waits for one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import pytest

from relay.worker import discovery
from relay.worker.config import parse_config
from tests.upstream import FakeUpstream

SECRET = "mrw_discovery-test"


class FakeServer:
    """An HTTP/1.1 server on 127.0.0.1:0 answering GETs from a path -> (status, body) map."""

    def __init__(self, routes: dict[str, tuple[int, bytes]]) -> None:
        self.routes = routes
        self.asked: list[str] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                self.asked.append(path)
                status, body = self.routes.get(path, (404, b'{"error":"not found"}'))
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        writer.close()


def doc(value: object) -> tuple[int, bytes]:
    return 200, json.dumps(value).encode()


MODELS = doc({"object": "list", "data": [{"id": "m"}]})
KINDS = {
    "llama-server": {"/props": doc({"total_slots": 4}), "/v1/models": MODELS},
    "llama-swap": {"/running": doc({"running": []}), "/v1/models": MODELS},
    "Ollama": {"/api/version": doc({"version": "0.12.0"}), "/v1/models": MODELS},
    "vLLM": {"/version": doc({"version": "0.11.0"}), "/v1/models": MODELS},
    "an OpenAI-compatible server": {"/v1/models": MODELS},
}


def config(*ports: int, **env: str):
    probe = ",".join(str(p) for p in ports)
    return parse_config(
        ["--worker-secret", SECRET, "--backoff-min-secs", "0.01", "--backoff-max-secs", "0.02"],
        env={"MODELRELAY_PROBE_PORTS": probe, **env},
    )


@contextlib.asynccontextmanager
async def closed_port() -> AsyncIterator[int]:
    """A port nothing listens on (bound, then released)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    yield port


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_it_names_what_answers_and_says_why_in_one_line(kind, caplog):
    caplog.set_level(logging.INFO, "modelrelay.worker")
    async with FakeServer(KINDS[kind]) as backend, closed_port() as nothing:
        settled = await discovery.settle(config(nothing, backend.port))
    url = f"http://127.0.0.1:{backend.port}"
    assert settled.backend_url == url
    assert settled.backend_metrics_url == url + "/metrics"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend: ")]
    assert len(lines) == 1
    assert lines[0].startswith(f"backend: using {kind} at {url} (GET /")
    assert f"probed 127.0.0.1 ports {nothing}, {backend.port}" in lines[0]


async def test_the_fake_upstream_of_the_tests_is_found():
    async with FakeUpstream() as upstream:
        port = int(upstream.url.rsplit(":", 1)[1])
        found = await discovery.find(config(port))
    assert found.url == upstream.url


async def test_a_given_backend_url_is_used_without_asking_anything():
    async with FakeServer(KINDS["vLLM"]) as backend:
        given = parse_config(
            ["--worker-secret", SECRET, "--backend-url", "http://127.0.0.1:9"],
            env={"MODELRELAY_PROBE_PORTS": str(backend.port)},
        )
        assert (await discovery.settle(given)).backend_url == "http://127.0.0.1:9"
        assert backend.asked == []


async def test_several_backends_are_named_and_none_is_chosen():
    async with FakeServer(KINDS["llama-server"]) as one, FakeServer(KINDS["Ollama"]) as two:
        with pytest.raises(discovery.SeveralBackends) as refused:
            await discovery.find(config(one.port, two.port))
    message = str(refused.value)
    assert f"llama-server at http://127.0.0.1:{one.port}" in message
    assert f"Ollama at http://127.0.0.1:{two.port}" in message
    assert "--backend-url" in message


async def test_it_waits_for_a_backend_that_is_not_up_yet(caplog):
    caplog.set_level(logging.WARNING, "modelrelay.worker")
    async with FakeServer(KINDS["vLLM"]) as backend:
        routes, backend.routes = backend.routes, {}  # answers nothing useful at first
        waits: list[float] = []

        async def sleep(delay: float) -> None:
            waits.append(delay)
            if len(waits) == 3:
                backend.routes = routes

        found = await discovery.find(config(backend.port), sleep=sleep)
    assert found.kind == "vLLM" and len(waits) == 3
    assert "no backend answers on 127.0.0.1 ports" in caplog.text


async def test_the_relay_itself_is_never_taken_for_a_backend():
    relay_like = {
        "/v1/models": MODELS,
        "/health": doc({"status": "ok", "workers_connected": 0, "queue_depth": 0}),
    }
    async with FakeServer(relay_like) as relay, FakeServer(KINDS["vLLM"]) as backend:
        found = await discovery.find(config(relay.port, backend.port))
        assert found.kind == "vLLM"
        # The port of the relay's own URL is not even asked.
        proxied = config(relay.port, backend.port, PROXY_URL=f"http://127.0.0.1:{relay.port}")
        relay.asked.clear()
        assert (await discovery.find(proxied)).kind == "vLLM"
        assert relay.asked == []


async def test_an_answer_over_the_bound_is_not_read_to_its_end():
    big = b'{"object":"list","data":[' + b'{"id":"m"},' * 30_000 + b'{"id":"m"}]}'
    assert len(big) > discovery.MAX_ANSWER_BYTES
    async with FakeServer({"/v1/models": (200, big)}) as huge:
        assert await discovery.survey((huge.port,)) == []
    at_bound = b'{"data":[],"pad":"' + b"x" * (discovery.MAX_ANSWER_BYTES - 21) + b'"}'
    assert len(at_bound) == discovery.MAX_ANSWER_BYTES - 1
    async with FakeServer({"/v1/models": (200, at_bound)}) as fits:
        assert [f.kind for f in await discovery.survey((fits.port,))] == [
            "an OpenAI-compatible server"
        ]


def test_the_probe_ports_are_checked():
    for bad in ("0", "70000", "http", ""):
        with pytest.raises(SystemExit):
            config_with_ports(bad)
    assert config_with_ports("8080, 8080,11434").probe_ports == (8080, 11434)
    default = parse_config(["--worker-secret", SECRET], env={})
    assert default.probe_ports == (8080, 8000, 11434, 9292, 1234, 30000)


def config_with_ports(text: str):
    return parse_config(["--worker-secret", SECRET, "--probe-ports", text], env={})
