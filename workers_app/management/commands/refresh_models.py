"""``manage.py refresh_models [worker]``: ask workers to re-read their backend's models."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from workers_app.management.commands._common import add_server_arguments, client, find_worker


class Command(BaseCommand):
    help = "Ask one worker (or all) to re-discover its models and report them."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("worker", nargs="?", help="worker id or name (default: all)")
        add_server_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        api = client(options)
        workers = api.workers()
        targets = [find_worker(workers, options["worker"])] if options["worker"] else workers
        for worker in targets:
            api.request("POST", f"/admin/workers/{worker['id']}/refresh")
            self.stdout.write(f"asked {worker['name']} ({worker['id']}) to refresh its models")
        if not targets:
            self.stdout.write("no workers connected")
