"""The ASGI servers ``manage.py serve`` can run the application under.

daphne is the default (the Channels server); uvicorn is a measured alternative with
less per-request overhead (docs/BENCHMARKS.md). Both get the same shutdown: the first
SIGTERM/SIGINT stops admitting requests (503), lets in-flight and queued work finish
within SHUTDOWN_GRACE_SECS, closes worker sockets with 1012 so workers reconnect to
the next instance, then stops the server; a second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote_plus

from django.conf import settings

from relay.server import runtime

logger = logging.getLogger("relay.serve")

OnReady = Callable[[str, int], None]

#: Query parameters that carry credentials: the worker secret's fallback and the token
#: older nodes send. Their values never reach a log line.
SECRET_PARAMETERS = frozenset({"worker_secret", "token", "api_key", "key"})
_PARAMETER = re.compile(r"([?&])([^=&#\s\"']*)=([^&#\s\"']*)")
#: Headers that carry credentials, as a protocol library's debug lines show them.
_HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|x-api-key|x-worker-secret|cookie|set-cookie)"
    r"(\s*:\s*)[^\r\n]+"
)


def redact(text: str) -> str:
    """``text`` with the values of credential-carrying query parameters and headers masked."""

    def parameter(match: re.Match[str]) -> str:
        if unquote_plus(match.group(2)).lower() in SECRET_PARAMETERS:
            return f"{match.group(1)}{match.group(2)}=[redacted]"
        return match.group(0)

    return _HEADER.sub(r"\1\2[redacted]", _PARAMETER.sub(parameter, text))


class RedactSecrets(logging.Filter):
    """Masks credentials in what uvicorn logs.

    uvicorn logs every WebSocket handshake at INFO with its path *and* query string (a
    worker using the ``worker_secret=`` fallback would leave its secret there), and at
    DEBUG the websockets library logs each handshake header (``X-Worker-Secret``) through
    uvicorn's logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own reporting
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


class Serving:
    name = ""

    def __init__(self, application: Any, host: str, port: int, on_ready: OnReady) -> None:
        self.application = application
        self.host = host
        self.port = port
        self.on_ready = on_ready
        self._stopping = False

    def run(self) -> None:
        raise NotImplementedError

    def stop(self, *, force: bool = False) -> None:
        raise NotImplementedError

    def stop_listening(self) -> None:
        """Accept no new connections; the ones open carry on."""
        raise NotImplementedError

    def started(self, host: str, port: int) -> None:
        """Called on the server's event loop once it listens."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        # Start the relay now (provider sync, bookkeeping, cluster membership) rather
        # than on the first request.
        runtime.current().listening(host, port)
        _settle_heap()
        self.on_ready(host, port)

    def _on_signal(self) -> None:
        if self._stopping:
            logger.warning("second signal: stopping now")
            self.stop(force=True)
            return
        self._stopping = True
        logger.info("shutting down: no new requests; finishing in-flight work")
        asyncio.get_running_loop().create_task(self._graceful())
        if settings.REDIS_TARGET is not None:
            # Behind a load balancer (cluster mode), new connections are refused rather
            # than answered 503: the balancer sends them to another process (a refused
            # connection is retried whatever the method; a 503 to a POST is not).
            try:
                self.stop_listening()
            except Exception:
                # Still answered 503 then: the shutdown itself goes on regardless.
                logger.exception("could not stop listening; new connections get 503")

    async def _graceful(self) -> None:
        try:
            rt = runtime.peek()
            if rt is not None:
                await rt.shutdown()
        finally:
            self.stop()


def _settle_heap() -> None:
    """Move everything loaded at startup (Django, the apps, the servers: hundreds of
    thousands of objects that live as long as the process) out of the cyclic garbage
    collector's sight. Every full collection used to walk all of it: pauses of tens of
    milliseconds under load, and several per cent of the server's CPU per relayed
    request (docs/BENCHMARKS.md). The collection thresholds stay CPython's: collecting
    the young generation less often measured a little faster, but let cyclic garbage
    (hostile frames' tracebacks, say) pile up far enough to grow the process by 50 MiB
    under the fuzzer (chaos/run.py)."""
    gc.collect()
    gc.freeze()


class DaphneServing(Serving):
    name = "daphne"

    def run(self) -> None:
        from daphne.server import Server as DaphneServer

        ports: list[Any] = []
        self.ports = ports

        class Server(DaphneServer):
            def listen_success(self, port: Any) -> None:
                # daphne keeps only the Deferreds of its listeners (whose result is
                # gone by then): the listening ports are what stop_listening needs.
                ports.append(port)
                super().listen_success(port)

        interface = self.host.replace(":", r"\:")
        self.server = Server(
            self.application,
            endpoints=[f"tcp:port={self.port}:interface={interface}"],
            signal_handlers=False,
            websocket_timeout=-1,
            websocket_max_message_size=settings.MAX_MESSAGE_BYTES,
            websocket_max_frame_size=settings.MAX_MESSAGE_BYTES,
            request_buffer_size=1024 * 1024,
            application_close_timeout=10,
            ready_callable=self._ready,
            server_name="modelrelay",
        )
        self.server.run()

    def _ready(self) -> None:
        # Runs before the reactor starts: finish on the loop, once it is running.
        asyncio.get_event_loop().call_soon(self._listening)

    def _listening(self) -> None:
        if self.server.listening_addresses:
            self.started(*self.server.listening_addresses[0])

    def stop(self, *, force: bool = False) -> None:
        self.server.stop()

    def stop_listening(self) -> None:
        for listener in self.ports:
            # Accept what already waits in the backlog first: closing the socket would
            # reset those connections, and a balancer does not resend a POST it had
            # written to one.
            try:
                listener.doRead()
            except Exception:
                logger.debug("accepting the last connections failed", exc_info=True)
            listener.stopListening()


class UvicornServing(Serving):
    name = "uvicorn"

    def run(self) -> None:
        import uvicorn

        from modelrelay_site import uvicorn_compat

        uvicorn_compat.install()
        masking = RedactSecrets()
        for name in ("uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).addFilter(masking)

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # signals are handled by Serving, on the loop

        config = uvicorn.Config(
            self.application,
            host=self.host,
            port=self.port,
            lifespan="off",
            ws="websockets-sansio",
            ws_max_size=settings.MAX_MESSAGE_BYTES,
            ws_per_message_deflate=False,
            access_log=False,
            server_header=False,
            log_level=settings.LOG_LEVEL.lower(),
            timeout_graceful_shutdown=5,
            log_config=None,  # keep Django's LOGGING
        )
        self.server = Server(config)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if task.done():
                await task  # it failed to start: raise why
                return
            await asyncio.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.started(host, port)
        await task

    def stop(self, *, force: bool = False) -> None:
        self.server.should_exit = True
        if force:
            self.server.force_exit = True

    def stop_listening(self) -> None:
        for server in self.server.servers:
            server.close()  # the listening sockets; open connections carry on


SERVERS: dict[str, type[Serving]] = {"daphne": DaphneServing, "uvicorn": UvicornServing}
