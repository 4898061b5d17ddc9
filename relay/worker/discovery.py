"""Finding the backend on this box when no ``--backend-url`` was given (SPEC §22).

Called once at start-up, before the worker connects. Every port of ``--probe-ports``
(``MODELRELAY_PROBE_PORTS``; by default the usual ones: llama-server and llama-swap
8080, vLLM 8000, Ollama 11434, llama-swap 9292, LM Studio 1234, SGLang 30000) is asked
at once on the loopback address, each with short timeouts. A port that answers is
identified by what it serves — llama-swap's ``GET /running``, Ollama's ``GET
/api/version``, llama-server's ``GET /props``, vLLM's ``GET /version``, else any
OpenAI-compatible server's ``GET /v1/models`` — and the worker says in one log line
what it chose and why.

One backend found: it is used. Several: the worker does not guess, and stops with
status 2 naming them, for ``--backend-url`` to choose (one worker is one identity on the
relay: a box with two backends runs two workers). None: it asks again with backoff,
as it waits for a backend that is not up yet. The relay is never taken for a backend,
although it serves ``/v1/models`` too: neither the port its URL names nor any port whose
``GET /health`` is a relay's.

Reads at most :data:`MAX_ANSWER_BYTES` of any answer. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from relay.worker.config import Config

log = logging.getLogger("modelrelay.worker")

#: The most bytes read of one answer to a probe: these are small JSON documents.
MAX_ANSWER_BYTES = 256 * 1024
#: How long a probe may take to connect, and to be answered.
CONNECT_TIMEOUT_SECS = 0.5
ANSWER_TIMEOUT_SECS = 2.0
#: The loopback address asked.
HOST = "127.0.0.1"

#: What usually listens on a port, for a server known only by its ``/v1/models``.
PORT_NAMES = {1234: "LM Studio", 30000: "SGLang"}

_decode = msgspec.json.Decoder(Any).decode


class SeveralBackends(Exception):
    """More than one backend answers: the operator must choose with ``--backend-url``."""


@dataclass(frozen=True)
class Found:
    """A backend that answered on one port."""

    url: str
    kind: str
    #: What identified it, for the log line ("GET /props answered with 4 slots").
    evidence: str


async def _json(client: httpx.AsyncClient, url: str) -> Any:
    """The JSON document at ``url``, or None (no answer, not 200, not JSON, too large)."""
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                return None
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    return None
    except httpx.HTTPError:
        return None
    try:
        return _decode(body)
    except msgspec.DecodeError:
        return None


def _count(items: object) -> int:
    return len(items) if isinstance(items, list) else 0


async def identify(client: httpx.AsyncClient, base: str, port: int) -> Found | None:
    """What serves ``base`` (``http://127.0.0.1:PORT``), or None when nothing a worker
    can forward to answers there."""
    running = await _json(client, base + "/running")
    if isinstance(running, dict) and isinstance(running.get("running"), list):
        listed = _count(running["running"])
        return Found(base, "llama-swap", f"GET /running lists {listed} running model(s)")
    ollama = await _json(client, base + "/api/version")
    if isinstance(ollama, dict) and isinstance(ollama.get("version"), str):
        return Found(base, "Ollama", f"GET /api/version answered {ollama['version'][:40]}")
    props = await _json(client, base + "/props")
    if isinstance(props, dict) and (
        "total_slots" in props or "default_generation_settings" in props or props.get("role")
    ):
        slots = props.get("total_slots")
        detail = f"{slots} slot(s)" if isinstance(slots, int) else "its properties"
        return Found(base, "llama-server", f"GET /props answered with {detail}")
    version = await _json(client, base + "/version")
    models = await _json(client, base + "/v1/models")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        kind = PORT_NAMES.get(port, "vLLM")
        return Found(base, kind, f"GET /version answered {version['version'][:40]}")
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        health = await _json(client, base + "/health")
        if isinstance(health, dict) and "workers_connected" in health:
            log.debug("discovery: %s is a ModelRelay relay, not a backend", base)
            return None
        kind = PORT_NAMES.get(port, "an OpenAI-compatible server")
        return Found(base, kind, f"GET /v1/models lists {_count(models['data'])} model(s)")
    return None


def _relay_ports(proxy_url: str) -> set[int]:
    """The ports of this box that are the relay itself (its URL names a local host)."""
    parts = urlsplit(proxy_url)
    host = (parts.hostname or "").lower()
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host in ("localhost", socket.gethostname().lower())
    if not local:
        return set()
    default = 443 if parts.scheme in ("https", "wss") else 80
    try:
        return {parts.port or default}
    except ValueError:
        return set()


async def survey(ports: tuple[int, ...], *, exclude: set[int] | None = None) -> list[Found]:
    """Every backend answering on ``ports`` of the loopback address, in port order."""
    timeout = httpx.Timeout(ANSWER_TIMEOUT_SECS, connect=CONNECT_TIMEOUT_SECS)
    skipped = exclude or set()
    asked = [port for port in ports if port not in skipped]
    # No proxy from the environment: these are this box's own ports.
    client = httpx.AsyncClient(timeout=timeout, trust_env=False)
    async with client, asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(identify(client, f"http://{HOST}:{port}", port)) for port in asked
        ]
    return [found for task in tasks if (found := task.result()) is not None]


async def find(config: Config, *, sleep: Callable[[float], Any] = asyncio.sleep) -> Found:
    """The one backend of this box, asked again with backoff until one answers.

    Raises :class:`SeveralBackends` when more than one does.
    """
    exclude = _relay_ports(config.proxy_url)
    delay = config.backoff_min_secs
    ports = ", ".join(str(p) for p in config.probe_ports if p not in exclude)
    while True:
        found = await survey(config.probe_ports, exclude=exclude)
        if len(found) == 1:
            return found[0]
        if found:
            listed = "; ".join(f"{f.kind} at {f.url} ({f.evidence})" for f in found)
            raise SeveralBackends(
                f"found {len(found)} backends on this box: {listed}. Choose one with "
                "--backend-url (a box with several backends runs one worker for each, "
                "each with its own --worker-name and --state-dir)"
            )
        wait = delay * (1 + 0.25 * random.random())
        log.warning(
            "no backend answers on %s ports %s; retrying in %.1fs (or give --backend-url)",
            HOST,
            ports or "(none)",
            wait,
        )
        await sleep(wait)
        delay = min(delay * 2, max(config.backoff_max_secs, config.backoff_min_secs))


async def settle(config: Config) -> Config:
    """``config`` with a backend: the one given, else the one found (logged in one line)."""
    if config.backend_url:
        return config
    found = await find(config)
    log.info(
        "backend: using %s at %s (%s; no --backend-url given, probed %s ports %s)",
        found.kind,
        found.url,
        found.evidence,
        HOST,
        ", ".join(str(p) for p in config.probe_ports),
    )
    return config.with_backend(found.url)
