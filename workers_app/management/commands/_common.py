"""Shared bits of the commands that talk to a running server."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from workers_app.adminclient import AdminClient


def add_server_arguments(parser: CommandParser) -> None:
    parser.add_argument("--server", help="server URL (default: from LISTEN_ADDR)")
    parser.add_argument("--token", help="admin token (default: MODELRELAY_ADMIN_TOKEN)")


def client(options: dict[str, Any]) -> AdminClient:
    return AdminClient(options.get("server"), options.get("token"))


def find_worker(workers: list[dict[str, Any]], ref: str) -> dict[str, Any]:
    """A worker by id, or by name when exactly one worker has it."""
    for worker in workers:
        if worker["id"] == ref:
            return worker
    named = [w for w in workers if w["name"] == ref]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        ids = ", ".join(w["id"] for w in named)
        raise CommandError(f"{len(named)} workers are named '{ref}'; use an id: {ids}")
    raise CommandError(f"no connected worker with id or name '{ref}'")
