"""What every backend that loads models on demand offers the worker, and the plain one.

A :class:`ModelHost` reads its backend's models with their states, loads and unloads
one, and follows the backend's own notices of change where it has any. One subclass per
backend kind, each in a module of its own; :func:`relay.worker.recognition.recognise`
picks one when the worker starts, and :class:`relay.worker.tracker.ModelTracker` drives
it. The base class is the plain backend: every model always loaded, nothing to load or
unload (the null object a plain worker holds). Imports nothing from Django.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from relay.wire.errors import describe
from relay.wire.protocol import LOADABLE, MAX_MODEL_STATES
from relay.worker.backend import BackendNotReady
from relay.worker.config import Config

#: The most bytes of one answer to a state or control call the worker reads: a list of
#: MAX_MODEL_STATES models with their details fits many times over.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
#: The longest a connection to the backend may take to open, whatever the call's timeout.
CONNECT_TIMEOUT_SECS = 10.0
#: Failures that mean nothing listens (the backend is down, not just this call).
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(frozen=True, slots=True)
class Model:
    """One model's state as its backend reports it."""

    #: One of :data:`relay.wire.protocol.MODEL_STATE_NAMES`, or the backend's own word
    #: for a state the protocol does not name (the relay counts it as not loaded).
    state: str
    #: Requests it runs at once, where the backend tells (llama-server's slots).
    slots: int | None = None
    #: Why its last load failed, where the backend tells (a child's exit code).
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every model the backend has, in its order, and how many it holds at once."""

    models: dict[str, Model]
    capacity: int | None = None


class HostError(Exception):
    """The backend refused or failed a load or an unload; the message says why."""


def bounded(names: list[str]) -> list[str]:
    """``names`` without duplicates or blanks, at most :data:`MAX_MODEL_STATES` of them."""
    return list(dict.fromkeys(n for n in names if n))[:MAX_MODEL_STATES]


async def call(
    http: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    secs: float,
    body: Any = None,
) -> tuple[int, Any]:
    """One call to the backend within ``secs``: its status and its JSON answer (None
    when not JSON).

    Reads at most :data:`MAX_ANSWER_BYTES`. Raises :class:`BackendNotReady` when no
    answer came (``unreachable`` when nothing listens).
    """
    data = bytearray()
    try:
        limit = httpx.Timeout(secs, connect=min(secs, CONNECT_TIMEOUT_SECS))
        async with http.stream(method, url, json=body, timeout=limit) as response:
            async for part in response.aiter_bytes():
                data += part
                if len(data) > MAX_ANSWER_BYTES:
                    raise BackendNotReady(f"{method} {url}: answer larger than {MAX_ANSWER_BYTES}")
            status = response.status_code
    except httpx.HTTPError as exc:
        raise BackendNotReady(
            f"{method} {_path(url)}: {describe(exc)}", unreachable=isinstance(exc, _REFUSED)
        ) from None
    try:
        return status, msgspec.json.decode(data) if data else None
    except msgspec.DecodeError:
        return status, None


def reason(document: Any, fallback: str) -> str:
    """The message of a backend's error answer (OpenAI's ``error.message``, Ollama's
    ``error``, FastAPI's ``detail``), else ``fallback``; at most 300 characters."""
    if isinstance(document, dict):
        error = document.get("error", document.get("detail", document.get("message")))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str) and error.strip():
            return error.strip()[:300]
    return fallback


def entries(document: Any, key: str) -> list[dict[str, Any]]:
    """The objects of ``document[key]`` (a list), ignoring anything else."""
    items = document.get(key) if isinstance(document, dict) else None
    if not isinstance(items, list):
        return []
    return [item for item in items[: 2 * MAX_MODEL_STATES] if isinstance(item, dict)]


def text(value: Any) -> str:
    return value.strip()[:1024] if isinstance(value, str) else ""


def _path(url: str) -> str:
    parts = httpx.URL(url)
    return parts.raw_path.decode("ascii", "replace")


class ModelHost:
    """The backend as the worker's model states see it: here, a plain one.

    A plain backend serves the models it lists, always loaded; the worker registers
    them as it always did, without the ``model_states`` extension. Subclasses are the
    backends that load models on demand.
    """

    #: Named in the worker's log.
    kind = "plain"
    #: Whether the backend loads models on demand (the worker reports states).
    on_demand = False
    #: Whether :meth:`watch` follows an event stream (else the worker polls the states).
    has_events = False
    #: Whether :meth:`states` gives the loaded models' slots: the worker then runs as
    #: many requests at once as they add up to (unless ``--max-concurrent`` says).
    reports_slots = False

    def __init__(self, http: httpx.AsyncClient, config: Config) -> None:
        self.http = http
        self.base_url = config.backend_url
        #: Timeout of one state call.
        self.timeout = config.discovery_timeout
        #: Timeout of one load or unload call (they may take minutes).
        self.op_timeout = config.model_op_timeout_secs
        #: How many models the backend holds at once when it does not say.
        self.capacity = config.models_max

    async def states(self) -> Snapshot:
        """Every model and its state now. Raises :class:`BackendNotReady`."""
        return Snapshot({}, self.capacity)

    async def load(self, model: str) -> None:
        """Have the backend load ``model``; returns once it took the order (the load
        may still run: the tracker waits for the state). Raises :class:`HostError`
        (refused or failed) or :class:`BackendNotReady` (no answer)."""
        raise HostError("this backend does not load models on demand")

    async def unload(self, model: str) -> None:
        """Have the backend free ``model``'s memory (unloaded, or put to sleep)."""
        raise HostError("this backend does not unload models")

    def freed_state(self, model: str) -> str:
        """The state an unload leaves ``model`` in (``sleeping`` where it sleeps)."""
        return LOADABLE

    async def watch(self, changed: Callable[[], None], idle: float) -> bool:
        """Follow the backend's notices of change, calling ``changed`` for each, until
        the stream ends or stays silent for ``idle`` seconds (True: open it again after
        a fresh look at the states); False at once when the backend has none (the
        tracker then polls). Raises :class:`BackendNotReady` when it cannot be opened."""
        return False

    def url(self, path: str) -> str:
        return self.base_url + path
