"""``manage.py revoke_api_key ID|PREFIX``: revoke a client API key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from keys.models import ApiKey
from keys.services import revoke_key


class Command(BaseCommand):
    help = "Revoke a client API key by id or by its prefix (as listed in the admin)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="key id, or its prefix such as mrk_AbCd1234")

    def handle(self, *args: Any, **options: Any) -> None:
        ref: str = options["key"]
        key = (
            ApiKey.objects.filter(id=int(ref)).first()
            if ref.isdigit()
            else ApiKey.objects.filter(prefix=ref[:12]).first()
        )
        if key is None:
            raise CommandError(f"no API key '{ref}'")
        if not revoke_key(key):
            raise CommandError(f"API key {key.id} '{key.name}' was already revoked")
        self.stdout.write(f"revoked API key {key.id} '{key.name}'")
