"""``manage.py revoke_worker ID|NAME``: revoke one joined worker's credential."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers_app.joining import find_worker, revoke_worker


class Command(BaseCommand):
    help = (
        "Revoke a joined worker's credential (by id, or by name when it is unique): its "
        "connection closes within a sync tick of the running server, and it is refused "
        "from then on. Every other worker stays."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("worker", help="id or name, as manage.py joined_workers lists them")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            worker = find_worker(options["worker"])
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        if not revoke_worker(worker):
            raise CommandError(f"worker #{worker.pk} '{worker.name}' was already revoked")
        self.stdout.write(
            f"revoked worker #{worker.pk} '{worker.name}' of provider '{worker.provider.name}'"
        )
