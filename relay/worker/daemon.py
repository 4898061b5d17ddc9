"""The worker program: puts one GPU box's inference server behind a ModelRelay relay.

It dials **out** to the relay over a WebSocket (no inbound port on the GPU box),
registers the models the local backend serves (llama-server, vLLM, Ollama, any
OpenAI-compatible server), and forwards each request the relay assigns to it.

Started by :func:`main`, which ``worker.py`` at the top of the tree, the
``modelrelay-worker`` console script of the ``modelrelay-worker`` package and
``python -m relay.worker`` all call: see ``docs/WORKER.md`` for installing it. Every
flag has an environment variable (``--help``).

Guarantees (SPEC §7):

- one task per assigned request, kept by request id, so ``cancel`` aborts exactly
  that backend request (its HTTP connection is closed, the backend sees it);
- streamed bodies are forwarded byte for byte, as soon as they are read, with
  UTF-8 decoded incrementally so a character split across reads stays whole;
- a failing backend request ends in a 502 in the endpoint's error envelope and
  never affects other requests or the connection;
- it announces the ``flow_control`` extension: a ``pause`` from the relay stops the
  reading of exactly that backend response until ``resume`` (TCP then slows the
  backend); ``cancel`` aborts whatever its reason, paused or not;
- connection loss and server restarts reconnect with exponential backoff and
  jitter; refusals (close 1008: bad secret, unknown or disabled provider) are
  logged at ERROR and retried slowly; a relay that announced its ping period and
  then sends nothing for ``--server-silence-secs`` (default: three periods, at
  least 5 s) counts as lost too;
- a request the backend never received (connection refused, reset before a byte of
  answer) is handed back for the relay to requeue (``backend_unreachable``); a
  backend that refuses connections makes the worker withdraw its models (naming the
  error) until a probe, repeated with backoff, finds it answering again;
- a backend that loads models on demand (llama-server's router, llama-swap, Ollama,
  vLLM with sleep mode or runtime LoRA adapters) is recognised at start-up: with the
  relay's agreement (``model_states``) the worker reports each model's state whenever
  it changes, and loads and unloads models on the relay's word, one ``model_result``
  per operation; a plain backend registers exactly as before;
- a stream whose backend ends it cleanly but without the API's last event (a model
  unloaded mid-stream) ends with the endpoint's error event and counts as failed;
- SIGTERM/SIGINT drains: stop taking work, finish in-flight requests, exit 0;
  a second signal exits at once with status 1. Requests that arrive meanwhile are
  refused with a ``worker_draining`` error, which the relay requeues.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import random
import signal
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Sequence
from typing import TypeVar, cast

from websockets.asyncio.client import ClientConnection, connect
from websockets.client import process_exception as websockets_process_exception
from websockets.exceptions import InvalidHandshake

from relay import __version__
from relay.wire.errors import describe
from relay.wire.logrecord import formatter
from relay.wire.protocol import LOADED, ModelsUpdate
from relay.worker import credential, discovery
from relay.worker.backend import Backend, BackendNotReady
from relay.worker.config import Config, parse_config
from relay.worker.modelhost import ModelHost, Snapshot
from relay.worker.operations import ModelOperations
from relay.worker.outbox import encode
from relay.worker.recognition import recognise
from relay.worker.session import Session
from relay.worker.tracing import from_environment as tracing_from_environment
from relay.worker.tracker import ModelTracker

log = logging.getLogger("modelrelay.worker")
T = TypeVar("T")

#: Close codes after which reconnecting with the same settings cannot help.
REFUSAL_CODES = frozenset({1002, 1003, 1008})


class Backoff:
    """Exponential delays from ``base`` doubling up to ``cap``, each plus up to 25 % jitter."""

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.cap = max(cap, base)
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * 2 ** min(self.attempt, 32))
        self.attempt += 1
        return delay * (1 + 0.25 * random.random())

    def reset(self) -> None:
        self.attempt = 0


class Worker:
    """The worker's life: wait for the backend, connect, serve, reconnect, drain.

    Each connection is served by a :class:`relay.worker.session.Session`, which sees this
    object through :class:`relay.worker.session.Owner`.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.models: list[str] = list(config.models or ())
        self.max_concurrent = config.max_concurrent or 1
        self.draining = False
        self.exit_code = 0
        self.backoff = Backoff(config.backoff_min_secs, config.backoff_max_secs)
        self._backend: Backend | None = None
        self._session: Session | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop_requested = False
        self._discovery = asyncio.Lock()
        #: Spans around backend calls when OTEL_* turns tracing on (SPEC §17); else a
        #: null tracer whose hooks do nothing.
        self.tracing = tracing_from_environment()
        #: Set while the backend cannot be reached (what failed); None while it answers.
        self.backend_error: str | None = None
        self._probe: asyncio.Task[None] | None = None
        #: The backend's models on demand (SPEC §19): its states, loads and unloads.
        self._tracker: ModelTracker | None = None
        self._operations: ModelOperations | None = None
        self._keeper: asyncio.Task[None] | None = None

    @property
    def backend(self) -> Backend:
        assert self._backend is not None, "Worker.run() opens the backend"
        return self._backend

    @property
    def tracker(self) -> ModelTracker:
        assert self._tracker is not None, "the worker recognises its backend before it connects"
        return self._tracker

    @property
    def operations(self) -> ModelOperations:
        assert self._operations is not None, "made with the tracker"
        return self._operations

    def advertised(self) -> list[str]:
        return [] if self.draining or self.backend_error is not None else list(self.models)

    async def run(self) -> int:
        """Serve until stopped; returns the process exit code (0 after a drain)."""
        try:
            async with Backend(self.config) as backend:
                self._backend = backend
                self._runner = asyncio.create_task(self._serve_forever(), name="worker")
                try:
                    await self._runner
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # run() itself was cancelled, not just stopped
                finally:
                    helpers = [t for t in (self._probe, self._keeper) if t is not None]
                    self._probe = self._keeper = None
                    for helper in helpers:
                        helper.cancel()
                    await asyncio.gather(*helpers, return_exceptions=True)
        finally:
            await self.tracing.aclose()  # export the spans still buffered
        return self.exit_code

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: the first drains gracefully, the second exits at once."""
        if self._stop_requested:
            log.warning("second stop signal: exiting now without finishing requests")
            self.exit_code = 1
            if self._runner is not None:
                self._runner.cancel()
            return
        self._stop_requested = True
        self.draining = True
        session = self._session
        if session is None:
            log.info("graceful shutdown: not connected, exiting")
            if self._runner is not None:
                self._runner.cancel()
            return
        log.info(
            "graceful shutdown: taking no new work, finishing %d in-flight request(s)",
            session.load,
        )
        session.drain(announce=True)

    async def _serve_forever(self) -> None:
        await self._wait_for_backend()
        if self.tracker.on_demand:
            self._keeper = asyncio.create_task(self.tracker.run(), name="model states")
        c = self.config
        while True:
            connector = connect(
                c.connect_url,
                additional_headers=c.auth_headers,
                user_agent_header=f"modelrelay-worker/{__version__}",
                max_size=c.max_message_bytes,
                compression=None,
                ping_interval=20,
                ping_timeout=20,
                close_timeout=5,
                process_exception=self._retryable,
                reconnect_delays=self._delays,
            )
            # aclosing: leaving the loop closes the generator now, not at garbage collection.
            connections = cast(AsyncGenerator[ClientConnection, None], connector.__aiter__())
            try:
                async with contextlib.aclosing(connections):
                    async for ws in connections:
                        delay = await self._session_over(ws)
                        if delay is None:
                            return
                        await asyncio.sleep(delay)
            except InvalidHandshake as exc:
                log.error(
                    "the proxy at %s rejected the WebSocket handshake (%s); check --proxy-url; "
                    "retrying in %.0fs",
                    c.proxy_url,
                    exc,
                    c.fatal_retry_secs,
                )
                await asyncio.sleep(c.fatal_retry_secs)
            except Exception:  # a bug must not kill a daemon on a remote box
                delay = self.backoff.next()
                log.exception("unexpected error in the connection loop; retrying in %.1fs", delay)
                await asyncio.sleep(delay)

    def _retryable(self, exc: Exception) -> Exception | None:
        verdict = websockets_process_exception(exc)
        if verdict is None:
            log.warning("cannot reach the proxy at %s: %s", self.config.proxy_url, describe(exc))
        return verdict

    def _delays(self) -> Generator[float]:
        while True:
            yield self.backoff.next()

    async def _session_over(self, ws: ClientConnection) -> float | None:
        """Run one connection to its end; the delay before the next one, None to stop."""
        log.info("connected to proxy %s as %s", self.config.proxy_url, self.config.worker_name)
        session = self._session = Session(self, ws)
        try:
            await session.run()
        finally:
            self._session = None
        if self.draining:
            log.info("graceful shutdown complete")
            return None
        code, reason = ws.close_code, ws.close_reason or "no reason given"
        if code in REFUSAL_CODES and not credential.held_elsewhere(reason):
            log.error(
                "the proxy refused this worker (close code %s: %s); %s; retrying in %.0fs",
                code,
                reason,
                "a revoked worker joins again with a new --join-token"
                if self.config.credential
                else "check --worker-secret and --provider",
                self.config.fatal_retry_secs,
            )
            return self.config.fatal_retry_secs
        loop = asyncio.get_running_loop()
        if (
            session.registered_at is not None
            and loop.time() - session.registered_at >= self.config.healthy_session_secs
        ):
            self.backoff.reset()
        delay = self.backoff.next()
        log.warning(
            "connection to the proxy closed (code %s: %s); reconnecting in %.1fs",
            code,
            reason,
            delay,
        )
        return delay

    # -- backend discovery ---------------------------------------------------------

    async def _wait_for_backend(self) -> None:
        """Learn models and slots from the backend, retrying until it answers.

        With discovered models, also what kind of backend it is: one that loads models
        on demand is followed by a :class:`ModelTracker` from then on.
        """
        c = self.config
        if c.models is None:
            self.models = await self._until_ready(self.backend.discover_models)
            host = await recognise(self.backend.http, c)
        else:
            host = ModelHost(self.backend.http, c)
        tracker = self._tracker = ModelTracker(
            host, c, self._states_changed, self.backend_unreachable
        )
        self._operations = ModelOperations(tracker, c)
        if host.on_demand:
            await self._until_ready(tracker.refresh)
            self.models = tracker.names()
        if c.max_concurrent is None:
            if host.reports_slots:
                self.max_concurrent = max(1, tracker.loaded_slots())
            else:
                self.max_concurrent = await self._until_ready(self.backend.probe_slots)
        log.info(
            "backend %s: models %s, max_concurrent %d",
            c.backend_url,
            ", ".join(self.models) or "(none)",
            self.max_concurrent,
        )
        if host.on_demand:
            snapshot = tracker.snapshot
            loaded = [n for n, m in snapshot.models.items() if m.state == LOADED]
            log.info(
                "backend %s loads models on demand: %d loaded (%s), %s at once",
                host.kind,
                len(loaded),
                ", ".join(loaded) or "none",
                "no known bound" if snapshot.capacity is None else f"at most {snapshot.capacity}",
            )

    async def _until_ready(self, step: Callable[[], Awaitable[T]]) -> T:
        """``step()``'s result, asked again with backoff while the backend is not ready."""
        delays = Backoff(self.config.backoff_min_secs, self.config.backoff_max_secs)
        while True:
            try:
                return await step()
            except BackendNotReady as exc:
                delay = delays.next()
                log.warning(
                    "backend at %s is not ready (%s); retrying in %.1fs",
                    self.config.backend_url,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    def _states_changed(self, snapshot: Snapshot, names_changed: bool) -> None:
        """The tracker saw a change: the models to advertise, the slots, and the old
        relays' ``models_update`` when the names changed (sessions send the states)."""
        self.models = list(snapshot.models)
        if self.config.max_concurrent is None and self.tracker.host.reports_slots:
            self.max_concurrent = max(1, self.tracker.loaded_slots())
        if not names_changed:
            return
        log.info("backend models changed: %s", ", ".join(self.models) or "(none)")
        session = self._session
        if session is not None and not self.draining and self.backend_error is None:
            session.outbox.post(encode(self._models_update(session)))

    async def refresh_models(self, session: Session, *, always: bool) -> None:
        """Re-read the backend's models; tell the relay when they changed (or ``always``).

        A backend that refuses connections is marked unreachable (its models are
        withdrawn until the probe finds it again); one that answers uselessly keeps
        the last list.
        """
        if self.tracker.on_demand:
            if self.backend_error is None:
                try:
                    await self.tracker.refresh()  # a change tells the relay by itself
                except BackendNotReady as exc:
                    if exc.unreachable:
                        self.backend_unreachable(str(exc))
                        return
                    log.warning("reading the model states failed (%s); keeping the last", exc)
            if always:
                await session.send(self._models_update(session))
            return
        changed = False
        if self.config.models is None and self.backend_error is None:
            async with self._discovery:
                try:
                    models = await self.backend.discover_models()
                except BackendNotReady as exc:
                    if exc.unreachable:
                        self.backend_unreachable(str(exc))  # tells the relay itself
                        return
                    log.warning("model discovery failed (%s); keeping the last list", exc)
                    models = self.models
                changed, self.models = models != self.models, models
            if changed:
                log.info("backend models changed: %s", ", ".join(models) or "(none)")
        if always or (changed and not self.draining):
            await session.send(self._models_update(session))

    def _models_update(self, session: Session) -> ModelsUpdate:
        return ModelsUpdate(
            models=self.advertised(), current_load=session.load, backend_error=self.backend_error
        )

    # -- an unreachable backend ------------------------------------------------------

    def backend_unreachable(self, problem: str) -> None:
        """The backend refused a connection: withdraw the models, probe until it answers.

        Called from a request's task or the model refresh. The relay hears it before
        anything the caller sends next on the same connection (the frame is posted
        now), so it stops routing here before it sees that request handed back.
        """
        if self.backend_error is not None:
            return
        self.backend_error = problem[:1000]
        log.warning(
            "backend at %s cannot be reached (%s): withdrawing the models until it answers",
            self.config.backend_url,
            problem,
        )
        session = self._session
        if session is not None:
            session.outbox.post(encode(self._models_update(session)))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_backend(), name="backend probe")

    async def _probe_backend(self) -> None:
        """Ask the backend with backoff until it answers; then advertise again."""
        c = self.config
        delays = Backoff(c.backend_probe_min_secs, c.backend_probe_max_secs)
        models: list[str] | None = None
        while True:
            await asyncio.sleep(delays.next())
            try:
                if self.tracker.on_demand:
                    await self.tracker.refresh()
                    models = self.tracker.names()
                else:
                    models = await self.backend.probe()
            except BackendNotReady as exc:
                log.debug("backend probe: %s", exc)
                continue
            except Exception:  # a bug must not leave the models withdrawn for good
                log.exception("backend probe failed unexpectedly")
                continue
            break
        if models is not None:
            self.models = models
        self.backend_error = None
        log.info(
            "backend at %s answers again: advertising %s",
            c.backend_url,
            ", ".join(self.models) or "(none)",
        )
        session = self._session
        if session is not None and not self.draining:
            session.outbox.post(encode(self._models_update(session)))
        self.tracker.touch()  # the states go out again after the models


def configure_logging(level: str, kind: str = "text") -> None:
    """Every line to stderr, as text or (``LOG_FORMAT=json``) one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(kind, "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # Frame-by-frame and per-request lines from the libraries drown the worker's own.
    logging.getLogger("websockets").setLevel(max(logging.INFO, log.getEffectiveLevel()))
    logging.getLogger("asyncio").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


async def _main(config: Config) -> int:
    settled = await _start_up(config)
    if isinstance(settled, int):
        return settled
    worker = Worker(settled)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    return await worker.run()


async def _start_up(config: Config) -> Config | int:
    """Find the backend and the credential before the first connect (SPEC §22).

    Returns the settled config, or the exit status when the worker cannot run as
    configured (2, said at ERROR) or a stop signal came meanwhile (0: nothing was in
    flight yet).
    """

    async def settle() -> Config:
        return await credential.settle(await discovery.settle(config))

    loop = asyncio.get_running_loop()
    preparing = asyncio.create_task(settle(), name="start-up")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, preparing.cancel)
    try:
        return await preparing
    except (discovery.SeveralBackends, credential.JoinRefused) as exc:
        log.error("%s", exc)
        return 2
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # _main itself was cancelled, not stopped by a signal
        log.info("stopped before connecting")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else None (asyncio's own).

    Relaying is mostly event-loop work (a socket read, a frame, a socket write per
    chunk); uvloop does it for about half the CPU of asyncio's loop at a few thousand
    chunks a second (bench/worker_path.py). It is optional, not a requirement: it has
    no Windows build. requirements-worker.txt installs it everywhere else; it is
    imported by name rather than with an import statement because the setup wizard
    pins every package the worker's files import, and must not pin this one.
    """
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_format)
    factory = event_loop_factory()
    log.debug("event loop: %s", "uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_main(config))


if __name__ == "__main__":
    sys.exit(main())
