"""Create, limit and revoke API keys; used by the admin, the JSON API and commands."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from keys.models import ApiKey
from relay.core.classes import CLASSES

#: The fields of a key that are its limits (SPEC §13); None (or empty) means no limit.
LIMIT_FIELDS = (
    "max_concurrent",
    "requests_per_minute",
    "tokens_per_day",
    "tokens_per_month",
    "allowed_models",
    "expires_at",
    "weight",
    "default_class",
    "max_class",
    "deadline_ms",
)


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str


def create_key(name: str, **limits: Any) -> NewKey:
    """A new key named ``name`` with the given limits (see :func:`set_limits`); raises
    ValueError saying what is wrong."""
    name = name.strip()
    if not name:
        raise ValueError("a key needs a name")
    for _ in range(5):  # lookup prefixes are random; retry the rare collision
        key = ApiKey(name=name[:100])
        secret = key.assign_new_secret()
        set_limits(key, **limits)
        try:
            with transaction.atomic():
                key.save()
        except IntegrityError:
            continue
        return NewKey(key, secret)
    raise RuntimeError("could not allocate a unique key prefix")


def set_limits(key: ApiKey, **limits: Any) -> None:
    """Set some of ``key``'s limits (not saved). ``allowed_models`` takes a list (or
    text, one per line or comma-separated), ``None`` or empty for every model;
    ``expires_at`` a datetime (naive means UTC); ``weight`` None means 1. Raises
    ValueError naming the field when a value is out of range."""
    for field, value in limits.items():
        if field not in LIMIT_FIELDS:
            raise ValueError(f"unknown limit '{field}'")
        if field == "allowed_models":
            value = _model_text(value)
        elif field == "weight" and value is None:
            value = 1
        elif field in ("default_class", "max_class"):
            if value is None:
                value = "default"
            if value not in CLASSES:
                raise ValueError(f"{field}: must be one of {', '.join(CLASSES)}")
        elif field == "expires_at" and isinstance(value, dt.datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        setattr(key, field, value)
    try:
        key.clean_fields(exclude=[f.name for f in ApiKey._meta.fields if f.name not in limits])
    except ValidationError as exc:
        problems = [
            f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items()
        ]
        raise ValueError("; ".join(problems)) from None


def _model_text(value: str | Iterable[str] | None) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    names = [str(v).strip() for v in value]
    if any(not n or "\n" in n or "," in n for n in names):
        raise ValueError("allowed_models: names must be non-empty, without commas or newlines")
    return "\n".join(names)


def update_key(key: ApiKey, *, name: str | None = None, **limits: Any) -> ApiKey:
    """Rename ``key`` and/or change its limits, and save it (every server process
    picks the change up at once)."""
    if name is not None:
        if not name.strip():
            raise ValueError("a key needs a name")
        key.name = name.strip()[:100]
    set_limits(key, **limits)
    key.save()
    return key


def revoke_key(key: ApiKey) -> bool:
    """Revoke ``key``; returns False when it already was."""
    if key.revoked_at is not None:
        return False
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at", "updated_at"])
    return True
