"""``manage.py serve``: migrate, bootstrap the default provider, run daphne.

On SIGTERM/SIGINT the server stops admitting requests (503), lets in-flight and
queued work finish within SHUTDOWN_GRACE_SECS, closes worker sockets with 1012 so
workers reconnect to the next instance, then exits. A second signal exits at once.
"""

# daphne.server installs Twisted's asyncio reactor; it must be imported before
# anything else imports twisted.internet.reactor.
from daphne.server import Server  # isort:skip

import asyncio
import logging
import signal
import socket
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay import __version__, runtime
from workers_app.services import (
    Bootstrap,
    PepperMismatch,
    bootstrap_default_provider,
    check_pepper,
    close_stale_sessions,
    prune_sessions,
)

logger = logging.getLogger("relay.serve")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CommandError(f"LISTEN_ADDR must look like host:port, got {value!r}")
    return host.strip("[]"), int(port)


def worker_command(public_url: str, provider: str, secret: str) -> str:
    return (
        f"python worker.py --proxy-url {public_url} --provider {provider} "
        f"--worker-secret {secret} --backend-url http://127.0.0.1:8000"
    )


class Command(BaseCommand):
    help = "Migrate, bootstrap the default provider and serve ModelRelay with daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", help="host:port to bind (default: LISTEN_ADDR)")
        parser.add_argument("--no-migrate", action="store_true", help="skip migrations")

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = parse_listen(options["listen"] or settings.LISTEN_ADDR)
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        try:
            check_pepper(settings.SECRET_PEPPER)
        except PepperMismatch as exc:
            raise CommandError(str(exc)) from None
        boot = bootstrap_default_provider(
            settings.PROVIDER_NAME, settings.WORKER_SECRET, settings.DATA_DIR
        )
        stale = close_stale_sessions()
        pruned = prune_sessions(settings.AUDIT_RETENTION_DAYS)
        if stale or pruned:
            logger.info("closed %d stale worker session(s), pruned %d old one(s)", stale, pruned)

        from modelrelay_site.asgi import application

        interface = host.replace(":", r"\:")
        self.server = Server(
            application,
            endpoints=[f"tcp:port={port}:interface={interface}"],
            signal_handlers=False,
            websocket_timeout=-1,
            websocket_max_message_size=settings.MAX_MESSAGE_BYTES,
            websocket_max_frame_size=settings.MAX_MESSAGE_BYTES,
            request_buffer_size=1024 * 1024,
            application_close_timeout=10,
            ready_callable=lambda: self._ready(boot),
            server_name="modelrelay",
        )
        self._stopping = False
        self.server.run()

    def _ready(self, boot: Bootstrap) -> None:
        loop = asyncio.get_event_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Start the relay now (provider sync, bookkeeping, cluster membership) rather
        # than on the first request.
        loop.call_soon(runtime.current)
        if not self.server.listening_addresses:
            return
        host, port = self.server.listening_addresses[0]
        shown = host if host not in ("0.0.0.0", "::") else socket.gethostname()
        if ":" in shown:
            shown = f"[{shown}]"
        base = f"http://{shown}:{port}"
        public = settings.PUBLIC_URL or base
        lines = [
            f"ModelRelay {__version__}",
            f"Listening on http://{'[' + host + ']' if ':' in host else host}:{port}",
            f"  OpenAI/Anthropic endpoint: {public}/v1",
            f"  Dashboard: {public}/dashboard   Setup wizard: {public}/setup",
            f"  Admin: {public}/django-admin/",
            "",
            f"Run a worker on each GPU box, next to its model server (provider "
            f"'{boot.provider.name}'):",
        ]
        if boot.secret is not None:
            lines.append("  " + worker_command(public, boot.provider.name, boot.secret))
            lines.append(f"  (worker secret from {boot.source})")
        else:
            lines.append(
                "  the provider's secret was rotated in the admin; use that secret with "
                + worker_command(public, boot.provider.name, "<secret>")
            )
        lines.append(
            "  Models and slots are discovered from the backend (or pass --models). The setup "
            f"wizard shows the install command;\n  the worker is also served as one file at "
            f"{public}/setup/worker.pyz"
        )
        self.stdout.write("\n".join(lines))
        self.stdout.flush()

    def _on_signal(self, sig: int) -> None:
        if self._stopping:
            logger.warning("second signal: stopping now")
            self.server.stop()
            return
        self._stopping = True
        logger.info("shutting down: no new requests; finishing in-flight work")
        asyncio.get_event_loop().create_task(self._graceful())

    async def _graceful(self) -> None:
        try:
            rt = runtime.peek()
            if rt is not None:
                await rt.shutdown()
        finally:
            self.server.stop()
