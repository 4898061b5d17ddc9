"""Create and revoke API keys; used by the admin, the JSON API and commands."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.utils import timezone

from keys.models import ApiKey


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str


def create_key(name: str) -> NewKey:
    name = name.strip()
    if not name:
        raise ValueError("a key needs a name")
    for _ in range(5):  # lookup prefixes are random; retry the rare collision
        key = ApiKey(name=name[:100])
        secret = key.assign_new_secret()
        try:
            with transaction.atomic():
                key.save()
        except IntegrityError:
            continue
        return NewKey(key, secret)
    raise RuntimeError("could not allocate a unique key prefix")


def revoke_key(key: ApiKey) -> bool:
    """Revoke ``key``; returns False when it already was."""
    if key.revoked_at is not None:
        return False
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at", "updated_at"])
    return True
