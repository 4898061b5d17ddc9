"""The local inference server as the worker sees it: discovery and forwarding.

``worker.Worker`` opens one :class:`Backend` (one long-lived ``httpx.AsyncClient``
with explicit connect/read/write/pool timeouts) for the life of the process, asks it
for models and slots, and every :class:`relay.worker.session.Session` forwards its requests
through it. Imports nothing from Django.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType

import httpx
import msgspec
from websockets.exceptions import ConnectionClosed

from relay.wire.errors import Flavor, WorkerFailed, describe, error_body
from relay.wire.headers import DROPPED_RESPONSE_HEADERS
from relay.wire.protocol import Request, ResponseChunk, ResponseComplete, WorkerMessage
from relay.wire.sse import error_event
from relay.worker import network
from relay.worker.config import Config
from relay.worker.usage import UsageScanner

# The worker's one logger, whichever module writes: operators filter on it (docs/WORKER.md).
log = logging.getLogger("modelrelay.worker")

#: Request headers never passed to the backend: httpx sets its own framing.
_HOP_BY_HOP_REQUEST = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade"}
)


class BackendNotReady(Exception):
    """The backend did not answer a discovery request usefully (yet)."""


class _BodyTooLarge(Exception):
    pass


class Valve:
    """Whether one request's streamed backend response may be read now (``flow_control``).

    Open when created. The session closes it on the relay's ``pause`` and opens it on
    ``resume``; :meth:`Backend.exchange` waits for it before each read of a streamed
    body, so while it is closed nothing more is read and the backend's writes back up
    over TCP. Waiting on a closed valve is cancellable: ``cancel`` still aborts at once.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()


def flavor_of(endpoint_path: str) -> Flavor:
    if endpoint_path.startswith("/v1/messages"):
        return "anthropic"
    if endpoint_path.startswith("/v1/responses"):
        return "responses"
    return "openai"


def _backend_headers(forwarded: Mapping[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in forwarded.items() if k.lower() not in _HOP_BY_HOP_REQUEST}
    headers.setdefault("content-type", "application/json")
    # Compressed bodies would have to be decoded before relaying; ask for none.
    headers["accept-encoding"] = "identity"
    return headers


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    named_by_connection = {
        token.strip().lower() for token in headers.get("connection", "").split(",") if token
    }
    out: dict[str, str] = {}
    for name, value in headers.multi_items():
        name = name.lower()
        if name in DROPPED_RESPONSE_HEADERS or name in named_by_connection:
            continue
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


class Backend:
    """The backend behind one HTTP client; ``async with`` opens and closes the client."""

    def __init__(self, config: Config) -> None:
        self.config = config
        timeout = httpx.Timeout(
            connect=config.backend_connect_timeout,
            read=config.backend_read_timeout,
            write=60.0,
            pool=60.0,
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(
            timeout=timeout, transport=network.transport(limits), trust_env=False
        )

    async def __aenter__(self) -> Backend:
        await self.http.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.http.__aexit__(exc_type, exc, traceback)

    # -- discovery -------------------------------------------------------------------

    async def discover_models(self) -> list[str]:
        """Models from ``GET /v1/models``, else Ollama's ``GET /api/tags``."""
        problems = []
        sources = (("/v1/models", "data", "id"), ("/api/tags", "models", "name"))
        for path, list_key, name_key in sources:
            try:
                resp = await self.http.get(
                    self.config.backend_url + path, timeout=self.config.discovery_timeout
                )
            except httpx.HTTPError as exc:
                problems.append(f"GET {path}: {describe(exc)}")
                continue
            if not resp.is_success:
                problems.append(f"GET {path}: HTTP {resp.status_code}")
                continue
            try:
                entries = msgspec.json.decode(resp.content)[list_key]
                names = [e[name_key].strip() for e in entries]
            except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
                problems.append(f"GET {path}: not a model list")
                continue
            return list(dict.fromkeys(n for n in names if n))
        raise BackendNotReady("; ".join(problems))

    async def probe_slots(self) -> int:
        """llama-server's ``total_slots`` from ``GET /props``; 1 for backends without it."""
        try:
            resp = await self.http.get(
                self.config.backend_url + "/props", timeout=self.config.discovery_timeout
            )
        except httpx.HTTPError as exc:
            raise BackendNotReady(f"GET /props: {describe(exc)}") from None
        if resp.status_code >= 500:  # llama-server answers 503 while loading a model
            raise BackendNotReady(f"GET /props: HTTP {resp.status_code}")
        try:
            slots = (
                msgspec.json.decode(resp.content).get("total_slots") if resp.is_success else None
            )
        except (msgspec.DecodeError, AttributeError):
            slots = None
        if type(slots) is int and slots >= 1:
            return slots
        log.info("the backend does not report its slots; max_concurrent 1 (see --max-concurrent)")
        return 1

    # -- one request -----------------------------------------------------------------

    async def exchange(
        self,
        request: Request,
        send: Callable[[WorkerMessage], Awaitable[None]],
        valve: Valve | None = None,
    ) -> ResponseComplete:
        """Forward ``request``; stream its chunks through ``send``; return the last frame.

        A streamed body is read only while ``valve`` is open: what was read is sent, then
        the next read waits for the valve. A failing backend ends in a 502 (after an
        error event when part of the stream was already sent); the relay connection
        closing (``ConnectionClosed`` from ``send``) and cancellation propagate.
        """
        rid = request.request_id
        scanner = UsageScanner()
        streamed = False
        try:
            async with self.http.stream(
                "POST",
                self.config.backend_url + request.endpoint_path,
                content=request.body.encode(),
                headers=_backend_headers(request.headers),
            ) as resp:
                headers = _response_headers(resp.headers)
                content_type = resp.headers.get("content-type", "")
                is_json = "json" in content_type.lower()
                if request.is_streaming and resp.is_success and not is_json:
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    if valve is not None and not valve.is_open:
                        await valve.wait_open()
                    async for data in resp.aiter_bytes():
                        scanner.feed(data)
                        text = decoder.decode(data)
                        if text:  # sent at once: never wait for more bytes to coalesce
                            streamed = True
                            await send(ResponseChunk(request_id=rid, chunk=text))
                        if valve is not None and not valve.is_open:
                            # Paused: leave the rest in the socket, so TCP slows the backend.
                            await valve.wait_open()
                    text = decoder.decode(b"", final=True)
                    if text:
                        await send(ResponseChunk(request_id=rid, chunk=text))
                    scanner.finish()
                    return ResponseComplete(
                        request_id=rid,
                        status_code=resp.status_code,
                        headers=headers,
                        token_counts=scanner.counts(),
                    )
                body = await self._read_body(resp)
                scanner.feed_document(body, content_type)
                return ResponseComplete(
                    request_id=rid,
                    status_code=resp.status_code,
                    headers=headers,
                    body=body.decode("utf-8", "replace"),
                    token_counts=scanner.counts(),
                )
        except ConnectionClosed:
            raise
        except httpx.HTTPError as exc:
            problem = describe(exc)
            log.warning("backend error on request %s: %s", rid, problem)
        except _BodyTooLarge:
            problem = "the backend's response is too large to relay"
            log.warning("backend error on request %s: %s", rid, problem)
        except Exception as exc:  # a bug here must not take other requests down
            problem = describe(exc)
            log.exception("backend error on request %s (unexpected)", rid)
        if streamed:
            # The client already has part of the stream: end it with an error event.
            err = WorkerFailed(f"The backend failed mid-stream: {problem}")
            chunk = error_event(err, flavor_of(request.endpoint_path)).decode()
            await send(ResponseChunk(request_id=rid, chunk=chunk))
            return ResponseComplete(request_id=rid, status_code=502, token_counts=scanner.counts())
        return self.failure(request, problem)

    async def _read_body(self, resp: httpx.Response) -> bytes:
        limit = self.config.max_message_bytes
        parts: list[bytes] = []
        size = 0
        async for data in resp.aiter_bytes():
            size += len(data)
            if size > limit:
                raise _BodyTooLarge()
            parts.append(data)
        return b"".join(parts)

    def failure(self, request: Request, problem: str) -> ResponseComplete:
        """The 502 reported for ``request`` when the backend could not answer it."""
        err = WorkerFailed(f"The backend could not be reached or failed: {problem}")
        return ResponseComplete(
            request_id=request.request_id,
            status_code=502,
            headers={"content-type": "application/json"},
            body=error_body(err, flavor_of(request.endpoint_path)).decode(),
        )
