"""``manage.py joined_workers [--provider NAME]``: the workers that joined with a token."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from workers_app.joining import joined_workers


class Command(BaseCommand):
    help = "List the workers that joined with a token (their own credentials)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--provider", help="only this provider's")

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        rows = [("ID", "NAME", "PROVIDER", "STATE", "CREATED", "LAST SEEN", "LAST ADDRESS")]
        for w in joined_workers(options.get("provider")):
            state = "revoked" if w.revoked_at else ("connected" if w.connected(now) else "-")
            seen = f"{w.last_seen_at:%Y-%m-%d %H:%M:%S}" if w.last_seen_at else "never"
            created = f"{w.created_at:%Y-%m-%d %H:%M:%S}"
            rows.append((str(w.pk), w.name, w.provider.name, state, created, seen, w.last_address))
        if len(rows) == 1:
            self.stdout.write("no worker has joined")
            return
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            self.stdout.write("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
