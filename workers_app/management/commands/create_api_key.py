"""``manage.py create_api_key NAME [limits]``: a client API key; prints the secret once."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from keys.services import create_key
from relay.core.classes import CLASSES

_DURATION = re.compile(r"^(\d+)([dhm])$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def expiry(value: str) -> dt.datetime:
    """``2026-12-31``, ``2026-12-31T18:00:00Z`` (naive: UTC), or from now: ``30d``, ``12h``."""
    match = _DURATION.match(value.strip())
    if match:
        delta = dt.timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        return dt.datetime.now(tz=dt.UTC) + delta
    try:
        moment = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise CommandError(f"--expires: not a date, time or duration: {value!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)


class Command(BaseCommand):
    help = (
        "Create a client API key and print it once (only a prefix and an HMAC are stored). "
        "Limits are optional; see docs/OPERATIONS.md."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--max-concurrent", type=int, help="requests queued or running")
        parser.add_argument("--rpm", "--requests-per-minute", dest="rpm", type=int)
        parser.add_argument("--tokens-per-day", type=int)
        parser.add_argument("--tokens-per-month", type=int)
        parser.add_argument("--models", help="allowed models, comma-separated (default: all)")
        parser.add_argument("--expires", help="date/time (UTC) or duration such as 30d, 12h")
        parser.add_argument("--weight", type=int, help="fair-share weight (default 1)")
        parser.add_argument(
            "--default-class",
            choices=CLASSES,
            help="priority class of requests that ask for none (default: default)",
        )
        parser.add_argument(
            "--max-class",
            choices=CLASSES,
            help="highest priority class its requests may ask for (default: default)",
        )
        parser.add_argument(
            "--deadline-ms",
            type=int,
            help="time to first token its requests accept when they state none "
            "(X-Deadline-Ms); refused at once with 503 when no worker is predicted to meet it",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        limits: dict[str, Any] = {
            "max_concurrent": options["max_concurrent"],
            "requests_per_minute": options["rpm"],
            "tokens_per_day": options["tokens_per_day"],
            "tokens_per_month": options["tokens_per_month"],
            "allowed_models": options["models"],
            "expires_at": expiry(options["expires"]) if options["expires"] else None,
            "weight": options["weight"],
            "default_class": options["default_class"],
            "max_class": options["max_class"],
            "deadline_ms": options["deadline_ms"],
        }
        try:
            made = create_key(options["name"], **limits)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"created API key {made.key.id} '{made.key.name}'")
        self.stdout.write(f"key (shown once): {made.secret}")
