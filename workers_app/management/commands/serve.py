"""``manage.py serve``: migrate, bootstrap the default provider, serve ModelRelay.

daphne by default, ``--server uvicorn`` as the faster alternative; shutdown on
SIGTERM is graceful either way (see :mod:`modelrelay_site.servers`).
"""

# daphne.server installs Twisted's asyncio reactor; it must be imported before
# anything else imports twisted.internet.reactor.
import daphne.server  # noqa: F401  isort:skip

import logging
import os
import socket
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from modelrelay_site.logformat import JsonFormatter
from modelrelay_site.servers import SERVERS
from relay import __version__
from relay.core.credentials import PREFIX_LEN
from relay.server import control
from workers_app.joining import release_holds
from workers_app.models import WorkerSession
from workers_app.services import (
    Bootstrap,
    PepperMismatch,
    bootstrap_default_provider,
    check_pepper,
    close_stale_sessions,
    make_private,
)

logger = logging.getLogger("relay.serve")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CommandError(f"LISTEN_ADDR must look like host:port, got {value!r}")
    return host.strip("[]"), int(port)


def sqlite_database() -> Path | None:
    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.sqlite3" or str(database["NAME"]) == ":memory:":
        return None
    return Path(database["NAME"])


def worker_command(public_url: str, provider: str, secret: str) -> str:
    # The secret in the environment: a command line is readable by every user of the box.
    return (
        f"WORKER_SECRET={secret} python worker.py --proxy-url {public_url} "
        f"--provider {provider} --backend-url http://127.0.0.1:8000"
    )


def masked(secret: str) -> str:
    """Enough of a secret to tell which one it is, never most of it."""
    return secret[: min(PREFIX_LEN, len(secret) // 3)] + "…"


class Command(BaseCommand):
    help = "Migrate, bootstrap the default provider and serve ModelRelay (daphne by default)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", help="host:port to bind (default: LISTEN_ADDR)")
        parser.add_argument("--no-migrate", action="store_true", help="skip migrations")
        parser.add_argument(
            "--server",
            choices=sorted(SERVERS),
            default=settings.ASGI_SERVER,
            help="ASGI server (default: ASGI_SERVER, daphne)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = parse_listen(options["listen"] or settings.LISTEN_ADDR)
        # Whatever this process creates (the SQLite database and its journals, generated
        # secrets) is for its own user only: the database holds the admin's session ids.
        os.umask(0o077)
        for path in make_private(settings.DATA_DIR, sqlite_database()):
            logger.info("made %s private to this user", path)
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        try:
            check_pepper(settings.SECRET_PEPPER)
        except PepperMismatch as exc:
            raise CommandError(str(exc)) from None
        problem = control.redis_problem()
        if problem is not None:
            raise CommandError(problem)
        boot = bootstrap_default_provider(
            settings.PROVIDER_NAME, settings.WORKER_SECRET, settings.DATA_DIR
        )
        stale = close_stale_sessions()
        if settings.REDIS_TARGET is None:
            # The only process: holds of joined workers left by one that was killed
            # would refuse them until they lapse (WORKER_LEASE_SECS).
            release_holds()
        pruned = WorkerSession.prune(settings.AUDIT_RETENTION_DAYS)
        if stale or pruned:
            logger.info("closed %d stale worker session(s), pruned %d old one(s)", stale, pruned)

        from modelrelay_site.asgi import application

        serving = SERVERS[options["server"]](
            application, host, port, lambda h, p: self._banner(boot, h, p, options["server"])
        )
        serving.run()

    def _banner(self, boot: Bootstrap, host: str, port: int, server: str) -> None:
        shown = host if host not in ("0.0.0.0", "::") else socket.gethostname()
        if ":" in shown:
            shown = f"[{shown}]"
        base = f"http://{shown}:{port}"
        public = settings.PUBLIC_URL or base
        lines = [
            f"ModelRelay {__version__} ({server})",
            f"Listening on http://{'[' + host + ']' if ':' in host else host}:{port}",
            f"  OpenAI/Anthropic endpoint: {public}/v1",
            f"  Dashboard: {public}/dashboard   Setup wizard: {public}/setup",
            f"  Admin: {public}/django-admin/",
            "",
            f"Run a worker on each GPU box, next to its model server (provider "
            f"'{boot.provider.name}'):",
        ]
        # The banner ends up in the journal and in docker logs: the secret appears whole
        # only on the start that generated it, the one time the operator needs it there.
        if boot.secret is not None and boot.generated:
            lines.append("  " + worker_command(public, boot.provider.name, boot.secret))
            lines.append(
                f"  (worker secret generated now and kept in {boot.source}; later starts show "
                "only its beginning)"
            )
        elif boot.secret is not None:
            lines.append("  " + worker_command(public, boot.provider.name, "<worker secret>"))
            where = (
                "set by WORKER_SECRET in the server's environment"
                if boot.source == "WORKER_SECRET"
                else f"kept in {boot.source}"
            )
            lines.append(f"  (the worker secret {masked(boot.secret)} is {where})")
        else:
            lines.append(
                "  the provider's secret was rotated in the admin; use that secret with "
                + worker_command(public, boot.provider.name, "<worker secret>")
            )
        lines.append(
            "  Models and slots are discovered from the backend (or pass --models). The setup "
            f"wizard shows the install command;\n  the worker is also served as one file at "
            f"{public}/setup/worker.pyz"
        )
        if settings.LOG_FORMAT == "json":
            # One object like every other line, its parts as fields a log pipeline can
            # read; written whatever LOG_LEVEL says, like the text banner.
            record = logging.makeLogRecord(
                {
                    "name": logger.name,
                    "levelno": logging.INFO,
                    "levelname": "INFO",
                    "msg": f"{lines[0]}: {lines[1]}",
                    "version": __version__,
                    "server": server,
                    "listen": f"{host}:{port}",
                    "public_url": public,
                    "provider": boot.provider.name,
                    "banner": "\n".join(lines[2:]),
                }
            )
            self.stdout.write(JsonFormatter().format(record))
            self.stdout.flush()
            return
        self.stdout.write("\n".join(lines))
        self.stdout.flush()
