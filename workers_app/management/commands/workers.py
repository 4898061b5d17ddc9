"""``manage.py workers``: list the workers connected to the running server."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workers_app.management.commands._common import add_server_arguments, client


class Command(BaseCommand):
    help = "List workers connected to the running server."

    def add_arguments(self, parser: CommandParser) -> None:
        add_server_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        workers = client(options).workers()
        if not workers:
            self.stdout.write("no workers connected")
            return
        rows = [("ID", "NAME", "PROVIDER", "LOAD", "STATE", "MODELS")]
        for w in workers:
            state = "draining" if w["draining"] else "ready"
            load = f"{w['load']}/{w['max_concurrent']}"
            rows.append((w["id"], w["name"], w["provider"], load, state, ",".join(w["models"])))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:5])]
            self.stdout.write("  ".join([*cells, row[5]]))
