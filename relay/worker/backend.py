"""The local inference server as the worker sees it: discovery and forwarding.

``worker.Worker`` opens one :class:`Backend` for the life of the process, asks it for
models and slots, and every :class:`relay.worker.session.Session` forwards its requests
through it. Discovery uses one long-lived ``httpx.AsyncClient`` with explicit
connect/read/write/pool timeouts; forwarding, the hot path, uses the lean keep-alive
connections of :mod:`relay.worker.connection`, which hand streamed body bytes
straight to the relay connection's :class:`relay.worker.outbox.Outbox`. Imports
nothing from Django.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Callable, Mapping
from types import TracebackType

import httpx
import msgspec
from websockets.exceptions import ConnectionClosed

from relay import __version__
from relay.wire.errors import Flavor, WorkerFailed, describe, error_body
from relay.wire.headers import DROPPED_RESPONSE_HEADERS
from relay.wire.protocol import Request, ResponseComplete
from relay.wire.sse import StreamEnd, error_event
from relay.worker import network
from relay.worker.config import Config
from relay.worker.connection import BackendConnection, BodyTooLarge, NoAnswer
from relay.worker.http1 import Origin, request_head
from relay.worker.outbox import Outbox, chunk_frame, chunk_prefix
from relay.worker.pool import ConnectionPool
from relay.worker.stripper import UsageStripper
from relay.worker.usage import USAGE_ON_REQUEST, UsageScanner, ask_for_usage

# The worker's one logger, whichever module writes: operators filter on it (docs/WORKER.md).
log = logging.getLogger("modelrelay.worker")

#: Request headers never passed to the backend: httpx sets its own framing.
_HOP_BY_HOP_REQUEST = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade"}
)


class BackendNotReady(Exception):
    """The backend did not answer a discovery request usefully (yet).

    ``unreachable``: nothing answered at all (connection refused, connect timeout),
    as opposed to an answer the worker cannot use (HTTP 503 while a model loads).
    """

    def __init__(self, problem: str, *, unreachable: bool = False) -> None:
        super().__init__(problem)
        self.unreachable = unreachable


class BackendUnreached(Exception):
    """The backend never received a request, or never answered one byte of it.

    Raised by :meth:`Backend.exchange` before anything was relayed, so the request
    may run elsewhere (SPEC §6). ``refused``: no connection could be opened at all
    (the backend is down, not just this connection); ``problem`` names the error.
    """

    def __init__(self, problem: str, *, refused: bool) -> None:
        super().__init__(problem)
        self.problem = problem
        self.refused = refused


class StreamCut(Exception):
    """A streamed answer's body ended cleanly but without the API's last event: the
    backend stopped it short (:class:`relay.wire.sse.StreamEnd`)."""


#: Failures opening a connection: nothing was sent, nothing listens.
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)
#: Failures before one byte of response on an open connection (reset, closed
#: unanswered). Timeouts are not among them: a slow backend may be working on it.
_UNANSWERED = (NoAnswer,)


#: Seconds a request body may take to reach the backend's socket buffers.
WRITE_TIMEOUT_SECS = 60.0
#: Idle keep-alive connections kept to the backend.
MAX_IDLE_CONNECTIONS = 64


class Valve:
    """Whether one request's streamed backend response may be read now (``flow_control``).

    Open when created. The session closes it on the relay's ``pause`` and opens it on
    ``resume``; while :meth:`Backend.exchange` streams a body it has the valve hold
    that backend connection, so nothing more is read and the backend's writes back up
    over TCP. A closed valve never delays ``cancel``: that aborts the connection.
    """

    __slots__ = ("_conn", "_open")

    def __init__(self) -> None:
        self._open = True
        self._conn: BackendConnection | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def pause(self) -> None:
        if self._open:
            self._open = False
            if self._conn is not None:
                self._conn.hold()

    def resume(self) -> None:
        if not self._open:
            self._open = True
            if self._conn is not None:
                self._conn.release()

    def attach(self, conn: BackendConnection) -> None:
        """From now on, pausing holds ``conn`` (at once when already paused)."""
        self._conn = conn
        if not self._open:
            conn.hold()

    def detach(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not self._open:
            conn.release()


class _Forwarder:
    """Turns one streamed response's body bytes into ``response_chunk`` frames.

    Called from the backend connection's read callback with everything one read
    returned; decodes UTF-8 incrementally (a character split across reads is sent
    whole with the next one), feeds the usage scanner and posts one frame at once.
    """

    __slots__ = ("_decode", "_end", "_post", "_prefix", "_scan", "sent")

    def __init__(
        self, request_id: str, scan: Callable[[bytes], None], outbox: Outbox, end: StreamEnd
    ) -> None:
        self._prefix = chunk_prefix(request_id)
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._scan = scan
        self._end = end.feed
        self._post = outbox.post
        self.sent = False

    def feed(self, data: bytes) -> None:
        self._scan(data)
        self._end(data)
        text = self._decode(data)
        if text:  # posted at once: never held back to wait for more bytes
            self.sent = True
            self._post(chunk_frame(self._prefix, text))

    def _emit(self, data: bytes) -> None:
        text = self._decode(data)
        if text:
            self.sent = True
            self._post(chunk_frame(self._prefix, text))

    def finish(self) -> None:
        text = self._decode(b"", True)
        if text:
            self._post(chunk_frame(self._prefix, text))


class _StrippingForwarder(_Forwarder):
    """A :class:`_Forwarder` for a stream whose usage the worker asked for: the usage
    event the client did not ask for is read, then left out (:class:`UsageStripper`)."""

    __slots__ = ("_stripper",)

    def __init__(
        self, request_id: str, scan: Callable[[bytes], None], outbox: Outbox, end: StreamEnd
    ) -> None:
        super().__init__(request_id, scan, outbox, end)
        self._stripper = UsageStripper(self._emit)

    def feed(self, data: bytes) -> None:
        self._scan(data)
        self._end(data)
        self._stripper.feed(data)  # which calls _emit with what may go out now

    def finish(self) -> None:
        self._stripper.finish()
        super().finish()


def flavor_of(endpoint_path: str) -> Flavor:
    if endpoint_path.startswith("/v1/messages"):
        return "anthropic"
    if endpoint_path.startswith("/v1/responses"):
        return "responses"
    return "openai"


_USER_AGENT = f"modelrelay-worker/{__version__}"


def _backend_headers(forwarded: Mapping[str, str]) -> dict[str, str]:
    headers = {k.lower(): v for k, v in forwarded.items() if k.lower() not in _HOP_BY_HOP_REQUEST}
    headers.setdefault("content-type", "application/json")
    # Compressed bodies would have to be decoded before relaying; ask for none.
    headers["accept-encoding"] = "identity"
    headers["user-agent"] = _USER_AGENT
    return headers


def _response_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    named_by_connection = {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.split(",")
        if token.strip()
    }
    out: dict[str, str] = {}
    for name, value in headers:
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
        self.origin = Origin.parse(config.backend_url)
        self._pool: ConnectionPool | None = None
        #: The backend reports llama-server's timings in every stream: its streams are
        #: charged from them, and not asked for usage (relay/worker/usage.py).
        self.reports_timings = False

    @property
    def pool(self) -> ConnectionPool:
        assert self._pool is not None, "async with Backend(...) opens the pool"
        return self._pool

    async def __aenter__(self) -> Backend:
        await self.http.__aenter__()
        self._pool = ConnectionPool(
            self.origin,
            connect_timeout=self.config.backend_connect_timeout,
            max_idle=MAX_IDLE_CONNECTIONS,
            keepalive_secs=self.config.backend_keepalive_secs,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._pool is not None:
            self._pool.close()
        await self.http.__aexit__(exc_type, exc, traceback)

    # -- discovery -------------------------------------------------------------------

    async def discover_models(self) -> list[str]:
        """Models from ``GET /v1/models``, else Ollama's ``GET /api/tags``."""
        problems = []
        refused = 0
        sources = (("/v1/models", "data", "id"), ("/api/tags", "models", "name"))
        for path, list_key, name_key in sources:
            try:
                resp = await self.http.get(
                    self.config.backend_url + path, timeout=self.config.discovery_timeout
                )
            except httpx.HTTPError as exc:
                problems.append(f"GET {path}: {describe(exc)}")
                refused += isinstance(exc, _REFUSED)
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
        raise BackendNotReady("; ".join(problems), unreachable=refused == len(sources))

    async def probe(self) -> list[str] | None:
        """Whether the backend answers again (called while it is marked unreachable).

        With discovered models: its model list (:meth:`discover_models`). With
        ``--models``: None once ``GET /v1/models`` gets any answer below 500 (a backend
        without that route answers 404, and is up). Raises :class:`BackendNotReady`.
        """
        if self.config.models is None:
            return await self.discover_models()
        try:
            resp = await self.http.get(
                self.config.backend_url + "/v1/models", timeout=self.config.discovery_timeout
            )
        except httpx.HTTPError as exc:
            raise BackendNotReady(
                f"GET /v1/models: {describe(exc)}", unreachable=isinstance(exc, _REFUSED)
            ) from None
        if resp.status_code >= 500:  # llama-server answers 503 while loading a model
            raise BackendNotReady(f"GET /v1/models: HTTP {resp.status_code}")
        return None

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
        self, request: Request, outbox: Outbox, valve: Valve | None = None
    ) -> ResponseComplete:
        """Forward ``request``; stream its chunks through ``outbox``; return the last frame.

        A streamed body is read only while ``valve`` is open, and forwarded as it is
        read: each read's bytes go out as one ``response_chunk`` from the connection's
        read callback. A failing backend ends in a 502 (after an error event when part
        of the stream was already sent), except that a request the backend never
        received or never answered raises :class:`BackendUnreached`; the relay
        connection closing (``ConnectionClosed`` from ``outbox``) and cancellation
        propagate, and both close the backend connection.
        """
        rid = request.request_id
        scanner = UsageScanner()
        forwarder: _Forwarder | None = None
        end: StreamEnd | None = None
        conn: BackendConnection | None = None
        try:
            # Every response is charged (relay/worker/usage.py): a chat/completions
            # stream is asked for its usage when its client did not ask.
            asked = (
                ask_for_usage(request.endpoint_path, request.body)
                if (
                    request.is_streaming
                    and request.endpoint_path in USAGE_ON_REQUEST
                    and not self.reports_timings
                )
                else None
            )
            body = (request.body if asked is None else asked).encode()
            head = request_head(
                self.origin, request.endpoint_path, _backend_headers(request.headers), len(body)
            )
            try:
                conn, resp = await self.pool.exchange(
                    head,
                    body,
                    write_timeout=WRITE_TIMEOUT_SECS,
                    read_timeout=self.config.backend_read_timeout,
                )
            except _REFUSED + _UNANSWERED as exc:
                # No response head: nothing of this request reached the relay.
                log.warning("backend did not take request %s: %s", rid, describe(exc))
                raise BackendUnreached(describe(exc), refused=isinstance(exc, _REFUSED)) from None
            headers = _response_headers(resp.headers)
            content_type = resp.get("content-type")
            is_json = "json" in content_type.lower()
            if request.is_streaming and 200 <= resp.status < 300 and not is_json:
                end = StreamEnd.for_endpoint(request.endpoint_path)
                if request.endpoint_path in USAGE_ON_REQUEST:
                    scanner.estimate(len(request.body))
                    kind = _Forwarder if asked is None else _StrippingForwarder
                    forwarder = kind(rid, scanner.count, outbox, end)
                else:
                    forwarder = _Forwarder(rid, scanner.feed, outbox, end)
                outbox.watch(conn)
                if valve is not None:
                    valve.attach(conn)
                conn.stream(forwarder.feed)
                await conn.finished()
                forwarder.finish()
                scanner.finish()
                if scanner.timings:
                    self.reports_timings = True
                if not end.seen:
                    raise StreamCut()
                return ResponseComplete(
                    request_id=rid,
                    status_code=resp.status,
                    headers=headers,
                    token_counts=scanner.counts(),
                )
            conn.collect(self.config.max_message_bytes)
            await conn.finished()
            data = conn.body()
            scanner.feed_document(data, content_type)
            return ResponseComplete(
                request_id=rid,
                status_code=resp.status,
                headers=headers,
                body=data.decode("utf-8", "replace"),
                token_counts=scanner.counts(),
            )
        except (ConnectionClosed, BackendUnreached):
            raise
        except httpx.HTTPError as exc:
            problem = describe(exc)
            log.warning("backend error on request %s: %s", rid, problem)
        except BodyTooLarge:
            problem = "the backend's response is too large to relay"
            log.warning("backend error on request %s: %s", rid, problem)
        except StreamCut:
            problem = "it ended the stream before its last event"
            log.warning("backend error on request %s: %s", rid, problem)
        except Exception as exc:  # a bug here must not take other requests down
            problem = describe(exc)
            log.exception("backend error on request %s (unexpected)", rid)
        finally:
            if conn is not None:
                if valve is not None:
                    valve.detach()
                outbox.unwatch(conn)
                self.pool.release(conn)  # kept only when the exchange ended cleanly
        if forwarder is not None and forwarder.sent:
            # The client already has part of the stream: end it with an error event,
            # after a blank line if the stream broke off inside one.
            err = WorkerFailed(f"The backend failed mid-stream: {problem}")
            chunk = error_event(err, flavor_of(request.endpoint_path)).decode()
            if end is not None and not end.between_events:
                chunk = "\n\n" + chunk
            outbox.post(chunk_frame(chunk_prefix(rid), chunk))
            return ResponseComplete(request_id=rid, status_code=502, token_counts=scanner.counts())
        return self.failure(request, problem)

    def failure(self, request: Request, problem: str) -> ResponseComplete:
        """The 502 reported for ``request`` when the backend could not answer it."""
        err = WorkerFailed(f"The backend could not be reached or failed: {problem}")
        return ResponseComplete(
            request_id=request.request_id,
            status_code=502,
            headers={"content-type": "application/json"},
            body=error_body(err, flavor_of(request.endpoint_path)).decode(),
        )
