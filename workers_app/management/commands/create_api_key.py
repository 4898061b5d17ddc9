"""``manage.py create_api_key NAME``: a client API key; prints the secret once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from keys.services import create_key


class Command(BaseCommand):
    help = "Create a client API key and print it once (only a prefix and an HMAC are stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            made = create_key(options["name"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"created API key {made.key.id} '{made.key.name}'")
        self.stdout.write(f"key (shown once): {made.secret}")
