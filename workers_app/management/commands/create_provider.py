"""``manage.py create_provider NAME``: a new provider; prints its worker secret once."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers_app.models import Provider


class Command(BaseCommand):
    help = "Create a provider (a pool of workers sharing a secret) and print its secret once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--models", default="", help="declared models, comma-separated")
        parser.add_argument("--disabled", action="store_true")
        parser.add_argument("--max-queue-len", type=int)
        parser.add_argument("--request-timeout", type=float)
        parser.add_argument("--queue-timeout", type=float)

    def handle(self, *args: Any, **options: Any) -> None:
        if Provider.objects.filter(name=options["name"]).exists():
            raise CommandError(f"provider '{options['name']}' already exists")
        provider = Provider(
            name=options["name"],
            enabled=not options["disabled"],
            declared_models=options["models"],
            max_queue_len=options["max_queue_len"],
            request_timeout_secs=options["request_timeout"],
            queue_timeout_secs=options["queue_timeout"],
        )
        secret = provider.rotate_secret()
        try:
            provider.full_clean()
        except ValidationError as exc:
            raise CommandError(
                "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            )
        provider.save()
        self.stdout.write(f"created provider '{provider.name}'")
        self.stdout.write(f"worker secret (shown once): {secret}")
