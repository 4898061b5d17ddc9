"""``manage.py create_join_token --provider NAME [--ttl 1h] [--uses 1]``: prints a join
token once (SPEC §22)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers_app.joining import mint_token, parse_ttl
from workers_app.models import Provider


class Command(BaseCommand):
    help = (
        "Mint a join token for a provider and print it once: a worker started with "
        "--join-token trades it for a credential of its own."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--provider", required=True, help="the provider workers join")
        parser.add_argument("--ttl", help="how long it stays usable: 90s, 30m, 1h, 7d (1h)")
        parser.add_argument("--uses", type=int, default=1, help="how many workers (1)")

    def handle(self, *args: Any, **options: Any) -> None:
        provider = Provider.objects.filter(name=options["provider"]).first()
        if provider is None:
            raise CommandError(f"no provider '{options['provider']}'")
        try:
            ttl = parse_ttl(options["ttl"]) if options["ttl"] else None
            made = mint_token(provider, ttl_secs=ttl, uses=options["uses"], created_by="manage.py")
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        token = made.token
        uses = "once" if token.uses == 1 else f"{token.uses} times"
        self.stdout.write(
            f"join token for provider '{provider.name}' (usable {uses}, until "
            f"{token.expires_at:%Y-%m-%d %H:%M:%S} UTC; shown once):"
        )
        self.stdout.write(made.secret)
