"""``manage.py drain <worker|--all>``: stop routing to workers, let them finish, close them."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from relay.server.admin.api import DRAIN_TIMEOUT_RULE, valid_drain_timeout
from workers_app.management.commands._common import add_server_arguments, client, find_worker


class Command(BaseCommand):
    help = "Drain workers on the running server: no new work, in-flight finishes, then close."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("worker", nargs="?", help="worker id or name")
        parser.add_argument("--all", action="store_true", help="drain every connected worker")
        parser.add_argument("--timeout", type=float, help="seconds before closing anyway")
        parser.add_argument("--reason", default="maintenance")
        parser.add_argument("--no-wait", action="store_true", help="return once draining starts")
        parser.add_argument("--wait-secs", type=float, default=600.0, help="give up waiting after")
        add_server_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if bool(options["worker"]) == bool(options["all"]):
            raise CommandError("name one worker, or pass --all")
        timeout = options["timeout"]
        if timeout is not None and not valid_drain_timeout(timeout):
            raise CommandError(f"--timeout must be {DRAIN_TIMEOUT_RULE}, got {timeout:g}")
        api = client(options)
        workers = api.workers()
        targets = workers if options["all"] else [find_worker(workers, options["worker"])]
        payload: dict[str, Any] = {"reason": options["reason"]}
        if timeout is not None:
            payload["timeout_secs"] = timeout
        for worker in targets:
            api.request("POST", f"/admin/workers/{worker['id']}/drain", json=payload)
            self.stdout.write(
                f"draining {worker['name']} ({worker['id']}): {worker['in_flight']} in flight"
            )
        if options["no_wait"] or not targets:
            return
        pending = {w["id"]: w["name"] for w in targets}
        deadline = time.monotonic() + options["wait_secs"]
        while pending:
            if time.monotonic() > deadline:
                raise CommandError(
                    f"still connected after {options['wait_secs']:g}s: "
                    + ", ".join(pending.values())
                )
            time.sleep(0.2)
            live = {w["id"] for w in api.workers()}
            for worker_id in [i for i in pending if i not in live]:
                self.stdout.write(
                    f"{pending.pop(worker_id)} ({worker_id}) drained and disconnected"
                )
